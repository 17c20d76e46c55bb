// The SGD unit (core/optimizers/unit.hpp): torch.optim.SGD(fused=True)'s formula
// (docs/numerics.md 8b): momentum (slot momentum_buffer, only when momentum != 0),
// dampening, nesterov, weight decay and maximize; the step counter tells the first step.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/optimizers/unit.hpp"
#include "core/validate.hpp"
#include "stepcore/config.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// SGD's per-tensor scalars, each rounded once from its double expression.
template <class F>
struct SgdScalars {
  F wd = 0.0f;        ///< f32(weight_decay)
  F momentum = 0.0f;  ///< f32(momentum)
  F keep = 1.0f;      ///< f32(1 - dampening)
  F neg_lr = 0.0f;    ///< f32(-lr)
  bool apply_decay = false;
  bool nesterov = false;
  bool maximize = false;
  bool first = false;  ///< the counter became 1: the buffer starts as the gradient
};

struct Sgd {
  using Config = SgdConfig;
  using Scalars = SgdScalars<float>;
  static constexpr const char* kName = OptimizerTraits<Config>::kName;
  static constexpr int kSlots = 1;
  static constexpr const char* kSlotNames[kSlots] = {"momentum_buffer"};
  static constexpr const char* kSlotSourceNames[kSlots] = {"momentum_buffer_src"};
  static constexpr bool kCountsSteps = true;
  /// 0: no momentum (no buffer), 1: momentum.
  static constexpr int kVariants = 2;
  static constexpr bool kReadsScaled = true;

  static constexpr int slots(int v) { return v; }
  /// Host: throws naming the first bad hyper-parameter or read factor.
  static void validate(const Config& c, GradientRead read) { validate_sgd_config(c, read); }
  STEPCORE_HD_INLINE static int variant(const Config& c) { return c.momentum != 0.0 ? 1 : 0; }
  /// The self-test's configurations: no momentum; momentum with dampening, decay and
  /// maximize (the buffer's body and tail forms, tail width 8); nesterov on the first step
  /// (the buffer starts as the gradient) and later with tail width 4.
  static constexpr UnitSample<Config> kSamples[] = {
      {{.lr = 1e-2, .weight_decay = 0.0}},
      {{.lr = 1e-2,
        .momentum = 0.9,
        .dampening = 0.1,
        .weight_decay = 0.1,
        .maximize = true,
        .torch_tail_width = 8}},
      {{.lr = 1e-2, .momentum = 0.9, .nesterov = true, .torch_tail_width = 8}, 0.0f},
      {{.lr = 1e-2, .momentum = 0.5, .weight_decay = 0.01, .nesterov = true, .torch_tail_width = 4},
       4.0f},
  };
  static constexpr int kTableColumns = 0;
  /// The first step (t == 1) starts the buffer as the gradient.
  STEPCORE_HD_INLINE static Scalars step_scalars(const Config& c, const StepInputs& in) {
    Scalars s;
    s.wd = static_cast<float>(in.weight_decay);
    s.momentum = static_cast<float>(c.momentum);
    s.keep = static_cast<float>(1.0 - c.dampening);
    s.neg_lr = static_cast<float>(-in.lr);
    s.apply_decay = in.weight_decay != 0.0;
    s.nesterov = c.nesterov;
    s.maximize = c.maximize;
    s.first = in.t == 1.0f;
    return s;
  }
  /// torch's scalar loop updates the buffer as fma(b, momentum, g*keep) over the last
  /// (n mod lanes*W) elements (8b, 7.3).
  STEPCORE_HD_INLINE static std::uint64_t tail_begin(const Config& c, std::uint64_t n,
                                                     std::uint64_t lanes = 1) {
    const std::uint64_t w =
        c.torch_tail_width > 1 ? static_cast<std::uint64_t>(c.torch_tail_width) : 1;
    return n - n % (lanes * w);
  }

  template <class Ops>
  using Consts = UnitConsts<Ops, SgdScalars>;

  /// docs/numerics.md 8b.
  template <class Ops, int V, bool Tail>
  STEPCORE_HD_INLINE static void update(const Consts<Ops>& k, typename Ops::F g, typename Ops::F& p,
                                        typename Ops::F* st) {
    if (k.maximize) g = Ops::mul(g, k.minus_one);  // exact: the sign flips
    if (k.apply_decay) g = Ops::fma(p, k.wd, g);
    if constexpr (V == 1) {
      typename Ops::F b = st[0];
      if (k.first)
        b = g;
      else if constexpr (!Tail)
        b = Ops::fma(g, k.keep, Ops::mul(b, k.momentum));  // the vector body
      else
        b = Ops::fma(b, k.momentum, Ops::mul(g, k.keep));  // torch's scalar tail
      st[0] = b;
      g = k.nesterov ? Ops::fma(b, k.momentum, g) : b;
    }
    p = Ops::fma(g, k.neg_lr, p);
  }
};

}  // namespace stepcore::detail
