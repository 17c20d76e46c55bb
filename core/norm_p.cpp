// The p-norm pieces of core/norm_p.hpp: the exact facts, the exact power sum and the
// final value of docs/numerics.md 6.6. Scalar code (one element at a time, libm's pow):
// every engine and the reference call these, so every ISA and split gives the same bits.
#include "core/norm_p.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "core/fp_env.hpp"
#include "core/norm_finalize.hpp"
#include "core/optimizers/unit.hpp"
#include "core/superaccumulator.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {
namespace {

/// Calls fn(pointer) with t's data as its storage type.
template <class Fn>
void with_data(const ConstTensorView& t, Fn fn) {
  switch (t.dtype) {
    case DType::f32:
      fn(static_cast<const float*>(t.data));
      return;
    case DType::bf16:
      fn(static_cast<const bfloat16_t*>(t.data));
      return;
    case DType::f16:
      fn(static_cast<const float16_t*>(t.data));
      return;
  }
  throw Error(Errc::internal, "tensors", "dtype has no p-norm kernel (validation missed it)");
}

constexpr std::uint32_t kInfBits = 0x7F800000u;

}  // namespace

void validate_p(double p) {
  if (std::isnan(p)) throw Error(Errc::invalid_argument, "p", "the norm order is NaN");
}

bool needs_power_sum(double p) { return std::isfinite(p) && p != 0.0; }

double power_base(const PNormFacts& f, double p) {
  if (!needs_power_sum(p) || f.nan_count != 0) return 0.0;
  if (p > 0) {
    if (f.inf_count != 0) return 0.0;                           // the norm is +Inf
    return static_cast<double>(f32_from_bits(f.max_abs_bits));  // 0: every value is zero
  }
  // p < 0: a zero gives 0; only Inf values (min +Inf) give +Inf: nothing to sum.
  if (f.min_abs_bits == 0 || f.min_abs_bits >= kInfBits) return 0.0;
  return static_cast<double>(f32_from_bits(f.min_abs_bits));
}

void add_facts(const ConstTensorView& t, GradientRead read, std::size_t begin, std::size_t end,
               PNormFacts& f) {
  with_data(t, [&](const auto* data) {
    for (std::size_t i = begin; i < end; ++i) {
      const std::uint32_t a =
          f32_bits(read_gradient(data, i, read.scale, read.clip, read.as_f32)) & 0x7FFFFFFFu;
      ++f.count;
      if (a > kInfBits) {
        ++f.nan_count;
        ++f.nonzero_count;
        continue;
      }
      if (a != 0) ++f.nonzero_count;
      if (a < f.min_abs_bits) f.min_abs_bits = a;
      if (a == kInfBits) {
        ++f.inf_count;
        continue;
      }
      if (a > f.max_abs_bits) f.max_abs_bits = a;
    }
  });
}

void add_powers(const ConstTensorView& t, GradientRead read, std::size_t begin, std::size_t end,
                double base, double p, PowerSum& sum) {
  with_data(t, [&](const auto* data) {
    std::uint32_t since_normalize = 0;
    for (std::size_t i = begin; i < end; ++i) {
      const float x = read_gradient(data, i, read.scale, read.clip, read.as_f32);
      const std::uint32_t a = f32_bits(x) & 0x7FFFFFFFu;
      if (a == 0 || a >= kInfBits)
        continue;  // 0^p = 0 (p > 0; p < 0 never sums a zero),
                   // Inf^p = 0 (p < 0; p > 0 never sums an Inf)
      // |x| / base: one binary64 division; the term is in [0, 1] and finite.
      const double term = std::pow(static_cast<double>(f32_from_bits(a)) / base, p);
      deposit_double<-1074>(sum.digits, term);
      if (++since_normalize == (1u << 30)) {
        normalize_digits(sum.digits);
        since_normalize = 0;
      }
    }
  });
  normalize_digits(sum.digits);
}

void merge(PNormFacts& a, const PNormFacts& b) noexcept {
  a.nan_count += b.nan_count;
  a.inf_count += b.inf_count;
  a.nonzero_count += b.nonzero_count;
  a.count += b.count;
  if (b.max_abs_bits > a.max_abs_bits) a.max_abs_bits = b.max_abs_bits;
  if (b.min_abs_bits < a.min_abs_bits) a.min_abs_bits = b.min_abs_bits;
}

void merge(PowerSum& a, const PowerSum& b) noexcept {
  // Both normalised (digits < 2^32), so the digit sums cannot wrap; the value stays
  // below 2^1139 (at most 2^64 terms of at most 1).
  for (int k = 0; k < kPowerDigits; ++k) a.digits[k] += b.digits[k];
  normalize_digits(a.digits);
}

NormResult finish_p_norm(const PNormFacts& f, const PowerSum& sum, double p) {
  validate_p(p);
  const FpEnvGuard env;
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  NormResult r;
  r.nan_count = f.nan_count;
  r.inf_count = f.inf_count;
  r.finite = f.nan_count == 0 && f.inf_count == 0;
  r.max_abs = f.nan_count ? kNaN : f.inf_count ? kInf : f32_from_bits(f.max_abs_bits);
  if (p == 0.0) {
    // The number of non-zero values (NaN and Inf are non-zero), rounded to f32.
    r.norm = static_cast<float>(f.nonzero_count);
    return r;
  }
  if (f.nan_count != 0) {
    r.norm = kNaN;
    return r;
  }
  if (f.count == 0) {
    r.norm = 0.0f;  // no values: 0 for every order (as the 2-norm's empty sum)
    return r;
  }
  if (p == std::numeric_limits<double>::infinity()) {
    r.norm = r.max_abs;
  } else if (p == -std::numeric_limits<double>::infinity()) {
    r.norm = f32_from_bits(f.min_abs_bits);  // Inf only when every value is +-Inf
  } else if (p > 0 && f.inf_count != 0) {
    r.norm = kInf;
  } else if (p < 0 && f.min_abs_bits == 0) {
    r.norm = 0.0f;  // a zero's term is +Inf, and Inf^(1/p) = 0
  } else if (p < 0 && f.min_abs_bits >= kInfBits) {
    r.norm = kInf;  // every value is +-Inf: every term is 0, and 0^(1/p) = +Inf
  } else {
    const double base = power_base(f, p);
    if (base == 0.0) {
      r.norm = 0.0f;  // p > 0 and every value is zero
    } else {
      const double s = round_digits(sum.digits, 53, -1074);  // RN_64(S) in [1, 2^64]
      const double v = base * std::pow(s, 1.0 / p);
      r.norm = static_cast<float>(v);
    }
  }
  if (!(std::fabs(r.norm) < kInf)) r.finite = false;  // overflow to +Inf (or NaN)
  return r;
}

}  // namespace stepcore::detail
