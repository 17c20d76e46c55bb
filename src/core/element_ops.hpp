// Per-element formulas shared by the fast paths (the CPU engine's scalar tails and the
// GPU block bodies), __host__ __device__. The scalar reference (src/reference) keeps
// its own literal copy on purpose: it is the independent oracle these are tested
// against.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// One AdamW element of either formula (docs/numerics.md section 7) with the lazy
/// gradient read; the same operation order as the reference, FMAs only where the spec
/// has them (the library builds device code with -fmad=false).
template <class G, class O>
STEPCORE_HD_INLINE void adamw_element(float* P, float* M, float* V, const G* grad, O* out,
                                      const AdamWScalars& s, bool torch, std::uint64_t tail_begin,
                                      float scale, float clip, std::uint64_t i) {
  float g = to_f32(grad[i]);
  g = round_to<G>(g * scale);
  g = round_to<G>(g * clip);
  float p = P[i], m = M[i], v = V[i];
  if (!torch) {
    p = p * s.decay;
    const float mk = m * s.beta1;
    const float mn = g * s.one_minus_beta1;
    m = mk + mn;
    const float vk = v * s.beta2;
    const float g2 = g * g;
    const float vn = g2 * s.one_minus_beta2;
    v = vk + vn;
    const float d = sqrtf(v) / s.bc2_sqrt + s.eps;
    const float upd = (s.step_size * m) / d;
    p = p - upd;
  } else {
    if (s.apply_decay) p = p * s.decay;
    const float diff = g - m;
    m = fmaf(s.lerp_coeff, diff, s.lerp_small ? m : g);
    const float cg = s.one_minus_beta2 * g;
    if (i < tail_begin) {
      const float vk = v * s.beta2;
      v = fmaf(cg, g, vk);
    } else {
      const float cgg = cg * g;
      v = fmaf(v, s.beta2, cgg);
    }
    const float d = sqrtf(v) / s.bc2_sqrt + s.eps;
    const float upd = (s.step_size * m) / d;
    p = p + upd;
  }
  P[i] = p;
  M[i] = m;
  V[i] = v;
  if constexpr (!std::is_void_v<O>) out[i] = from_f32<O>(p);
}

/// One SignSGD element (docs/numerics.md section 8): sign(+-0) = +0, sign(NaN) = NaN.
template <class G, class O>
STEPCORE_HD_INLINE void sign_sgd_element(float* P, const G* grad, O* out, const SignSgdScalars& s,
                                         std::uint64_t i) {
  const float g = to_f32(grad[i]);
  const float sg = g > 0.0f ? 1.0f : (g < 0.0f ? -1.0f : (g == 0.0f ? 0.0f : g));
  float p = P[i];
  if (s.apply_decay) p = fmaf(p, s.neg_lr_wd, p);
  p = fmaf(sg, s.neg_lr, p);
  P[i] = p;
  if constexpr (!std::is_void_v<O>) out[i] = from_f32<O>(p);
}

}  // namespace stepcore::detail
