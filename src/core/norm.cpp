// Final rounding of the exact norm: RN_f32(sqrt(S * 2^-298)) from the integer S.
#include <cmath>
#include <cstring>

#include "stepcore/convert.hpp"
#include "stepcore/norm.hpp"

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

}  // namespace

NormResult finalize(const NormPartial& partial) {
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
  int top = kNormDigits - 1;
  while (top >= 0 && d[top] == 0) --top;
  if (top < 0) {
    r.norm = 0.0f;
    return r;
  }
  const int L = top * kNormDigitBits + bit_length(d[top]);  // bit length of S

  // T = S / 4^k with 97..99 significant bits (k may be negative: exact left shift).
  int sh = L - 98;
  if (sh % 2 != 0) --sh;  // even, so sqrt(S) = sqrt(T) * 2^(sh/2)
  const int k = sh / 2;
  bool sticky = false;
  u128 t = extract(d, sh, sticky);  // for sh < 0 this shifts left (bits below 0 read as 0)

  const std::uint64_t q = isqrt(t);
  const bool rem = static_cast<u128>(q) * q != t;
  // norm = sqrt(S) * 2^-149 = sqrt(T) * 2^(k - 149); q = floor(sqrt(T)).
  const int nb = bit_length(static_cast<u128>(q));
  // Drop enough bits to keep 24 significant bits, or to land on the subnormal
  // grid 2^-149 when the result is below 2^-126.
  int drop = nb - 24;
  if (-k > drop) drop = -k;
  const std::uint64_t m0 = q >> drop;
  const bool guard = (q >> (drop - 1)) & 1ull;
  const bool rest = (q & ((1ull << (drop - 1)) - 1ull)) != 0 || rem || sticky;
  std::uint64_t m = m0;
  if (guard && (rest || (m & 1ull))) ++m;
  // m <= 2^24 and the exponent is in double's range: ldexp is exact; the float
  // conversion is exact or overflows to +Inf exactly when RN does.
  r.norm = static_cast<float>(std::ldexp(static_cast<double>(m), k - 149 + drop));
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
