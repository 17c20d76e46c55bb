// What an optimizer unit is, and the scalar operations every unit's element formula is
// instantiated with where one element is computed at a time (the CPU engine's remainder
// and tail loops, the CUDA block bodies). docs/adding-an-optimizer.md explains the parts.
//
// A unit is a struct (core/optimizers/<name>.hpp) holding, once:
//   Config                     its public hyper-parameter record (stepcore/optim.hpp),
//                              with double `lr` and `weight_decay` (a schedule's StepHyper);
//                              OptimizerTraits<Config> beside it names the optimizer and
//                              lists its hyper-parameters (every layer reads that list)
//   kName                      OptimizerTraits<Config>::kName
//   Scalars                    the per-tensor f32 scalars of one step: <Name>Scalars<float>,
//                              an aggregate template over the value type whose fields
//                              (F values, bool flags, a nested scalars struct) are the
//                              list, written once: Consts is the same struct over Ops::F
//   kSlots, kSlotNames         its f32 state arrays beside the parameter (names as in torch),
//   kSlotSourceNames           and the names of their out-of-place sources
//   slots(V)                   how many of them variant V uses (the first slots(V))
//   kSlotInitialFields         optional: the real hyper-parameter (OptimizerTraits' name)
//                              whose value each slot starts from (nullptr or absent: +0)
//   kSlotNonNegative           optional: per slot, whether its values are never negative
//                              (a second moment, its maximum, a sum of squares); loaded
//                              state is refused there below zero (absent: no slot is)
//   kQ8, q8_rule(V)            optional: whether its slots may be stored in block-wise 8
//                              bits (docs/numerics.md 8f; absent: no), and the rule variant
//                              V requantizes them by (absent: Q8Rule::nearest)
//   kCountsSteps               whether each tensor has a step counter, incremented first
//   validate(c, read)          host: throws naming the first bad hyper-parameter
//   kVariants, variant(c)      the formulas it can compute (compile-time loop variants)
//   kSamples                   UnitSample<Config>s: the configurations (and step counter
//                              values) the CPU engine's known-answer self-test runs every
//                              kernel of the unit with; together they take every variant
//                              and every form of the update (each formula and flag, decay
//                              on and off, torch's tail forms, the first step where it
//                              differs)
//   kReadsScaled               whether the gradient read applies the scale and clip
//   kTableColumns              how many binary64 values of each step the device cannot
//                              compute bit-exactly (pow, exp: not correctly rounded), 0: none;
//                              with columns also kTableNames (the hyper-parameter of each,
//                              named when its table would be too long), kTableLimit (the
//                              value every column reaches and then keeps) and
//   table_entry(c, k, t)       host: column k's value at step t, in binary64 (the host
//                              computes it each step; the device reads it from a table the
//                              host built once: gpu::make_optimizer_table)
//   step_scalars(c, in)        host and device (STEPCORE_HD): the Scalars of one step from
//                              the config, the counter t, lr, weight decay and the step's
//                              table row (StepInputs); only correctly rounded operations
//                              (IEEE +, -, *, /, sqrt, fma), so host and device agree
//   tail_begin(c, n, lanes)    host and device: where, in a tensor of n elements, the tail
//                              form begins; torch's vector holds `lanes` times its f32 width of the
//                              storage type (1: f32; 2: bf16/f16 params, whose Vectorized<T> is
//                              twice as wide), so a unit with a width-W tail begins it at n - n mod
//                              (lanes * W)
//   Consts<Ops>                UnitConsts<Ops, <Name>Scalars[, SignConstants]>: the Scalars
//                              as Ops values, splatted once per range by splat_scalars
//                              (below, for every unit), with the constants the formula
//                              reads (minus_one; and zero, one for a sign)
//   update<Ops, V, Tail>(k, g, p, st)
//                              the element formula: the new parameter p and state st[0..kSlots)
//                              from the gradient read g and the old ones, written in Ops'
//                              operations only, so the same text runs on every SIMD ISA
//                              (ArchOps), on one element (ScalarOps) and on the GPU
// The reference (reference/) keeps its own literal transliteration: it is the oracle.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <variant>

