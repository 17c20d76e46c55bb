// The SignSGD unit (core/optimizers/unit.hpp): p = p*(1 - lr*wd) - lr*sign(g), no state
// (docs/numerics.md section 8).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/optimizers/unit.hpp"
#include "core/step_scalars.hpp"
#include "core/validate.hpp"
#include "stepcore/config.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// The f32 scalars of one SignSGD update (host and device alike).
STEPCORE_HD_INLINE SignSgdScalars<float> sign_sgd_scalars(double lr, double weight_decay) {
  SignSgdScalars<float> s;
  s.neg_lr = static_cast<float>(-lr);
  s.neg_lr_wd = static_cast<float>(-(lr * weight_decay));
  s.apply_decay = weight_decay > 0.0;
  return s;
}

struct SignSgd {
  using Config = SignSgdConfig;
  using Scalars = SignSgdScalars<float>;
  static constexpr const char* kName = OptimizerTraits<Config>::kName;
  static constexpr int kSlots = 0;
  static constexpr const char* const* kSlotNames = nullptr;
  static constexpr const char* const* kSlotSourceNames = nullptr;
  static constexpr bool kCountsSteps = false;
  static constexpr int kVariants = 1;
  /// sign(g) is read from the stored gradient (the read's positive factors are not applied).
  static constexpr bool kReadsScaled = false;

  static constexpr int slots(int /*V*/) { return 0; }
  /// Host: throws naming the first bad hyper-parameter or read factor.
  static void validate(const Config& c, GradientRead read) { validate_sign_sgd_config(c, read); }
  STEPCORE_HD_INLINE static int variant(const Config&) { return 0; }
  /// The self-test's configurations: weight decay off and on.
  static constexpr UnitSample<Config> kSamples[] = {
      {{.lr = 1e-3, .weight_decay = 0.0}},
      {{.lr = 1e-3, .weight_decay = 0.1}},
  };
  static constexpr int kTableColumns = 0;
  STEPCORE_HD_INLINE static Scalars step_scalars(const Config&, const StepInputs& in) {
    return sign_sgd_scalars(in.lr, in.weight_decay);
  }
  STEPCORE_HD_INLINE static std::uint64_t tail_begin(const Config&, std::uint64_t n,
                                                     std::uint64_t = 1) {
    return n;
  }

  template <class Ops>
  using Consts = UnitConsts<Ops, SignSgdScalars, SignConstants>;

  /// sign(g) is spec_sign's (+0 for either zero, the NaN for a NaN). fma(sg, -lr, p) with
  /// sg in {+-1, +0, NaN}: the product is exact, so the separate multiply and add round
  /// once, like the FMA.
  template <class Ops, int V, bool Tail>
  STEPCORE_HD_INLINE static void update(const Consts<Ops>& k, typename Ops::F g, typename Ops::F& p,
                                        typename Ops::F* /*st*/) {
    const typename Ops::F sg = spec_sign<Ops>(g, k.zero, k.one, k.minus_one);
    if (k.apply_decay) p = Ops::fma(p, k.neg_lr_wd, p);
    p = Ops::add(p, Ops::mul(sg, k.neg_lr));
  }
};

}  // namespace stepcore::detail
