// The Adagrad unit (core/optimizers/unit.hpp): torch.optim.Adagrad(fused=True)'s formula
// (docs/numerics.md 8c): state sum, lr_decay through the step counter, weight decay,
// maximize; the same contractions in torch's vector body and tail (no tail form).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/optimizers/unit.hpp"
#include "core/validate.hpp"
#include "stepcore/config.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// Adagrad's per-tensor scalars.
template <class F>
struct AdagradScalars {
  F clr = 0.0f;  ///< f32(lr / fma(step - 1, lr_decay, 1)), binary64 before the rounding
  F wd = 0.0f;   ///< f32(weight_decay)
  F eps = 0.0f;  ///< f32(eps)
  bool apply_decay = false;
  bool maximize = false;
};

struct Adagrad {
  using Config = AdagradConfig;
  using Scalars = AdagradScalars<float>;
  static constexpr const char* kName = OptimizerTraits<Config>::kName;
  static constexpr int kSlots = 1;
  static constexpr const char* kSlotNames[kSlots] = {"sum"};
  static constexpr const char* kSlotSourceNames[kSlots] = {"sum_src"};
  static constexpr bool kCountsSteps = true;
  static constexpr int kVariants = 1;
  static constexpr bool kReadsScaled = true;

  static constexpr int slots(int /*v*/) { return 1; }
  /// The value slot k starts from: torch fills `sum` with initial_accumulator_value.
  static float initial_slot_value(const Config& c, int /*k*/) {
    return static_cast<float>(c.initial_accumulator_value);
  }
  /// Host: throws naming the first bad hyper-parameter or read factor.
  static void validate(const Config& c, GradientRead read) { validate_adagrad_config(c, read); }
  STEPCORE_HD_INLINE static int variant(const Config&) { return 0; }
  /// The self-test's configurations: the defaults; lr decay, weight decay and maximize.
  static constexpr UnitSample<Config> kSamples[] = {
      {{}},
      {{.lr_decay = 0.01, .weight_decay = 0.1, .maximize = true}, 5.0f},
  };
  static constexpr int kTableColumns = 0;
  /// lr_decay's denominator fma(t - 1, lr_decay, 1) and the quotient in binary64: both
  /// correctly rounded, so the device computes them itself.
  STEPCORE_HD_INLINE static Scalars step_scalars(const Config& c, const StepInputs& in) {
    Scalars s;
    const double denom = fma(static_cast<double>(in.t) - 1.0, c.lr_decay, 1.0);
    s.clr = static_cast<float>(in.lr / denom);
    s.wd = static_cast<float>(in.weight_decay);
    s.eps = static_cast<float>(c.eps);
    s.apply_decay = in.weight_decay != 0.0;
    s.maximize = c.maximize;
    return s;
  }
  STEPCORE_HD_INLINE static std::uint64_t tail_begin(const Config&, std::uint64_t n,
                                                     std::uint64_t = 1) {
    return n;
  }

  template <class Ops>
  using Consts = UnitConsts<Ops, AdagradScalars>;

  /// docs/numerics.md 8c: sum = fma(g, g, sum); p = p - (clr*g) / (sqrt(sum) + eps).
  template <class Ops, int V, bool Tail>
  STEPCORE_HD_INLINE static void update(const Consts<Ops>& k, typename Ops::F g, typename Ops::F& p,
                                        typename Ops::F* st) {
    if (k.maximize) g = Ops::mul(g, k.minus_one);  // exact: the sign flips
    if (k.apply_decay) g = Ops::fma(p, k.wd, g);
    const typename Ops::F sum = Ops::fma(g, g, st[0]);
    st[0] = sum;
    p = Ops::sub(p, Ops::div(Ops::mul(k.clr, g), Ops::add(Ops::sqrt(sum), k.eps)));
  }
};

}  // namespace stepcore::detail
