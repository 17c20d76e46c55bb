// Per-element formulas shared by the fast paths (the CPU engine's scalar tails and the
// GPU block bodies), __host__ __device__. The scalar reference (reference/) keeps
// its own literal copy on purpose: it is the independent oracle these are tested
// against.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/step_scalars.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// The bias corrections of one AdamW step: bc1 = 1 - beta1^t, bc2 = 1 - beta2^t.
struct BiasCorrections {
  double bc1;
  double bc2;
};

/// Host only: the bias corrections at step t of the formula's betas (the native formula
/// raises its f32-rounded betas), with the C library's pow in binary64.
BiasCorrections adamw_bias_corrections(const AdamWConfig& c, float step);

/// The per-tensor scalars of one AdamW update from the hyper-parameters and the step's
/// bias corrections bc1 = 1 - beta1^t, bc2 = 1 - beta2^t (binary64, computed on the
/// host: prepare_adamw_scalars, or the device bias table). lr and weight decay are
/// arguments, not read from `c`, so a device step can take them from device memory.
/// The same operations on host and device (no contraction: -ffp-contract=off and
/// -fmad=false), so both give the same bits.
STEPCORE_HD_INLINE AdamWScalars adamw_scalars(const AdamWConfig& c, double lr_in,
                                              double weight_decay, double bc1, double bc2) {
  AdamWScalars s;
  if (c.formula == AdamWFormula::native) {
    // The native kernel holds its hyper-parameters in f32.
    const float lr = static_cast<float>(lr_in);
    const float b1 = static_cast<float>(c.beta1);
    const float b2 = static_cast<float>(c.beta2);
    const float wd = static_cast<float>(weight_decay);
    s.decay = static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(wd));
    s.apply_decay = true;
    s.beta1 = b1;
    s.beta2 = b2;
    s.one_minus_beta1 = 1.0f - b1;
    s.one_minus_beta2 = 1.0f - b2;
    s.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
    s.bc2_sqrt = static_cast<float>(sqrt(bc2));
    s.eps = static_cast<float>(c.eps);
  } else {
    // torch's fused CPU AdamW: Python doubles, rounded to f32 at the last moment.
    s.apply_decay = weight_decay != 0.0;
    s.decay = static_cast<float>(1.0 - lr_in * weight_decay);
    const float w = static_cast<float>(1.0 - c.beta1);
    s.lerp_small = fabsf(w) < 0.5f;
    s.lerp_coeff = s.lerp_small ? w : w - 1.0f;
    s.beta1 = static_cast<float>(c.beta1);
    s.beta2 = static_cast<float>(c.beta2);
    s.one_minus_beta1 = w;
    s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
    s.step_size = static_cast<float>(-(lr_in / bc1));
    s.bc2_sqrt = static_cast<float>(sqrt(bc2));
    s.eps = static_cast<float>(c.eps);
  }
  return s;
}

/// The f32 scalars of one SignSGD update (host and device alike).
STEPCORE_HD_INLINE SignSgdScalars sign_sgd_scalars(double lr, double weight_decay) {
  SignSgdScalars s;
  s.neg_lr = static_cast<float>(-lr);
  s.neg_lr_wd = static_cast<float>(-(lr * weight_decay));
  s.apply_decay = weight_decay > 0.0;
  return s;
}

/// One AdamW element of either formula (docs/numerics.md section 7) with the lazy
/// gradient read; the same operation order as the reference, FMAs only where the spec
/// has them (the library builds device code with -fmad=false). The old state is read
/// from Ps/Ms/Vs and the new state written to P/M/V: the same arrays (in place) or
/// separate ones (out of place); element i is read before it is written, so either is legal.
template <class G, class O>
STEPCORE_HD_INLINE void adamw_element(const float* Ps, const float* Ms, const float* Vs, float* P,
                                      float* M, float* V, const G* grad, O* out,
                                      const AdamWScalars& s, bool torch, std::uint64_t tail_begin,
                                      float scale, float clip, std::uint64_t i) {
  float g = to_f32(grad[i]);
  g = round_to<G>(g * scale);
  g = round_to<G>(g * clip);
  float p = Ps[i], m = Ms[i], v = Vs[i];
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
/// The old parameter is read from Ps, the new one written to P (the same array or not).
template <class G, class O>
STEPCORE_HD_INLINE void sign_sgd_element(const float* Ps, float* P, const G* grad, O* out,
                                         const SignSgdScalars& s, std::uint64_t i) {
  const float g = to_f32(grad[i]);
  const float sg = g > 0.0f ? 1.0f : (g < 0.0f ? -1.0f : (g == 0.0f ? 0.0f : g));
  float p = Ps[i];
  if (s.apply_decay) p = fmaf(p, s.neg_lr_wd, p);
  p = fmaf(sg, s.neg_lr, p);
  P[i] = p;
  if constexpr (!std::is_void_v<O>) out[i] = from_f32<O>(p);
}

}  // namespace stepcore::detail
