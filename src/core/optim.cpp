// Host-side preparation of the per-step optimizer scalars (docs/numerics.md).
// Compiled with -ffp-contract=off: every line is the spec's operation order.
#include "stepcore/optim.hpp"

#include <cmath>

#include "fp_env.hpp"

namespace stepcore {

AdamWScalars prepare_adamw_scalars(const AdamWConfig& c, float step) {
  const detail::FpEnvGuard env;
  AdamWScalars s;
  const double t = static_cast<double>(step);
  if (c.formula == AdamWFormula::native) {
    // The native kernel holds its hyper-parameters in f32.
    const float lr = static_cast<float>(c.lr);
    const float b1 = static_cast<float>(c.beta1);
    const float b2 = static_cast<float>(c.beta2);
    const float wd = static_cast<float>(c.weight_decay);
    s.decay = static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(wd));
    s.apply_decay = true;
    s.beta1 = b1;
    s.beta2 = b2;
    s.one_minus_beta1 = 1.0f - b1;
    s.one_minus_beta2 = 1.0f - b2;
    const double bc1 = 1.0 - std::pow(static_cast<double>(b1), t);
    const double bc2 = 1.0 - std::pow(static_cast<double>(b2), t);
    s.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
    s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    s.eps = static_cast<float>(c.eps);
  } else {
    // torch's fused CPU AdamW: Python doubles, rounded to f32 at the last moment.
    s.apply_decay = c.weight_decay != 0.0;
    s.decay = static_cast<float>(1.0 - c.lr * c.weight_decay);
    const float w = static_cast<float>(1.0 - c.beta1);
    s.lerp_small = std::fabs(w) < 0.5f;
    s.lerp_coeff = s.lerp_small ? w : w - 1.0f;
    s.beta1 = static_cast<float>(c.beta1);
    s.beta2 = static_cast<float>(c.beta2);
    s.one_minus_beta1 = w;
    s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
    const double bc1 = 1.0 - std::pow(c.beta1, t);
    const double bc2 = 1.0 - std::pow(c.beta2, t);
    s.step_size = static_cast<float>(-(c.lr / bc1));
    s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    s.eps = static_cast<float>(c.eps);
  }
  return s;
}

SignSgdScalars prepare_sign_sgd_scalars(const SignSgdConfig& c) {
  const detail::FpEnvGuard env;
  SignSgdScalars s;
  s.neg_lr = static_cast<float>(-c.lr);
  s.neg_lr_wd = static_cast<float>(-(c.lr * c.weight_decay));
  s.apply_decay = c.weight_decay > 0.0;
  return s;
}

}  // namespace stepcore
