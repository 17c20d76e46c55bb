// The Adam unit (core/optimizers/unit.hpp): torch.optim.Adam(fused=True)'s formula
// (docs/numerics.md 8a): L2 weight decay added to the gradient read, amsgrad and maximize,
// state exp_avg, exp_avg_sq and (amsgrad) max_exp_avg_sq, a per-tensor step counter. The
// element is the torch Adam family's, shared with AdamW (adamw.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/optimizers/adamw.hpp"
#include "core/optimizers/unit.hpp"
#include "core/step_scalars.hpp"
#include "core/validate.hpp"
#include "stepcore/config.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// Adam's per-tensor scalars: the torch (or torchao) AdamW scalars without decoupled
/// decay, and the L2 factor f32(weight_decay).
template <class F>
struct AdamScalars {
  AdamWScalars<F> base;
  F l2_wd = 0.0f;   ///< f32(weight_decay)
  bool l2 = false;  ///< weight_decay != 0
};

struct Adam {
  using Config = AdamConfig;
  using Scalars = AdamScalars<float>;
  static constexpr const char* kName = OptimizerTraits<Config>::kName;
  // AdamW's slots, in its order (the same kernel's state).
  static constexpr int kSlots = AdamW::kSlots;
  static constexpr const char* const* kSlotNames = AdamW::kSlotNames;
  static constexpr const char* const* kSlotSourceNames = AdamW::kSlotSourceNames;
  static constexpr const bool* kSlotNonNegative = AdamW::kSlotNonNegative;
  /// Its slots may be 8-bit (docs/numerics.md 8f): the torchao formula requantizes them by
  /// torchao's search (8f.1), the torch formula to the nearest code.
  static constexpr bool kQ8 = true;
  static constexpr bool kCountsSteps = true;
  /// 0: torch, 1: torch with amsgrad, 2: torchao, 3: torchao with amsgrad.
  static constexpr int kTorch = 0, kTorchAmsgrad = 1, kTorchao = 2, kTorchaoAmsgrad = 3,
                       kVariants = 4;
  static constexpr bool kReadsScaled = true;
  static constexpr Q8Rule q8_rule(int v) {
    return v == kTorchao || v == kTorchaoAmsgrad ? Q8Rule::torchao : Q8Rule::nearest;
  }

  static constexpr int slots(int v) { return v == kTorchAmsgrad || v == kTorchaoAmsgrad ? 3 : 2; }
  /// Host: throws naming the first bad hyper-parameter or read factor.
  static void validate(const Config& c, GradientRead read) { validate_adam_config(c, read); }
  STEPCORE_HD_INLINE static int variant(const Config& c) {
    if (c.formula == AdamWFormula::torchao) return c.amsgrad ? kTorchaoAmsgrad : kTorchao;
    return c.amsgrad ? kTorchAmsgrad : kTorch;
  }
  /// The self-test's configurations: L2 decay off and on, both branches of the lerp,
  /// maximize, amsgrad, both forms of v in the body, tail widths 8 and 4; torchao's
  /// formula with decay off (its g + 0*p still runs) and on, both lerp branches, amsgrad.
  static constexpr UnitSample<Config> kSamples[] = {
      {{.weight_decay = 0.0, .torch_v_first = false, .torch_tail_width = 8}},
      {{.beta1 = 0.3,
        .weight_decay = 0.1,
        .maximize = true,
        .torch_v_first = false,
        .torch_tail_width = 8}},
      {{.weight_decay = 0.05, .amsgrad = true, .torch_v_first = false, .torch_tail_width = 8}},
      {{.amsgrad = true, .torch_v_first = true, .torch_tail_width = 4}, 0.0f},
      {{.weight_decay = 0.0, .formula = AdamWFormula::torchao}},
      {{.beta1 = 0.3,
        .beta2 = 0.4,
        .weight_decay = 0.05,
        .amsgrad = true,
        .formula = AdamWFormula::torchao}},
  };

  /// The same kernel's AdamW configuration with no decoupled decay: its scalars are Adam's.
  STEPCORE_HD_INLINE static AdamWConfig as_adamw(const Config& c) {
    AdamWConfig w;
    w.lr = c.lr;
    w.beta1 = c.beta1;
    w.beta2 = c.beta2;
    w.eps = c.eps;
    w.weight_decay = 0.0;
    w.formula = c.formula;
    w.maximize = c.maximize;
    w.torch_v_first = c.torch_v_first;
    w.torch_tail_width = c.torch_tail_width;
    return w;
  }
  /// AdamW's bias corrections (those of the same formula).
  static constexpr int kTableColumns = AdamW::kTableColumns;
  static constexpr const char* const* kTableNames = AdamW::kTableNames;
  static constexpr double kTableLimit = AdamW::kTableLimit;
  static double table_entry(const Config& c, int k, float step) {
    return AdamW::table_entry(as_adamw(c), k, step);
  }
  /// AdamW's scalars of the same formula without decoupled decay; the weight decay is the
  /// L2 factor.
  STEPCORE_HD_INLINE static Scalars step_scalars(const Config& c, const StepInputs& in) {
    Scalars s;
    s.base = adamw_scalars(as_adamw(c), in.lr, 0.0, in.row[0], in.row[1]);
    s.l2_wd = static_cast<float>(in.weight_decay);
    s.l2 = in.weight_decay != 0.0;
    return s;
  }
  STEPCORE_HD_INLINE static std::uint64_t tail_begin(const Config& c, std::uint64_t n,
                                                     std::uint64_t lanes = 1) {
    return AdamW::tail_begin(as_adamw(c), n, lanes);
  }

  template <class Ops>
  using Consts = UnitConsts<Ops, AdamScalars>;

  /// docs/numerics.md 8a (torch), 8e (torchao).
  template <class Ops, int V, bool Tail>
  STEPCORE_HD_INLINE static void update(const Consts<Ops>& k, typename Ops::F g, typename Ops::F& p,
                                        typename Ops::F* st) {
    if constexpr (V == kTorchao || V == kTorchaoAmsgrad)
      torchao_adam_update<Ops, V == kTorchaoAmsgrad, /*L2=*/true>(k.base, g, p, st, k.l2_wd);
    else
      torch_adam_update<Ops, V == kTorchAmsgrad, Tail>(k.base, k.minus_one, g, p, st, k.l2,
                                                       k.l2_wd);
  }
};

}  // namespace stepcore::detail
