// Host-side preparation of the per-step optimizer scalars (core/step_scalars.hpp,
// docs/numerics.md).
// Compiled with -ffp-contract=off: every line is the spec's operation order.
#include <cmath>

#include "core/optimizers/adamw.hpp"
#include "core/optimizers/sign_sgd.hpp"
#include "core/step_scalars.hpp"

namespace stepcore {

namespace detail {

BiasCorrections adamw_bias_corrections(const AdamWConfig& c, float step) {
  const double t = static_cast<double>(step);
  if (c.formula == AdamWFormula::torchao) {
    // 1 - P(f32(beta), t) in f32: P the C library's binary32 powf, which torchao's
    // compiled kernel calls (docs/numerics.md 8e).
    auto f32_bc = [t](double beta) {
      return static_cast<double>(1.0f - powf(static_cast<float>(beta), static_cast<float>(t)));
    };
    return {f32_bc(c.beta1), f32_bc(c.beta2)};
  }
  // The native formula raises its f32-rounded betas; torch's the Python doubles.
  const bool native = c.formula == AdamWFormula::native;
  const double b1 = native ? static_cast<double>(static_cast<float>(c.beta1)) : c.beta1;
  const double b2 = native ? static_cast<double>(static_cast<float>(c.beta2)) : c.beta2;
  return {1.0 - std::pow(b1, t), 1.0 - std::pow(b2, t)};
}

}  // namespace detail

// The units' own derivation (core/optimizers/unit.hpp), as every engine takes it.
AdamWScalars<float> prepare_adamw_scalars(const AdamWConfig& c, float step) {
  return detail::unit_scalars<detail::AdamW>(c, step);
}

SignSgdScalars<float> prepare_sign_sgd_scalars(const SignSgdConfig& c) {
  return detail::unit_scalars<detail::SignSgd>(c, 0.0f);
}

}  // namespace stepcore
