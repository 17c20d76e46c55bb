// __host__ __device__ bodies of an optimizer launch's tensors with block-wise 8-bit state
// (docs/numerics.md 8f). A thread block steps its task one 8-bit block (kQ8BlockSize
// elements) at a time, lane j on the block's element j, in three phases: each lane's
// update (its state dequantized, the unit's element, the parameter and compute copy
// stored), the block-wide maximum of each slot's new values, each lane's code. The CUDA
// kernel (step_kernels.cu) runs the lanes as its threads with a shared-memory maximum
// between the phases; the executor runs them in turn (q8_block_emulated). The maximum is
// of magnitude bit patterns (integers: any order gives it, NaN patterns above +Inf), so
// both give the CPU engine's and the reference's bits.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/optimizers/all.hpp"
#include "core/q8.hpp"
#include "kernels/block_bodies.hpp"
#include "kernels/plans.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::gpu::detail {

using ::stepcore::detail::Q8Codebook;

// One lane per element of an 8-bit block: the CUDA kernel's threads.
static_assert(kQ8BlockSize == static_cast<std::size_t>(kBlockThreads));

/// The codebook slot s of unit Opt's variant V requantizes with (its map, the variant's
/// rule), from the image in device memory (gpu::q8_codebooks).
/// Both are constants here: a unit's static arrays are host variables, which device code
/// cannot index at run time.
template <class Opt, int V>
STEPCORE_HD_INLINE Q8Codebook q8_slot_codebook(const std::uint32_t* image, int s) {
  using ::stepcore::detail::unit_slot_non_negative;
  constexpr int K = Opt::kSlots;
  static_assert(K <= 3);
  constexpr bool non_negative[3] = {K > 0 && unit_slot_non_negative<Opt>(0),
                                    K > 1 && unit_slot_non_negative<Opt>(1),
                                    K > 2 && unit_slot_non_negative<Opt>(2)};
  constexpr ::stepcore::detail::Q8Rule rule = ::stepcore::detail::unit_q8_rule<Opt>(V);
  return ::stepcore::detail::q8_image_codebook(image, non_negative[s], rule);
}

/// Phase 1, the lane of element i of tensor t: its state slots dequantized (map value
/// times the block's maximum), the unit's element (the torch tail form from `tail`), the
/// parameter stored (and its compute copy); the new state values in st.
template <class Opt, int V, class G, class O>
STEPCORE_HD_INLINE void q8_lane_update(const OptimizerLaunchArgs<Opt>& a, int t, std::uint64_t i,
                                       const Q8Codebook* cb,
                                       const typename Opt::template Consts<ScalarOps>& k_s,
                                       std::uint64_t tail, float scale, float clip, float* st) {
  constexpr int K = Opt::slots(V);
  constexpr int KA = K > 0 ? K : 1;
  const std::uint64_t block = i / kQ8BlockSize;
  float values[KA][1];
  float* state[KA];
  for (int s = 0; s < K; ++s) {
    values[s][0] = f32_from_bits(cb[s].map[a.codes[s][t][i]]) * a.absmax[s][t][block];
    state[s] = values[s];
  }
  O* out = nullptr;
  if constexpr (!std::is_void_v<O>) out = static_cast<O*>(a.out[t]) + i;
  unit_element<Opt, V, G, O>(a.src[0][t] + i, state, a.dst[0][t] + i, state,
                             static_cast<const G*>(a.grad[t]) + i, out, k_s,
                             tail > i ? tail - i : 0, scale, clip, 0);
  for (int s = 0; s < K; ++s) st[s] = values[s][0];
}

/// A value's magnitude bit pattern: the block maximum's operand (NaN patterns order above
/// +Inf, so the maximum finds them).
STEPCORE_HD_INLINE std::uint32_t q8_magnitude(float x) { return f32_bits(x) & 0x7FFFFFFFu; }

/// Phase 3: the code of new value x in a block whose stored maximum is `stored`
/// (q8_stored_max of the block's largest magnitude pattern): RN(x / stored)'s code.
STEPCORE_HD_INLINE std::uint8_t q8_lane_code(const Q8Codebook& cb, float x, float stored) {
  return static_cast<std::uint8_t>(::stepcore::detail::q8_code(cb, x / stored));
}

/// Calls fn(V, G, O) (as integral constants and types) for the launch's variant and
/// tensor t's gradient dtype and output, as optimizer_thread resolves them.
template <class Opt, class Fn>
STEPCORE_HD_INLINE void with_q8_forms(const OptimizerLaunchArgs<Opt>& a, int t, Fn&& fn) {
  with_variant<Opt::kVariants>(Opt::variant(a.config), [&](auto form) STEPCORE_DISPATCH_INLINE {
    with_dtype(a.grad_dtype[t], [&](auto gt) STEPCORE_DISPATCH_INLINE {
      with_output(a.out_kind[t], [&](auto ot) STEPCORE_DISPATCH_INLINE { fn(form, gt, ot); });
    });
  });
}

/// The executor's run of block `block` of a launch of unit Opt on an 8-bit tensor: for
/// each 8-bit block of its task, every lane's update, each slot's maximum, every lane's
/// code (the maximum stored with the block's first lane, as the kernel's thread 0).
template <class Opt>
void q8_block_emulated(const OptimizerLaunchArgs<Opt>& a, int block, const typename Opt::Scalars& s,
                       float scale, float clip, const std::uint32_t* image) {
  const BlockTask task = a.task(block);
  const int t = task.tensor;
  const typename Opt::template Consts<ScalarOps> k_s(s);
  const std::uint64_t tail = Opt::tail_begin(a.config, a.map.numel[t]);
  with_q8_forms(a, t, [&](auto form, auto gt, auto ot) {
    constexpr int V = decltype(form)::value;
    using G = typename decltype(gt)::type;
    using O = typename decltype(ot)::type;
    constexpr int K = Opt::slots(V);
    constexpr int KA = K > 0 ? K : 1;
    Q8Codebook cb[KA];
    for (int k = 0; k < K; ++k) cb[k] = q8_slot_codebook<Opt, V>(image, k);
    float values[KA][kQ8BlockSize];
    for (std::uint64_t b0 = task.begin; b0 < task.end; b0 += kQ8BlockSize) {
      const std::uint64_t n = task.end - b0 < kQ8BlockSize ? task.end - b0 : kQ8BlockSize;
      std::uint32_t top[KA] = {};
      for (std::uint64_t j = 0; j < n; ++j) {
        float st[KA];
        q8_lane_update<Opt, V, G, O>(a, t, b0 + j, cb, k_s, tail, scale, clip, st);
        for (int k = 0; k < K; ++k) {
          values[k][j] = st[k];
          top[k] = q8_magnitude(st[k]) > top[k] ? q8_magnitude(st[k]) : top[k];
        }
      }
      for (int k = 0; k < K; ++k) {
        const float stored = ::stepcore::detail::q8_stored_max(cb[k], top[k]);
        for (std::uint64_t j = 0; j < n; ++j)
          a.codes[k][t][b0 + j] = q8_lane_code(cb[k], values[k][j], stored);
        a.absmax[k][t][b0 / kQ8BlockSize] = stored;
      }
    }
  });
}

}  // namespace stepcore::gpu::detail
