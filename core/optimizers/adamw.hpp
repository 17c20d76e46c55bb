// The AdamW unit (core/optimizers/unit.hpp): two formulas, `native` and `torch` (docs/
// numerics.md 7; amsgrad and maximize with torch's: 8a), state exp_avg, exp_avg_sq and,
// with amsgrad, max_exp_avg_sq, a per-tensor step counter; and the torch Adam family's
// element, which the Adam unit (adam.hpp) shares.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/optimizers/unit.hpp"
#include "core/step_scalars.hpp"
#include "core/validate.hpp"
#include "stepcore/config.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// The bias corrections of one AdamW step: bc1 = 1 - beta1^t, bc2 = 1 - beta2^t.
struct BiasCorrections {
  double bc1;
  double bc2;
};

/// Host only: the bias corrections at step t of the formula's betas (the native formula
/// raises its f32-rounded betas), with the C library's pow in binary64; torchao's are f32
/// values (1 - powf of the f32 beta, in f32).
BiasCorrections adamw_bias_corrections(const AdamWConfig& c, float step);

/// The per-tensor scalars of one AdamW update from the hyper-parameters and the step's
/// bias corrections bc1 = 1 - beta1^t, bc2 = 1 - beta2^t (binary64, computed on the
/// host: prepare_adamw_scalars, or the device bias table). lr and weight decay are
/// arguments, not read from `c`, so a device step can take them from device memory.
/// The same operations on host and device (no contraction: -ffp-contract=off and
/// -fmad=false), so both give the same bits.
STEPCORE_HD_INLINE AdamWScalars<float> adamw_scalars(const AdamWConfig& c, double lr_in,
                                                     double weight_decay, double bc1, double bc2) {
  AdamWScalars<float> s;
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
  } else if (c.formula == AdamWFormula::torchao) {
    // torchao's compiled AdamW8bit: f32 hyper-parameters, f32 bias corrections (bc1, bc2
    // are f32 values here, docs/numerics.md 8e).
    const float lr = static_cast<float>(lr_in);
    const float wd = static_cast<float>(weight_decay);
    s.decay = lr * wd;
    s.apply_decay = true;
    // torch.compile folds the lerp weight's branch and coefficient in binary64.
    const double w = 1.0 - c.beta1;
    s.lerp_small = fabs(w) < 0.5;
    s.lerp_coeff = static_cast<float>(s.lerp_small ? w : w - 1.0);
    const double w2 = 1.0 - c.beta2;
    s.v_small = fabs(w2) < 0.5;
    s.one_minus_beta2 = static_cast<float>(s.v_small ? w2 : w2 - 1.0);
    s.step_size = lr;
    s.bc1 = static_cast<float>(bc1);
    s.bc2_sqrt = sqrtf(static_cast<float>(bc2));
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
    s.maximize = c.maximize;
    s.v_first = c.torch_v_first;
  }
  return s;
}

/// The torch Adam family's element (docs/numerics.md 7.2 and 8a), written once for AdamW
/// (decoupled decay: p * decay) and Adam (L2: g = fma(p, l2_wd, g) when `l2`), over the
/// torch AdamW scalars `k` as Ops values: maximize negates the read first (a product with
/// `minus_one`); amsgrad keeps max_exp_avg_sq in st[2] and divides by its square root.
/// Tail: torch's scalar-loop forms (of v, and of amsgrad's max) at each tensor's end;
/// k.v_first: v's tail form in the body too (torch's aarch64 NEON build).
template <class Ops, bool Amsgrad, bool Tail>
STEPCORE_HD_INLINE void torch_adam_update(const AdamWScalars<typename Ops::F>& k,
                                          typename Ops::F minus_one, typename Ops::F g,
                                          typename Ops::F& p, typename Ops::F* st, bool l2,
                                          typename Ops::F l2_wd) {
  using F = typename Ops::F;
  F m = st[0], v = st[1];
  if (k.maximize) g = Ops::mul(g, minus_one);  // exact: the sign flips
  if (l2) {
    g = Ops::fma(p, l2_wd, g);
  } else if (k.apply_decay) {
    p = Ops::mul(p, k.decay);
  }
  const F diff = Ops::sub(g, m);
  m = Ops::fma(k.lerp_coeff, diff, k.lerp_small ? m : g);
  const F cg = Ops::mul(k.one_minus_beta2, g);
  if (!Tail && !k.v_first)
    v = Ops::fma(cg, g, Ops::mul(v, k.beta2));  // x86's vector body: fma(c*g, g, v*b2)
  else
    v = Ops::fma(v, k.beta2, Ops::mul(cg, g));  // its scalar tail, aarch64's every element
  F r = v;
  if constexpr (Amsgrad) {
    const F x = st[2];
    if constexpr (!Tail) {
      // torch's vector maximum: NaN when either is NaN, else the larger (v on a tie).
      r = Ops::select(Ops::gt(x, v), x, v);
      r = Ops::select(Ops::is_nan(x), x, r);
    } else {
      r = Ops::select(Ops::lt(x, v), v, x);  // its scalar loop: x < v ? v : x
    }
    st[2] = r;
  }
  const F d = Ops::add(Ops::div(Ops::sqrt(r), k.bc2_sqrt), k.eps);
  p = Ops::add(p, Ops::div(Ops::mul(k.step_size, m), d));
  st[0] = m;
  st[1] = v;
}

