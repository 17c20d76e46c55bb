// ring_geometry (managers/offload_layout.hpp): the validated rings of a configuration.
#include "managers/offload_layout.hpp"

#include <algorithm>
#include <string>

#include "stepcore/error.hpp"

namespace stepcore::detail {

RingGeometry ring_geometry(const ManagerConfig& config) {
  if (config.ring_slots == 0 ||
      (config.ring_slots < 0 && config.ring_slots != ManagerConfig::kDefaultRing))
    throw Error(Errc::out_of_range, "ring_slots",
                std::to_string(config.ring_slots) +
                    ": a ring has >= 1 slots, or ManagerConfig::kDefaultRing (-1)");
  if (config.ring_slot_elements == 0)
    throw Error(Errc::out_of_range, "ring_slot_elements", "a slot holds >= 1 elements");
  std::size_t largest = 0;
  for (const ParamSpec& p : config.params) largest = std::max(largest, p.numel);
  RingGeometry g;
  g.slot_elements = piece_span(std::max<std::size_t>(
      1, std::min(config.ring_slot_elements, std::max<std::size_t>(largest, 1))));
  if (config.q8_state)  // a parameter's pieces start at multiples of the slot: on blocks
    g.slot_elements = (g.slot_elements + kQ8BlockSize - 1) / kQ8BlockSize * kQ8BlockSize;
  // The slots the model's gradients fill, packed in order.
  std::size_t slot = 0, used = 0;
  pack_pieces(config, g, 0, config.params.size(), slot, used,
              [](std::size_t, std::size_t, std::size_t, std::size_t, std::size_t) {});
  const std::size_t fill = used != 0 || slot == 0 ? slot + 1 : slot;
  if (config.ring_slots == ManagerConfig::kDefaultRing) {
    g.slots = std::min<std::size_t>(4, fill);
  } else {
    g.slots = static_cast<std::size_t>(config.ring_slots);
    if (g.slots > fill)
      throw Error(Errc::invalid_argument, "ring_slots",
                  std::to_string(g.slots) + " slots of " + std::to_string(g.slot_elements) +
                      " elements: larger than the model, whose gradients fill " +
                      std::to_string(fill));
  }
  return g;
}

}  // namespace stepcore::detail