#include "core/fp_env.hpp"
#include "core/q8.hpp"
#include "core/validate.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/optim.hpp"

// On a dispatch helper (a function or lambda that picks a variant or dtype at run time and
// calls the body for it): always inlined. One that nvcc leaves out of line receives the
// kernel's launch argument by reference, which copies the argument into every thread's
// local memory (tools/check-kernel-resources.py fails on the stack frame and spills).
#define STEPCORE_DISPATCH_INLINE __attribute__((always_inline))

namespace stepcore::detail {

/// One element at a time: each operation one correctly rounded binary32 operation
/// (the library compiles with -ffp-contract=off and device code with -fmad=false), the
/// same contract as the SIMD ArchOps.
struct ScalarOps {
  using F = float;
  using M = bool;
  static STEPCORE_HD_INLINE float set1(float x) { return x; }
  static STEPCORE_HD_INLINE float add(float a, float b) { return a + b; }
  static STEPCORE_HD_INLINE float sub(float a, float b) { return a - b; }
  static STEPCORE_HD_INLINE float mul(float a, float b) { return a * b; }
  static STEPCORE_HD_INLINE float div(float a, float b) { return a / b; }
  static STEPCORE_HD_INLINE float sqrt(float a) { return sqrtf(a); }
  static STEPCORE_HD_INLINE float fma(float a, float b, float c) { return fmaf(a, b, c); }
  static STEPCORE_HD_INLINE bool gt(float a, float b) { return a > b; }
  static STEPCORE_HD_INLINE bool lt(float a, float b) { return a < b; }
  static STEPCORE_HD_INLINE bool eq(float a, float b) { return a == b; }
  static STEPCORE_HD_INLINE bool is_nan(float a) { return a != a; }
  static STEPCORE_HD_INLINE float select(bool m, float a, float b) { return m ? a : b; }
};

// ---- a unit's Scalars as Ops values, splatted field by field (UnitConsts below) ----------

namespace scalars_detail {
/// Converts to any type, in unevaluated brace-initialisations only.
struct AnyField {
  template <class T>
  constexpr operator T() const noexcept;  // never defined
};
/// The number of fields of an aggregate S (a unit's Scalars<float>): the most AnyField
/// values S can be brace-initialised from (a field of class type takes one whole).
template <class S, class... Fields>
constexpr int field_count() {
  if constexpr (requires { S{Fields{}..., AnyField{}}; })
    return field_count<S, Fields..., AnyField>();
  else
    return static_cast<int>(sizeof...(Fields));
}
}  // namespace scalars_detail

template <class Ops, template <class> class S>
STEPCORE_HD_INLINE S<typename Ops::F> splat_scalars(const S<float>& s);

/// One field of a unit's scalars as Ops values: an f32 scalar in every lane, a flag as it
/// is, a nested scalars struct field by field.
template <class Ops>
STEPCORE_HD_INLINE typename Ops::F splat_field(float x) {
  return Ops::set1(x);
}
template <class Ops>
STEPCORE_HD_INLINE bool splat_field(bool x) {
  return x;
}
template <class Ops, template <class> class S>
STEPCORE_HD_INLINE S<typename Ops::F> splat_field(const S<float>& s) {
  return splat_scalars<Ops>(s);
}

/// S<Ops::F> from the fields of an S<float>, in order.
template <class Ops, template <class> class S, class... Fields>
STEPCORE_HD_INLINE S<typename Ops::F> splat_fields(const Fields&... fields) {
  return {splat_field<Ops>(fields)...};
}

/// A unit's scalars S<float> as Ops values, S<Ops::F>: each field splat_field'ed, in
/// order (structured bindings of the aggregate; up to 16 fields). The one splat of every
/// unit: its field list is written once, in S (f32 values first, flags last: the layout
/// the vector bodies were tuned with).
template <class Ops, template <class> class S>
STEPCORE_HD_INLINE S<typename Ops::F> splat_scalars(const S<float>& s) {
  constexpr int n = scalars_detail::field_count<S<float>>();
  static_assert(n >= 1 && n <= 16, "a unit's Scalars has 1 to 16 fields");
#define STEPCORE_SPLAT_CASE(N, ...)           \
  if constexpr (n == N) {                     \
    const auto& [__VA_ARGS__] = s;            \
    return splat_fields<Ops, S>(__VA_ARGS__); \
  } else
  STEPCORE_SPLAT_CASE(1, a)
  STEPCORE_SPLAT_CASE(2, a, b)
  STEPCORE_SPLAT_CASE(3, a, b, c)
  STEPCORE_SPLAT_CASE(4, a, b, c, d)
  STEPCORE_SPLAT_CASE(5, a, b, c, d, e)
  STEPCORE_SPLAT_CASE(6, a, b, c, d, e, f)
  STEPCORE_SPLAT_CASE(7, a, b, c, d, e, f, g)
  STEPCORE_SPLAT_CASE(8, a, b, c, d, e, f, g, h)
  STEPCORE_SPLAT_CASE(9, a, b, c, d, e, f, g, h, i)
  STEPCORE_SPLAT_CASE(10, a, b, c, d, e, f, g, h, i, j)
  STEPCORE_SPLAT_CASE(11, a, b, c, d, e, f, g, h, i, j, k)
  STEPCORE_SPLAT_CASE(12, a, b, c, d, e, f, g, h, i, j, k, l)
  STEPCORE_SPLAT_CASE(13, a, b, c, d, e, f, g, h, i, j, k, l, m)
  STEPCORE_SPLAT_CASE(14, a, b, c, d, e, f, g, h, i, j, k, l, m, o)
  STEPCORE_SPLAT_CASE(15, a, b, c, d, e, f, g, h, i, j, k, l, m, o, q)
  STEPCORE_SPLAT_CASE(16, a, b, c, d, e, f, g, h, i, j, k, l, m, o, q, r)
  return splat_fields<Ops, S>();  // not reached: n is in [1, 16]
#undef STEPCORE_SPLAT_CASE
}

/// The constant every formula may read besides its scalars: -1 (maximize negates the
/// read by a multiplication with it, exact).
template <class F>
struct UnitConstants {
  F minus_one;
  template <class Ops>
  STEPCORE_HD_INLINE static UnitConstants splat() {
    return {Ops::set1(-1.0f)};
  }
};

/// The constants of a formula that takes a sign (spec_sign): +0, 1 and -1.
template <class F>
struct SignConstants {
  F zero, one, minus_one;
  template <class Ops>
  STEPCORE_HD_INLINE static SignConstants splat() {
    return {Ops::set1(0.0f), Ops::set1(1.0f), Ops::set1(-1.0f)};
  }
};

/// What a unit's update reads: its Scalars<float> as Ops values (k.beta1) and the
/// constants C (k.minus_one), splatted once per range. A unit's Consts<Ops> is
/// UnitConsts<Ops, its Scalars template> (with SignConstants when it takes a sign).
template <class Ops, template <class> class S, template <class> class C = UnitConstants>
struct UnitConsts : S<typename Ops::F>, C<typename Ops::F> {
  STEPCORE_HD_INLINE explicit UnitConsts(const S<float>& s)
      : S<typename Ops::F>(splat_scalars<Ops>(s)),
        C<typename Ops::F>(C<typename Ops::F>::template splat<Ops>()) {}
};

/// The gradient read of docs/numerics.md section 3 on one element of storage type G:
/// R_G(R_G(f32(g) * scale) * clip) (a factor of exactly 1 changes nothing), or with
/// as_f32 the products rounded in f32 (GradientRead::as_f32).
template <class G>
STEPCORE_HD_INLINE float read_gradient(const G* grad, std::uint64_t i, float scale, float clip,
                                       bool as_f32 = false) {
  float g = to_f32(grad[i]);
  if (as_f32) return g * scale * clip;  // (g * scale) * clip, each product rounded in f32
  g = round_to<G>(g * scale);
  g = round_to<G>(g * clip);
  return g;
}

/// T itself, in a context that deduces nothing (unit_element's storage type).
template <class T>
struct NoDeduce {
  using type = T;
};

/// One element of unit Opt's step, variant V, as every fast path computes it one at a
/// time: the old parameter and state read from Ps/Ss, the new ones written to P/S (the
/// same arrays, in place, or separate ones: element i is read before it is written), the
/// parameter rounded to O into out (O void: none). Elements at or after tail_begin use
/// the unit's tail form. St is the storage type of the parameter and state (f32, or the
/// model's bf16/f16: docs/numerics.md 7.3): each is widened exactly when read, the
/// formula runs in f32, and each new value is rounded to St (nearest even) when stored.
/// Sl: the state's storage type where it differs (f32 beside a 16-bit parameter: the
/// dequantized values of 8-bit slots, docs/numerics.md 8f).
template <class Opt, int V, class G, class O, class St = float, class Sl = St>
STEPCORE_HD_INLINE void unit_element(const typename NoDeduce<St>::type* Ps,
                                     const typename NoDeduce<Sl>::type* const* Ss,
                                     typename NoDeduce<St>::type* P,
                                     typename NoDeduce<Sl>::type* const* S, const G* grad, O* out,
                                     const typename Opt::template Consts<ScalarOps>& k,
                                     std::uint64_t tail_begin, float scale, float clip,
                                     std::uint64_t i, bool as_f32 = false) {
  const float g = Opt::kReadsScaled ? read_gradient(grad, i, scale, clip, as_f32) : to_f32(grad[i]);
  constexpr int K = Opt::slots(V);  // the slots this variant reads and writes
  float p = to_f32(Ps[i]);
  float st[K > 0 ? K : 1];
  for (int s = 0; s < K; ++s) st[s] = to_f32(Ss[s][i]);
  if (i < tail_begin)
    Opt::template update<ScalarOps, V, false>(k, g, p, st);
  else
    Opt::template update<ScalarOps, V, true>(k, g, p, st);
  P[i] = from_f32<St>(p);
  for (int s = 0; s < K; ++s) S[s][i] = from_f32<Sl>(st[s]);
  if constexpr (!std::is_void_v<O>) out[i] = from_f32<O>(p);
}

/// One configuration of a unit's kSamples, with the value its step counter holds before
/// the step (units that count steps; 0: the first step). The CPU engine's self-test
/// (cpu/self_test.cpp) runs every kernel of the unit with each, against the reference.
template <class C>
struct UnitSample {
  C config;
  float step = 2.0f;
};

/// What a unit's step_scalars derives one step's Scalars from, besides its Config: the
/// same values on the host (unit_scalars) and on the device (read from device memory when
/// the kernel runs: gpu block bodies), so a replayed CUDA graph takes each step's values.
struct StepInputs {
  float t = 0.0f;               ///< the step counter after its increment (0: the unit counts none)
  double lr = 0.0;              ///< the learning rate of this step
  double weight_decay = 0.0;    ///< the weight decay of this step
  const double* row = nullptr;  ///< the unit's kTableColumns table values of step t
};

/// sign(x) as docs/numerics.md 8 (SignSGD) and 8d (Lion) define it, in Ops' selects: +1,
/// -1, +0 for either zero, and the NaN itself for a NaN (ordered compares are false on a
/// NaN, so the selects keep x). `zero`, `one`, `minus_one`: the splatted constants.
template <class Ops>
STEPCORE_HD_INLINE typename Ops::F spec_sign(typename Ops::F x, typename Ops::F zero,
                                             typename Ops::F one, typename Ops::F minus_one) {
  const typename Ops::F s =
      Ops::select(Ops::gt(x, zero), one, Ops::select(Ops::lt(x, zero), minus_one, x));
  return Ops::select(Ops::eq(x, zero), zero, s);
}

/// Host: the Scalars of one tensor of unit Opt whose counter holds `step` (after its
/// increment), with lr and weight decay from the config: the table row from
/// Opt::table_entry, then Opt::step_scalars, in the spec's floating-point environment.
template <class Opt>
typename Opt::Scalars unit_scalars(const typename Opt::Config& c, float step) {
  const FpEnvGuard env;
  double row[Opt::kTableColumns > 0 ? Opt::kTableColumns : 1] = {};
  if constexpr (Opt::kTableColumns > 0)
    for (int k = 0; k < Opt::kTableColumns; ++k) row[k] = Opt::table_entry(c, k, step);
  return Opt::step_scalars(c, StepInputs{step, c.lr, c.weight_decay, row});
}

/// The value slot k of a fresh unit Opt optimizer starts from: f32 of the real
/// hyper-parameter the unit's kSlotInitialFields names for it (Adagrad's sum:
/// initial_accumulator_value), else +0. core/optimizer_table.cpp checks the names.
template <class Opt>
constexpr float unit_initial_slot(const typename Opt::Config& c, int k) {
  if constexpr (requires { Opt::kSlotInitialFields; }) {
    const char* field = Opt::kSlotInitialFields[k];
    if (field == nullptr) return 0.0f;
    for (const auto& f : OptimizerTraits<typename Opt::Config>::kFields) {
      const auto* m = std::get_if<double Opt::Config::*>(&f.member);
      if (m != nullptr && std::string_view(f.name) == field) return static_cast<float>(c.**m);
    }
  }
  return 0.0f;
}

/// Whether slot k of unit Opt is never negative (its kSlotNonNegative; absent: false).
template <class Opt>
constexpr bool unit_slot_non_negative(int k) {
  if constexpr (requires { Opt::kSlotNonNegative; })
    return Opt::kSlotNonNegative[k];
  else
    return false;
}

/// Whether unit Opt's slots may be stored in block-wise 8 bits (its kQ8; absent: false).
template <class Opt>
constexpr bool unit_takes_q8() {
  if constexpr (requires { Opt::kQ8; })
    return Opt::kQ8;
  else
    return false;
}

/// The rule variant v of unit Opt requantizes its 8-bit slots by (its q8_rule; absent:
/// Q8Rule::nearest).
template <class Opt>
constexpr Q8Rule unit_q8_rule(int v) {
  if constexpr (requires { Opt::q8_rule(0); })
    return Opt::q8_rule(v);
  else
    return Q8Rule::nearest;
}

/// Calls fn(std::integral_constant<int, V>{}) for the run-time variant v of a unit with
/// `Count` variants (v in [0, Count)).
template <int Count, int V = 0, class Fn>
STEPCORE_HD_INLINE STEPCORE_DISPATCH_INLINE void with_variant(int v, Fn&& fn) {
  if constexpr (V + 1 < Count) {
    if (v != V) return with_variant<Count, V + 1>(v, static_cast<Fn&&>(fn));
  }
  fn(std::integral_constant<int, V>{});
}

/// A list of units: core/optimizers/all.hpp names every unit the library builds.
template <class... Units>
struct UnitList {
  /// Calls fn(Unit{}) for each unit, in order.
  template <class Fn>
  static void for_each(Fn&& fn) {
    (fn(Units{}), ...);
  }
};

/// Host: throws unless a call of unit Opt is valid, before anything is written: the
/// unit's hyper-parameters and read, then every tensor with the slots its variant uses
/// (named by the unit). The one checker of every entry point that takes OptimizerTensor
/// records: the engines and the reference.
template <class Opt>
void validate_unit(std::span<const OptimizerTensor> tensors, const typename Opt::Config& config,
                   GradientRead read, StepCounters counters = StepCounters::read,
                   ParamDTypes dtypes = ParamDTypes::f32) {
  Opt::validate(config, read);
  validate_optimizer_tensors(tensors, {Opt::kSlotNames, Opt::kSlotSourceNames},
                             Opt::slots(Opt::variant(config)), Opt::kCountsSteps, counters, dtypes);
}

/// The unit of a UnitList whose Config is `Config`.
template <class Config, class List>
struct UnitForConfig;
template <class Config, class First, class... Rest>
struct UnitForConfig<Config, UnitList<First, Rest...>> {
  using type = std::conditional_t<std::is_same_v<typename First::Config, Config>, First,
                                  typename UnitForConfig<Config, UnitList<Rest...>>::type>;
};
template <class Config>
struct UnitForConfig<Config, UnitList<>> {
  using type = void;  // no unit has this configuration
};

}  // namespace stepcore::detail