/// torchao's AdamW8bit and Adam8bit element (docs/numerics.md 8e), each operation rounded,
/// no FMA: p - (lr*wd)*p (AdamW), or g + wd*p (L2: Adam, wd = l2_wd); torch's lerp
/// decomposition for m and v (coeff*(end - start) + base); amsgrad's NaN-propagating
/// maximum; p - (lr*(m/bc1)) / (sqrt(r)/bc2s + eps).
template <class Ops, bool Amsgrad, bool L2 = false>
STEPCORE_HD_INLINE void torchao_adam_update(const AdamWScalars<typename Ops::F>& k,
                                            typename Ops::F g, typename Ops::F& p,
                                            typename Ops::F* st,
                                            typename Ops::F l2_wd = typename Ops::F{}) {
  using F = typename Ops::F;
  F m = st[0], v = st[1];
  if constexpr (L2)
    g = Ops::add(g, Ops::mul(l2_wd, p));
  else
    p = Ops::sub(p, Ops::mul(k.decay, p));
  m = Ops::add(Ops::mul(k.lerp_coeff, Ops::sub(g, m)), k.lerp_small ? m : g);
  const F g2 = Ops::mul(g, g);
  v = Ops::add(Ops::mul(k.one_minus_beta2, Ops::sub(g2, v)), k.v_small ? v : g2);
  F r = v;
  if constexpr (Amsgrad) {
    const F x = st[2];
    r = Ops::select(Ops::gt(x, v), x, v);  // NaN when either is NaN, else the larger
    r = Ops::select(Ops::is_nan(x), x, r);
    st[2] = r;
  }
  const F d = Ops::add(Ops::div(Ops::sqrt(r), k.bc2_sqrt), k.eps);
  p = Ops::sub(p, Ops::div(Ops::mul(k.step_size, Ops::div(m, k.bc1)), d));
  st[0] = m;
  st[1] = v;
}

struct AdamW {
  using Config = AdamWConfig;
  using Scalars = AdamWScalars<float>;
  static constexpr const char* kName = OptimizerTraits<Config>::kName;
  static constexpr int kSlots = 3;
  static constexpr const char* kSlotNames[kSlots] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static constexpr const char* kSlotSourceNames[kSlots] = {"exp_avg_src", "exp_avg_sq_src",
                                                           "max_exp_avg_sq_src"};
  static constexpr bool kSlotNonNegative[kSlots] = {false, true, true};
  /// Its slots may be 8-bit (docs/numerics.md 8f): the torchao formula requantizes them by
  /// torchao's search (8f.1), the others to the nearest code.
  static constexpr bool kQ8 = true;
  static constexpr Q8Rule q8_rule(int v) {
    return v == kTorchao || v == kTorchaoAmsgrad ? Q8Rule::torchao : Q8Rule::nearest;
  }
  static constexpr bool kCountsSteps = true;
  /// 0: native (no contraction), 1: torch (lerp and v with FMAs), 2: torch with amsgrad,
  /// 3: torchao (no FMA), 4: torchao with amsgrad.
  static constexpr int kNative = 0, kTorch = 1, kTorchAmsgrad = 2, kTorchao = 3,
                       kTorchaoAmsgrad = 4, kVariants = 5;
  static constexpr bool kReadsScaled = true;

