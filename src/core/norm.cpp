// Final rounding of the exact norm: RN_f32(sqrt(S * 2^-298)) from the integer S.
#include "stepcore/norm.hpp"

#include <cmath>
#include <cstring>

#include "fp_env.hpp"
#include "stepcore/convert.hpp"

namespace stepcore {
namespace {

using u128 = unsigned __int128;

// Returns floor(sqrt(t)) for t < 2^100.
std::uint64_t isqrt(u128 t) {
  auto q = static_cast<std::uint64_t>(std::sqrt(static_cast<double>(t)));
  while (static_cast<u128>(q) * q > t) --q;
  while (static_cast<u128>(q + 1) * (q + 1) <= t) ++q;
  return q;
}

int bit_length(std::uint64_t v) { return v == 0 ? 0 : 64 - __builtin_clzll(v); }
int bit_length(u128 v) {
  const auto hi = static_cast<std::uint64_t>(v >> 64);
  return hi ? 64 + bit_length(hi) : bit_length(static_cast<std::uint64_t>(v));
}

// Returns bits [from, from + 128) of the normalised digit array, and whether any
// bit below `from` is set.
u128 extract(const std::uint64_t (&d)[kNormDigits], int from, bool& sticky) {
  u128 v = 0;
  for (int b = 0; b < 128; b += 32) {
    const int pos = from + b;  // bit position in S of this 32-bit slice
    // Slice may straddle two digits.
    std::uint64_t slice = 0;
    for (int j = 0; j < 32; ++j) {
      const int p = pos + j;
      if (p < 0 || p >= kNormDigits * kNormDigitBits) continue;
      slice |= ((d[p / 32] >> (p % 32)) & 1ull) << j;
    }
    v |= static_cast<u128>(slice) << b;
  }
  sticky = false;
  for (int p = 0; p < from && p < kNormDigits * kNormDigitBits; ++p)
    if ((d[p / 32] >> (p % 32)) & 1ull) sticky = true;
  return v;
}

// Returns RN_f32(sqrt(S * 2^-298)) for the normalised digits S (section 6.4).
float round_sqrt(const std::uint64_t (&d)[kNormDigits]) {
  int top = kNormDigits - 1;
  while (top >= 0 && d[top] == 0) --top;
  if (top < 0) return 0.0f;
  const int L = top * kNormDigitBits + bit_length(d[top]);  // bit length of S

  // T = S / 4^k with 97..98 significant bits (k may be negative: exact left shift).
  int sh = L - 98;
  if (sh % 2 != 0) --sh;  // even, so sqrt(S) = sqrt(T) * 2^(sh/2)
  const int k = sh / 2;
  bool sticky = false;
  const u128 t = extract(d, sh, sticky);  // for sh < 0 this shifts left

  const std::uint64_t q = isqrt(t);
  const bool rem = static_cast<u128>(q) * q != t;
  // norm = sqrt(S) * 2^-149 = sqrt(T) * 2^(k - 149); q = floor(sqrt(T)).
  const int nb = bit_length(static_cast<u128>(q));
  // Drop enough bits to keep 24 significant bits, or to land on the subnormal
  // grid 2^-149 when the result is below 2^-126.
  int drop = nb - 24;
  if (-k > drop) drop = -k;
  const bool guard = (q >> (drop - 1)) & 1ull;
  const bool rest = (q & ((1ull << (drop - 1)) - 1ull)) != 0 || rem || sticky;
  std::uint64_t m = q >> drop;
  if (guard && (rest || (m & 1ull))) ++m;
  // m <= 2^24 and the exponent is in double's range: ldexp is exact; the float
  // conversion is exact or overflows to +Inf exactly when RN does.
  return static_cast<float>(std::ldexp(static_cast<double>(m), k - 149 + drop));
}

// Returns floor(S / 2^bits) + 1 (>= S * 2^-bits), normalised digits.
void shifted_up(const std::uint64_t (&d)[kNormDigits], int bits,
                std::uint64_t (&out)[kNormDigits]) {
  for (int k = 0; k < kNormDigits; ++k) out[k] = 0;
  for (int p = bits; p < kNormDigits * kNormDigitBits; ++p) {
    if ((d[p / 32] >> (p % 32)) & 1ull) {
      const int q = p - bits;
      out[q / 32] |= 1ull << (q % 32);
    }
  }
  out[0] += 1;
  detail::normalize_digits(out);
}

// a += b or a -= b (saturating at zero) on normalised digits.
void add_digits(std::uint64_t (&a)[kNormDigits], const std::uint64_t (&b)[kNormDigits]) {
  for (int k = 0; k < kNormDigits; ++k) a[k] += b[k];
  detail::normalize_digits(a);
}
void sub_digits(std::uint64_t (&a)[kNormDigits], const std::uint64_t (&b)[kNormDigits]) {
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

}  // namespace

NormResult finalize(const NormPartial& partial) {
  const detail::FpEnvGuard env;
  NormResult r;
  r.nan_count = partial.nan_count;
  r.inf_count = partial.inf_count;
  r.finite = partial.nan_count == 0 && partial.inf_count == 0;
  if (partial.nan_count) {
    r.norm = r.max_abs = std::nanf("");
    return r;
  }
  if (partial.inf_count) {
    r.norm = r.max_abs = INFINITY;
    return r;
  }
  r.max_abs = f32_from_bits(partial.max_abs_bits);

  std::uint64_t d[kNormDigits];
  std::memcpy(d, partial.digits, sizeof d);
  detail::normalize_digits(d);
  if (partial.approximate == 0) {
    r.norm = round_sqrt(d);
  } else {
    // |S - S_exact| <= 2^-40 S: certify that both ends of the interval round alike.
    std::uint64_t delta[kNormDigits], lo[kNormDigits], hi[kNormDigits];
    shifted_up(d, -kNormApproxErrorLog2, delta);
    std::memcpy(lo, d, sizeof d);
    std::memcpy(hi, d, sizeof d);
    sub_digits(lo, delta);
    add_digits(hi, delta);
    const float a = round_sqrt(lo);
    const float b = round_sqrt(hi);
    if (f32_bits(a) != f32_bits(b)) {
      r.needs_exact = true;
      r.norm = std::nanf("");
      r.finite = false;
      return r;
    }
    r.norm = a;
  }
  r.finite = r.norm <= 3.40282347e38f;  // false when the exact norm rounds to +Inf
  return r;
}

bool same_value(const NormPartial& a, const NormPartial& b) {
  std::uint64_t da[kNormDigits], db[kNormDigits];
  std::memcpy(da, a.digits, sizeof da);
  std::memcpy(db, b.digits, sizeof db);
  detail::normalize_digits(da);
  detail::normalize_digits(db);
  return std::memcmp(da, db, sizeof da) == 0 && a.nan_count == b.nan_count &&
         a.inf_count == b.inf_count && a.max_abs_bits == b.max_abs_bits;
}

}  // namespace stepcore
