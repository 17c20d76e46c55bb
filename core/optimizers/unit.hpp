// What an optimizer unit is, and the scalar operations every unit's element formula is
// instantiated with where one element is computed at a time (the CPU engine's remainder
// and tail loops, the CUDA block bodies). docs/adding-an-optimizer.md explains the parts.
//
// A unit is a struct (core/optimizers/<name>.hpp) holding, once:
//   Config                     its public hyper-parameter record (stepcore/optim.hpp)
//   Scalars                    the per-tensor f32 scalars of one step, prepared on the host
//   kSlots, kSlotNames         its f32 state arrays beside the parameter (names as in torch),
//   kSlotSourceNames           and the names of their out-of-place sources
//   slots(V)                   how many of them variant V uses (the first slots(V))
//   kCountsSteps               whether each tensor has a step counter, incremented first
//   validate(c, read)          host: throws naming the first bad hyper-parameter
//   kVariants, variant(c)      the formulas it can compute (compile-time loop variants)
//   kReadsScaled               whether the gradient read applies the scale and clip
//   scalars(c, step)           host: the Scalars of one tensor whose counter holds `step`
//   tail_begin(c, n, lanes)    where, in a tensor of n elements, the tail form begins; torch's
//                              vector holds `lanes` times its f32 width of the storage type
//                              (1: f32; 2: bf16/f16 params, whose Vectorized<T> is twice as
//                              wide), so a unit with a width-W tail begins it at
//                              n - n mod (lanes * W)
//   Consts<Ops>                the Scalars as Ops values (splatted once per range)
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
#include <type_traits>

#include "core/validate.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/optim.hpp"

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

/// The gradient read of docs/numerics.md section 3 on one element of storage type G:
/// R_G(R_G(f32(g) * scale) * clip) (a factor of exactly 1 changes nothing).
template <class G>
STEPCORE_HD_INLINE float read_gradient(const G* grad, std::uint64_t i, float scale, float clip) {
  float g = to_f32(grad[i]);
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
template <class Opt, int V, class G, class O, class St = float>
STEPCORE_HD_INLINE void unit_element(const typename NoDeduce<St>::type* Ps,
                                     const typename NoDeduce<St>::type* const* Ss,
                                     typename NoDeduce<St>::type* P,
                                     typename NoDeduce<St>::type* const* S, const G* grad, O* out,
                                     const typename Opt::template Consts<ScalarOps>& k,
                                     std::uint64_t tail_begin, float scale, float clip,
                                     std::uint64_t i) {
  const float g = Opt::kReadsScaled ? read_gradient(grad, i, scale, clip) : to_f32(grad[i]);
  constexpr int K = Opt::slots(V);  // the slots this variant reads and writes
  float p = to_f32(Ps[i]);
  float st[K > 0 ? K : 1];
  for (int s = 0; s < K; ++s) st[s] = to_f32(Ss[s][i]);
  if (i < tail_begin)
    Opt::template update<ScalarOps, V, false>(k, g, p, st);
  else
    Opt::template update<ScalarOps, V, true>(k, g, p, st);
  P[i] = from_f32<St>(p);
  for (int s = 0; s < K; ++s) S[s][i] = from_f32<St>(st[s]);
  if constexpr (!std::is_void_v<O>) out[i] = from_f32<O>(p);
}

/// Calls fn(std::integral_constant<int, V>{}) for the run-time variant v of a unit with
/// `Count` variants (v in [0, Count)).
template <int Count, int V = 0, class Fn>
STEPCORE_HD_INLINE void with_variant(int v, Fn&& fn) {
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
