// The final rounding of the exact norm as __host__ __device__ code, so the device can
// finalise a reduced partial (and compute the clip coefficient) without a host round
// trip. stepcore::finalize (core/norm.cpp) is the host entry point. Internal.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/superaccumulator.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/norm.hpp"

namespace stepcore::detail {

using u128 = unsigned __int128;

/// Returns the number of significant bits of v.
STEPCORE_HD_INLINE int bit_length64(std::uint64_t v) {
  int n = 0;
  while (v) {
    ++n;
    v >>= 1;
  }
  return n;
}
STEPCORE_HD_INLINE int bit_length128(u128 v) {
  const auto hi = static_cast<std::uint64_t>(v >> 64);
  return hi ? 64 + bit_length64(hi) : bit_length64(static_cast<std::uint64_t>(v));
}

/// Returns floor(sqrt(t)) for t < 2^100.
STEPCORE_HD_INLINE std::uint64_t isqrt128(u128 t) {
  auto q = static_cast<std::uint64_t>(sqrt(static_cast<double>(t)));
  while (static_cast<u128>(q) * q > t) --q;
  while (static_cast<u128>(q + 1) * (q + 1) <= t) ++q;
  return q;
}

/// Returns bits [from, from + 128) of the normalised digits (bits below 0 read as 0),
/// and in `sticky` whether any bit below `from` is set.
STEPCORE_HD_INLINE u128 extract_bits(const std::uint64_t (&d)[kNormDigits], int from,
                                     bool& sticky) {
  u128 v = 0;
  for (int j = 0; j < 128; ++j) {
    const int p = from + j;
    if (p < 0 || p >= kNormDigits * kNormDigitBits) continue;
    if ((d[p / 32] >> (p % 32)) & 1ull) v |= static_cast<u128>(1) << j;
  }
  sticky = false;
  for (int p = 0; p < from && p < kNormDigits * kNormDigitBits; ++p)
    if ((d[p / 32] >> (p % 32)) & 1ull) sticky = true;
  return v;
}

/// Returns bit p of the digits (0 outside them).
template <int N>
STEPCORE_HD_INLINE std::uint64_t bit_at(const std::uint64_t (&d)[N], int p) {
  if (p < 0 || p >= N * kNormDigitBits) return 0;
  return (d[p / kNormDigitBits] >> (p % kNormDigitBits)) & 1ull;
}

/// Returns S * 2^unit rounded to `prec` (<= 53) significant bits, nearest, ties to even,
/// for the normalised digits S, as an exact double m * 2^(unit + drop). 2^unit must be the
/// target format's smallest quantum (its subnormal grid: -149 for f32, -1074 for f64), so
/// the rounding is that format's RN: for f32 the float conversion of the result is then
/// exact, or +Inf exactly when RN_f32 overflows (docs/numerics.md 6.6).
template <int N>
STEPCORE_HD_INLINE double round_digits(const std::uint64_t (&d)[N], int prec, int unit) {
  int top = N - 1;
  while (top >= 0 && d[top] == 0) --top;
  if (top < 0) return 0.0;
  const int L = top * kNormDigitBits + bit_length64(d[top]);  // bit length of S
  const int drop = L > prec ? L - prec : 0;
  std::uint64_t m = 0;
  for (int j = L - 1; j >= drop; --j) m = (m << 1) | bit_at(d, j);
  if (drop > 0 && bit_at(d, drop - 1)) {  // at or above the midpoint
    bool rest = (m & 1ull) != 0;          // odd: a tie goes up too
    for (int j = 0; j < drop - 1 && !rest; ++j) rest = bit_at(d, j) != 0;
    if (rest) ++m;  // m may become 2^prec: still exact
  }
  return ldexp(static_cast<double>(m), unit + drop);
}

/// Returns RN_f32(sqrt(S * 2^-298)) for the normalised digits S (docs/numerics.md 6.4).
STEPCORE_HD_INLINE float round_sqrt(const std::uint64_t (&d)[kNormDigits]) {
  int top = kNormDigits - 1;
  while (top >= 0 && d[top] == 0) --top;
  if (top < 0) return 0.0f;
  const int L = top * kNormDigitBits + bit_length64(d[top]);  // bit length of S
  // T = S / 4^k with 97..98 significant bits (k may be negative: exact left shift).
  int sh = L - 98;
  if (sh % 2 != 0) --sh;  // even, so sqrt(S) = sqrt(T) * 2^(sh/2)
  const int k = sh / 2;
  bool sticky = false;
  const u128 t = extract_bits(d, sh, sticky);
  const std::uint64_t q = isqrt128(t);
  const bool rem = static_cast<u128>(q) * q != t;
  // norm = sqrt(S) * 2^-149 = sqrt(T) * 2^(k - 149); q = floor(sqrt(T)).
  const int nb = bit_length128(static_cast<u128>(q));
  // Keep 24 significant bits, or land on the subnormal grid 2^-149 below 2^-126.
  int drop = nb - 24;
  if (-k > drop) drop = -k;
  const bool guard = (q >> (drop - 1)) & 1ull;
  const bool rest = (q & ((1ull << (drop - 1)) - 1ull)) != 0 || rem || sticky;
  std::uint64_t m = q >> drop;
  if (guard && (rest || (m & 1ull))) ++m;
  // m <= 2^24 and the exponent is in double's range: ldexp is exact; the float
  // conversion is exact or overflows to +Inf exactly when RN does.
  return static_cast<float>(ldexp(static_cast<double>(m), k - 149 + drop));
}

/// Returns the norm of the normalised digits S of a partial of the given order:
/// RN_f32(sqrt(S * 2^-298)) (two) or RN_f32(S * 2^-149) (one).
STEPCORE_HD_INLINE float round_norm(const std::uint64_t (&d)[kNormDigits], NormOrder order) {
  if (order == NormOrder::one) return static_cast<float>(round_digits(d, 24, kNorm1UnitExponent));
  return round_sqrt(d);
}

/// out = floor(S / 2^bits) + 1 (>= S * 2^-bits), normalised.
STEPCORE_HD_INLINE void shifted_up(const std::uint64_t (&d)[kNormDigits], int bits,
                                   std::uint64_t (&out)[kNormDigits]) {
  for (int k = 0; k < kNormDigits; ++k) out[k] = 0;
  for (int p = bits; p < kNormDigits * kNormDigitBits; ++p) {
    if ((d[p / 32] >> (p % 32)) & 1ull) {
      const int q = p - bits;
      out[q / 32] |= 1ull << (q % 32);
    }
  }
  out[0] += 1;
  normalize_digits(out);
}

/// a -= b, saturating at zero (normalised digits).
STEPCORE_HD_INLINE void sub_digits(std::uint64_t (&a)[kNormDigits],
                                   const std::uint64_t (&b)[kNormDigits]) {
  std::int64_t borrow = 0;
  for (int k = 0; k < kNormDigits; ++k) {
    std::int64_t v = static_cast<std::int64_t>(a[k]) - static_cast<std::int64_t>(b[k]) - borrow;
    borrow = v < 0;
    if (v < 0) v += std::int64_t{1} << 32;
    a[k] = static_cast<std::uint64_t>(v);
  }
  if (borrow)
    for (auto& x : a) x = 0;
}

/// The body of stepcore::finalize (docs/numerics.md 6.3-6.4, 6.6), host or device.
STEPCORE_HD_INLINE NormResult finalize_partial(const NormPartial& partial,
                                               NormOrder order = NormOrder::two) {
  NormResult r;
  r.nan_count = partial.nan_count;
  r.inf_count = partial.inf_count;
  r.finite = partial.nan_count == 0 && partial.inf_count == 0;
  if (partial.nan_count) {
    r.norm = r.max_abs = f32_from_bits(0x7FC00000u);
    return r;
  }
  if (partial.inf_count) {
    r.norm = r.max_abs = f32_from_bits(0x7F800000u);
    return r;
  }
  // A max-abs record that is not a finite non-negative float cannot come from finite
  // values (a hand-made or corrupted partial): flagged, never a silently wrong number.
  if (partial.max_abs_bits >= 0x7F800000u) {
    r.norm = r.max_abs = f32_from_bits(0x7FC00000u);
    r.finite = false;
    return r;
  }
  r.max_abs = f32_from_bits(partial.max_abs_bits);
  std::uint64_t d[kNormDigits];
  for (int k = 0; k < kNormDigits; ++k) d[k] = partial.digits[k];
  if (!normalize_digits(d)) {  // S >= 2^640: the norm is far beyond f32, exactly +Inf
    r.norm = f32_from_bits(0x7F800000u);
    r.finite = false;
    return r;
  }
  if (partial.approximate == 0) {
    r.norm = round_norm(d, order);
  } else {
    // |S - S_exact| <= 2^-40 S: certify that both ends of the interval round alike.
    std::uint64_t delta[kNormDigits], lo[kNormDigits], hi[kNormDigits];
    shifted_up(d, -kNormApproxErrorLog2, delta);
    for (int k = 0; k < kNormDigits; ++k) {
      lo[k] = d[k];
      hi[k] = d[k] + delta[k];
    }
    normalize_digits(hi);
    sub_digits(lo, delta);
    const float a = round_norm(lo, order);
    const float b = round_norm(hi, order);
    if (f32_bits(a) != f32_bits(b)) {
      r.needs_exact = true;
      r.norm = f32_from_bits(0x7FC00000u);
      r.finite = false;
      return r;
    }
    r.norm = a;
  }
  r.finite = f32_bits(r.norm) < 0x7F800000u;  // false when the exact norm rounds to +Inf
  return r;
}

}  // namespace stepcore::detail
