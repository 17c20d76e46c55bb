// The per-step scalars of the optimizers, prepared on the host from optim.hpp's
// configurations and used unchanged by every element, thread, ISA and device (the
// reference, the CPU engine's bodies, the GPU block bodies). Internal: an integrator
// passes configurations, never scalars. docs/numerics.md, "AdamW", is the spec.
#pragma once

#include "stepcore/optim.hpp"

namespace stepcore {

/// The per-tensor f32 scalars of one AdamW update (F = float), prepared on the host in
/// double where the formula says so, then used unchanged by every element, thread, ISA
/// and device; over an Ops value type, the same fields splatted (UnitConsts, unit.hpp).
template <class F>
struct AdamWScalars {
  F decay = 1.0f;            ///< parameter multiplier f32(1 - lr*wd); torchao: f32(lr)*f32(wd)
  F beta1 = 0.0f;            ///< native: f32(beta1)
  F beta2 = 0.0f;            ///< f32(beta2)
  F one_minus_beta1 = 0.0f;  ///< native: 1.0f - beta1 in f32
  /// native: 1.0f - beta2 in f32; torch: f32(1 - beta2); torchao: v's lerp coefficient
  /// (w2 or w2 - 1, w2 = f32(1 - beta2))
  F one_minus_beta2 = 0.0f;
  F lerp_coeff = 0.0f;  ///< torch, torchao: w or w - 1, w = f32(1 - beta1)
  /// native: f32(lr / bc1); torch: f32(-(lr / bc1)); torchao: f32(lr)
  F step_size = 0.0f;
  F bc2_sqrt = 1.0f;        ///< f32(sqrt(1 - beta2^step)); torchao: sqrt in f32 of f32 values
  F eps = 0.0f;             ///< f32(eps)
  F bc1 = 1.0f;             ///< torchao: 1 - P(f32(beta1), step) in f32 (docs/numerics.md 8e)
  bool apply_decay = true;  ///< torch skips the multiply when wd == 0
  bool lerp_small = true;   ///< torch, torchao: |w| < 0.5 selects m + w*(g-m)
  bool maximize = false;    ///< torch: the gradient read is negated first (8a)
  bool v_first = false;     ///< torch: v = fma(v, b2, c*g*g) in the body too (7.2)
  bool v_small = true;      ///< torchao: |w2| < 0.5 selects v + w2*(g*g - v)
};

/// Returns the scalars of one AdamW update at `step` (the counter value after
/// its increment). Deterministic: depends only on its arguments and the C
/// library's pow/sqrt in double (see docs/numerics.md).
AdamWScalars<float> prepare_adamw_scalars(const AdamWConfig& config, float step);

/// The f32 scalars of one SignSGD update (F = float; over an Ops value type, splatted).
template <class F>
struct SignSgdScalars {
  F neg_lr = 0.0f;     ///< f32(-lr)
  F neg_lr_wd = 0.0f;  ///< f32(-(lr * wd)), product in double
  bool apply_decay = false;
};

/// Returns the scalars of one SignSGD update.
SignSgdScalars<float> prepare_sign_sgd_scalars(const SignSgdConfig& config);

}  // namespace stepcore
