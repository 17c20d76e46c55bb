// What both gradient managers do the same way, in one place: the compute weights of a
// master (round_into), the views of one allocation (SlabViews, laid out by layout_slab),
// and the parameter groups of a range of parameters (for_each_group).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "stepcore/convert.hpp"
#include "stepcore/host_slab.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::detail {

/// Writes `master` rounded to out.dtype into `out` (host memory, out.numel ==
/// master.size()): the compute weights of a master. f32: a copy; bf16, f16: nearest,
/// ties to even (convert.hpp), the rounding every optimizer kernel applies.
inline void round_into(std::span<const float> master, const TensorView& out) {
  switch (out.dtype) {
    case DType::f32:
      if (!master.empty()) std::memcpy(out.data, master.data(), master.size_bytes());
      return;
    case DType::bf16:
      for (std::size_t j = 0; j < master.size(); ++j)
        static_cast<std::uint16_t*>(out.data)[j] = f32_to_bf16_bits(master[j]);
      return;
    case DType::f16:
      for (std::size_t j = 0; j < master.size(); ++j)
        static_cast<std::uint16_t*>(out.data)[j] = f32_to_f16_bits(master[j]);
      return;
  }
}

/// The views of one allocation (device memory, pinned or placed host memory): add()
/// each view's size (zero allowed) and keep its index; layout() places them in order by
/// layout_slab, each at a kSlabViewAlignment-aligned offset.
class SlabViews {
 public:
  /// Adds a view of `bytes` bytes; returns its index in layout().offsets.
  std::size_t add(std::size_t bytes) {
    bytes_.push_back(bytes);
    return bytes_.size() - 1;
  }
  SlabLayout layout() const { return layout_slab(bytes_); }

 private:
  std::vector<std::size_t> bytes_;
};

/// Returns `bytes` rounded up to kSlabViewAlignment: what a view takes in a slab.
inline std::size_t aligned_bytes(std::size_t bytes) {
  return (bytes + kSlabViewAlignment - 1) / kSlabViewAlignment * kSlabViewAlignment;
}

/// Returns the bytes to allocate for `layout`: its total, and never less than one
/// aligned block (an allocation is never empty).
inline std::size_t slab_allocation_bytes(const SlabLayout& layout) {
  return std::max(layout.total_bytes, kSlabViewAlignment);
}

/// Calls step(group, params) for each parameter group with members in parameters
/// [first, last), in group order; `params` (a std::span<const std::size_t>) lists the
/// group's parameter indices in order. One optimizer call per group changes no bit:
/// each element's update depends only on its own tensor's configuration.
template <class Step>
void for_each_group(std::span<const ParamSpec> specs, std::size_t groups, std::size_t first,
                    std::size_t last, Step&& step) {
  std::vector<std::size_t> members;
  for (std::size_t group = 0; group < groups; ++group) {
    members.clear();
    for (std::size_t i = first; i < last; ++i)
      if (specs[i].group == group) members.push_back(i);
    if (!members.empty()) step(group, std::span<const std::size_t>(members));
  }
}

}  // namespace stepcore::detail