  /// The state arrays variant V reads and writes: max_exp_avg_sq only with amsgrad.
  static constexpr int slots(int v) { return v == kTorchAmsgrad || v == kTorchaoAmsgrad ? 3 : 2; }
  /// Host: throws naming the first bad hyper-parameter or read factor.
  static void validate(const Config& c, GradientRead read) {
    validate_adamw_config(c);
    validate_read(read);
  }
  STEPCORE_HD_INLINE static int variant(const Config& c) {
    if (c.formula == AdamWFormula::torchao) return c.amsgrad ? kTorchaoAmsgrad : kTorchao;
    if (c.formula != AdamWFormula::torch) return kNative;
    return c.amsgrad ? kTorchAmsgrad : kTorch;
  }
  /// The self-test's configurations: both formulas with decay on and off, both branches of
  /// torch's lerp (beta1 0.9 and 0.3), maximize, amsgrad, and both forms of v in the body
  /// and tail widths 8 and 4 (torch's x86 and aarch64 builds).
  static constexpr UnitSample<Config> kSamples[] = {
      {{.weight_decay = 0.1, .formula = AdamWFormula::native}},
      {{.weight_decay = 0.0, .formula = AdamWFormula::native}, 6.0f},
      {{.weight_decay = 0.0, .torch_v_first = false, .torch_tail_width = 8}},
      {{.beta1 = 0.3, .weight_decay = 0.1, .torch_v_first = false, .torch_tail_width = 8}},
      {{.weight_decay = 0.1, .maximize = true, .torch_v_first = false, .torch_tail_width = 8}},
      {{.weight_decay = 0.1, .amsgrad = true, .torch_v_first = false, .torch_tail_width = 8}},
      {{.beta1 = 0.3,
        .amsgrad = true,
        .maximize = true,
        .torch_v_first = true,
        .torch_tail_width = 4},
       0.0f},
      {{.weight_decay = 0.1, .formula = AdamWFormula::torchao}},
      {{.beta1 = 0.3,
        .beta2 = 0.4,
        .weight_decay = 0.0,
        .formula = AdamWFormula::torchao,
        .amsgrad = true}},
  };
  /// The bias corrections bc1 = 1 - beta1^t and bc2 = 1 - beta2^t: pow, which the device
  /// does not round as the host's C library does, so the device reads them from a table.
  static constexpr int kTableColumns = 2;
  static constexpr const char* kTableNames[kTableColumns] = {"config.beta1", "config.beta2"};
  /// 1 - beta^t rounds to 1 once beta^t < 2^-54 and stays there (pow decreases in t).
  static constexpr double kTableLimit = 1.0;
  static double table_entry(const Config& c, int k, float step) {
    const BiasCorrections bc = adamw_bias_corrections(c, step);
    return k == 0 ? bc.bc1 : bc.bc2;
  }
  STEPCORE_HD_INLINE static Scalars step_scalars(const Config& c, const StepInputs& in) {
    return adamw_scalars(c, in.lr, in.weight_decay, in.row[0], in.row[1]);
  }
  /// torch's kernel runs its last (n mod lanes*W) elements through a scalar loop its
  /// compiler contracted differently (docs/numerics.md 7.2, 7.3); the native formula has no
  /// tail.
  STEPCORE_HD_INLINE static std::uint64_t tail_begin(const Config& c, std::uint64_t n,
                                                     std::uint64_t lanes = 1) {
    if (c.formula != AdamWFormula::torch) return n;
    const std::uint64_t w =
        c.torch_tail_width > 1 ? static_cast<std::uint64_t>(c.torch_tail_width) : 1;
    return n - n % (lanes * w);
  }

  template <class Ops>
  using Consts = UnitConsts<Ops, AdamWScalars>;

  /// docs/numerics.md 7.1 (native), 7.2 and 8a (torch; Tail: torch's scalar-loop forms).
  template <class Ops, int V, bool Tail>
  STEPCORE_HD_INLINE static void update(const Consts<Ops>& k, typename Ops::F g, typename Ops::F& p,
                                        typename Ops::F* st) {
    using F = typename Ops::F;
    if constexpr (V == kNative) {
      F m = st[0], v = st[1];
      // p*decay; m*b1 + g*omb1; v*b2 + (g*g)*omb2; each operation rounded.
      p = Ops::mul(p, k.decay);
      m = Ops::add(Ops::mul(m, k.beta1), Ops::mul(g, k.one_minus_beta1));
      v = Ops::add(Ops::mul(v, k.beta2), Ops::mul(Ops::mul(g, g), k.one_minus_beta2));
      const F d = Ops::add(Ops::div(Ops::sqrt(v), k.bc2_sqrt), k.eps);
      p = Ops::sub(p, Ops::div(Ops::mul(k.step_size, m), d));
      st[0] = m;
      st[1] = v;
    } else if constexpr (V == kTorchao || V == kTorchaoAmsgrad) {
      torchao_adam_update<Ops, V == kTorchaoAmsgrad>(k, g, p, st);
    } else {
      torch_adam_update<Ops, V == kTorchAmsgrad, Tail>(k, k.minus_one, g, p, st, false, k.decay);
    }
  }
};

}  // namespace stepcore::detail
