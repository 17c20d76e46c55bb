// The Lion unit (core/optimizers/unit.hpp): p -= lr*sign(beta1*m + (1-beta1)*g) with
// decoupled weight decay, then m = beta2*m + (1-beta2)*g (docs/numerics.md 8d).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/optimizers/unit.hpp"
#include "core/validate.hpp"
#include "stepcore/config.hpp"
#include "stepcore/error.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// Lion's per-call scalars, each rounded once from binary64 (8d).
template <class F>
struct LionScalars {
  F b1 = 0.0f;        ///< f32(beta1)
  F c1 = 0.0f;        ///< f32(1 - beta1)
  F b2 = 0.0f;        ///< f32(beta2)
  F c2 = 0.0f;        ///< f32(1 - beta2)
  F neg_lr = 0.0f;    ///< f32(-lr)
  F neg_lrwd = 0.0f;  ///< f32(-(lr * weight_decay))
  bool apply_decay = false;
};

struct Lion {
  using Config = LionConfig;
  using Scalars = LionScalars<float>;
  static constexpr const char* kName = OptimizerTraits<Config>::kName;
  static constexpr int kSlots = 1;
  static constexpr const char* kSlotNames[kSlots] = {"exp_avg"};
  static constexpr const char* kSlotSourceNames[kSlots] = {"exp_avg_src"};
  static constexpr bool kCountsSteps = false;  // the update does not depend on the step
  static constexpr int kVariants = 1;
  /// The update compares the gradient with the momentum: the read applies scale and clip.
  static constexpr bool kReadsScaled = true;

  static constexpr int slots(int /*V*/) { return 1; }

  /// Host: throws naming the first bad hyper-parameter or read factor (8d, section 9).
  static void validate(const Config& c, GradientRead read) {
    const auto bad = [](Errc code, const char* name, const char* why) {
      throw Error(code, name, why);
    };
    const auto finite = [&](double v, const char* name) {
      if (!std::isfinite(v)) bad(Errc::non_finite, name, "must be finite");
    };
    finite(c.lr, "config.lr");
    if (c.lr < 0.0) bad(Errc::invalid_argument, "config.lr", "must be >= 0");
    finite(c.beta1, "config.beta1");
    if (!(c.beta1 >= 0.0 && c.beta1 <= 1.0))
      bad(Errc::invalid_argument, "config.beta1", "must be in [0, 1]");
    finite(c.beta2, "config.beta2");
    if (!(c.beta2 >= 0.0 && c.beta2 <= 1.0))
      bad(Errc::invalid_argument, "config.beta2", "must be in [0, 1]");
    finite(c.weight_decay, "config.weight_decay");
    if (c.weight_decay < 0.0) bad(Errc::invalid_argument, "config.weight_decay", "must be >= 0");
    if (!std::isfinite(static_cast<float>(c.lr)))
      bad(Errc::out_of_range, "config.lr", "must be finite in f32");
    if (c.lr * c.weight_decay > 1.0)
      bad(Errc::invalid_argument, "config.weight_decay", "lr * weight_decay must be <= 1");
    validate_read(read);
  }
  STEPCORE_HD_INLINE static int variant(const Config&) { return 0; }
  /// The self-test's configurations: weight decay off and on.
  static constexpr UnitSample<Config> kSamples[] = {
      {{}},
      {{.lr = 1e-3, .beta1 = 0.95, .beta2 = 0.98, .weight_decay = 0.1}},
  };
  static constexpr int kTableColumns = 0;
  /// Every scalar one rounding of a binary64 value (1 - beta is exact in binary64 for a
  /// beta in [0.5, 1], and one correctly rounded subtraction below).
  STEPCORE_HD_INLINE static Scalars step_scalars(const Config& c, const StepInputs& in) {
    Scalars s;
    s.b1 = static_cast<float>(c.beta1);
    s.c1 = static_cast<float>(1.0 - c.beta1);
    s.b2 = static_cast<float>(c.beta2);
    s.c2 = static_cast<float>(1.0 - c.beta2);
    s.neg_lr = static_cast<float>(-in.lr);
    s.neg_lrwd = static_cast<float>(-(in.lr * in.weight_decay));
    s.apply_decay = in.weight_decay > 0.0;
    return s;
  }
  /// No tail form: every element computes the same lines.
  STEPCORE_HD_INLINE static std::uint64_t tail_begin(const Config&, std::uint64_t n,
                                                     std::uint64_t = 1) {
    return n;
  }

  template <class Ops>
  using Consts = UnitConsts<Ops, LionScalars, SignConstants>;

  /// docs/numerics.md 8d. u and the new m are three roundings each (no FMA); sign(u) is
  /// spec_sign's. s * neg_lr is exact, so the separate multiply and add round once;
  /// +0 * neg_lr = -0 leaves every p (signed zeros included) as it was.
  template <class Ops, int V, bool Tail>
  STEPCORE_HD_INLINE static void update(const Consts<Ops>& k, typename Ops::F g, typename Ops::F& p,
                                        typename Ops::F* st) {
    using F = typename Ops::F;
    const F m = st[0];
    const F u = Ops::add(Ops::mul(k.b1, m), Ops::mul(k.c1, g));
    const F s = spec_sign<Ops>(u, k.zero, k.one, k.minus_one);
    if (k.apply_decay) p = Ops::fma(p, k.neg_lrwd, p);
    p = Ops::add(p, Ops::mul(s, k.neg_lr));
    st[0] = Ops::add(Ops::mul(k.b2, m), Ops::mul(k.c2, g));
  }
};

}  // namespace stepcore::detail
