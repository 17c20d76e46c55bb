// A tensor's 8-bit state slots (docs/numerics.md 8f) as the engine and the self-test hand
// them to a unit's q8 kernel (kernel_table.hpp: Q8Slots, UnitKernels::q8).
#pragma once

#include "core/q8.hpp"
#include "cpu/kernel_table.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::cpu::detail {

/// The 8-bit slots of tensor `t` in a step of unit Opt's variant `variant`, each with the
/// codebook of its map (kSlotNonNegative) under the variant's rule; slots 0 when it has
/// none (validation makes a tensor's used slots all 8-bit or none).
template <class Opt>
Q8Slots q8_slots(const OptimizerTensor& t, int variant) {
  Q8Slots q;
  if constexpr (::stepcore::detail::unit_takes_q8<Opt>()) {
    const int used = Opt::slots(variant);
    if (used == 0 || (t.q8[0].codes == nullptr && t.q8[0].absmax == nullptr)) return q;
    const ::stepcore::detail::Q8Rule rule = ::stepcore::detail::unit_q8_rule<Opt>(variant);
    q.slots = used;
    q.grad_dtype = static_cast<int>(t.grad.dtype);
    q.output_kind = output_kind(t.compute_param);
    for (int s = 0; s < used; ++s) {
      q.codes[s] = t.q8[s].codes;
      q.absmax[s] = t.q8[s].absmax;
      q.codebook[s] = &::stepcore::detail::q8_codebook(
          ::stepcore::detail::unit_slot_non_negative<Opt>(s), rule);
    }
  }
  return q;
}

/// The q8 kernel of unit Opt for param, gradient and output dtype indices p, g, o (null
/// where there is none: a 16-bit param has no compute output).
template <class Opt>
Q8Fn<Opt> q8_kernel(const UnitKernels<Opt>& kernels, int p, int g, int o) {
  if (p < 0 || p >= kDTypes || g < 0 || g >= kDTypes || o < 0 || o >= kOutputKinds) return nullptr;
  if (p != 0 && o != 0) return nullptr;
  return kernels.q8[p];
}

}  // namespace stepcore::cpu::detail
