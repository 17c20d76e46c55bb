// The p-norms other than the 2- and 1-norm's exact partials (docs/numerics.md 6.6):
// inf, -inf, 0 and any other finite p, as order-independent pieces an engine computes
// over ranges of elements in any split and combines exactly. Internal: integrators call
// cpu::Engine::p_norm or reference::p_norm.
//
// Two passes. The first collects exact facts (counts, max and min |x|); the second,
// only for p outside {0, 1, 2, +-inf}, sums t = pow(|x| / base, p) in binary64 per
// element, with base = max |x| (p > 0) or min |x| (p < 0) so every term is in [0, 1] and
// the base's own term is 1, and deposits each term exactly into integer digits counting
// units of 2^-1074: the sum cannot depend on order, split, thread count or ISA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::detail {

/// Digits of the power sum: terms <= 1 in units of 2^-1074, up to 2^64 of them, need
/// 1074 + 1 + 64 bits; 36 digits of 32 bits hold them.
inline constexpr int kPowerDigits = 36;

/// The exact facts of the first pass; combine with merge (sums, max, min).
struct PNormFacts {
  std::uint64_t nan_count = 0;
  std::uint64_t inf_count = 0;
  std::uint64_t nonzero_count = 0;           ///< values != 0 (NaN and Inf included)
  std::uint32_t max_abs_bits = 0;            ///< max |x| over finite x (bit pattern)
  std::uint32_t min_abs_bits = 0x7F800000u;  ///< min |x| over non-NaN x (+Inf: none)
  std::uint64_t count = 0;                   ///< values seen
};

/// The exact power sum of the second pass: sum of pow(|x| / base, p) * 2^1074.
struct PowerSum {
  std::uint64_t digits[kPowerDigits] = {};
};

/// Throws Errc::invalid_argument naming 'p' when p is NaN (every other double is an order).
void validate_p(double p);

/// Whether order p needs the power sum (the second pass): p finite, not 0, 1 or 2.
bool needs_power_sum(double p);

/// The scale of the second pass for order p: max |x| for p > 0, min |x| for p < 0 (a
/// positive finite double), or 0 when no term needs summing (no finite non-zero value,
/// a NaN, or for p > 0 an Inf, or for p < 0 a zero: the norm is then known).
double power_base(const PNormFacts& facts, double p);

/// Adds the facts of the read values of t's elements [begin, end) to `facts`.
void add_facts(const ConstTensorView& t, GradientRead read, std::size_t begin, std::size_t end,
               PNormFacts& facts);
/// Adds pow(|x| / base, p) of the finite read values x of t's elements [begin, end) to `sum`
/// exactly (normalised on return). base > 0 as power_base returned.
void add_powers(const ConstTensorView& t, GradientRead read, std::size_t begin, std::size_t end,
                double base, double p, PowerSum& sum);

void merge(PNormFacts& a, const PNormFacts& b) noexcept;
void merge(PowerSum& a, const PowerSum& b) noexcept;

/// The p-norm (docs/numerics.md 6.6) from the merged facts and, when needs_power_sum(p)
/// and power_base(facts, p) > 0, the merged power sum (otherwise ignored).
NormResult finish_p_norm(const PNormFacts& facts, const PowerSum& sum, double p);

}  // namespace stepcore::detail
