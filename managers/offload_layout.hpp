// The full-offload manager's rings and host layout as functions of its configuration:
// what OffloadGradientManager allocates and what the planner (stepcore-plan) predicts,
// computed in one place.
#pragma once

#include <cstddef>
#include <cstdint>

#include "stepcore/managers.hpp"

namespace stepcore::detail {

/// Pieces in a ring slot start at multiples of this many elements (aligned views).
inline constexpr std::size_t kPieceAlignment = 64;

/// Returns n rounded up to a multiple of kPieceAlignment.
inline std::size_t piece_span(std::size_t n) {
  return (n + kPieceAlignment - 1) / kPieceAlignment * kPieceAlignment;
}

/// Whether a parameter of `numel` elements keeps 8-bit state slots (ManagerConfig::q8_state,
/// min_8bit_size): codes and block maxima instead of f32 values.
inline bool q8_slots(const ManagerConfig& config, std::size_t numel) noexcept {
  return config.q8_state && numel >= config.min_8bit_size;
}

/// The rings of a full-offload manager: `slots` slots of `slot_elements` elements each.
struct RingGeometry {
  std::size_t slots = 1, slot_elements = kPieceAlignment;
};

/// Returns the configuration's ring (ManagerConfig::ring_slots, ring_slot_elements),
/// validated: Errc::out_of_range naming "ring_slots" (0, or negative other than
/// kDefaultRing) or "ring_slot_elements" (0); Errc::invalid_argument naming "ring_slots"
/// for more slots than the model's gradients fill. Needs validated params. With
/// ManagerConfig::q8_state a slot holds a multiple of kQ8BlockSize elements, so every
/// piece of a parameter starts on a block boundary.
RingGeometry ring_geometry(const ManagerConfig& config);

/// Calls place(param, offset, count, slot, at) for each piece of parameters [first, last)
/// packed into a ring of `g` starting at (slot, used): pieces of at most g.slot_elements
/// elements, each at a piece_span-aligned position `at` of its slot, a new slot when the
/// piece does not fit what is left; `slot` counts slots used from the start (modulo
/// nothing: the caller wraps). Zero-element parameters get one empty piece.
template <class Place>
void pack_pieces(const ManagerConfig& config, const RingGeometry& g, std::size_t first,
                 std::size_t last, std::size_t& slot, std::size_t& used, Place&& place) {
  for (std::size_t i = first; i < last; ++i) {
    const std::size_t numel = config.params[i].numel;
    std::size_t off = 0;
    do {
      const std::size_t n = numel - off < g.slot_elements ? numel - off : g.slot_elements;
      if (used != 0 && used + n > g.slot_elements) {
        ++slot;
        used = 0;
      }
      place(i, off, n, slot, used);
      used += piece_span(n);
      off += n;
    } while (off < numel);
  }
}

}  // namespace stepcore::detail
