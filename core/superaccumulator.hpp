// The superaccumulator's digit arithmetic behind stepcore/norm.hpp's NormPartial, as
// __host__ __device__ code for every engine (CUDA block bodies, CPU SIMD bodies, the
// scalar reference, the communicators' reductions): carries, exact deposits, merging.
// Internal: an integrator merges, normalises and finalises through norm.hpp.
#pragma once

#include <cstdint>

#include "stepcore/config.hpp"
#include "stepcore/norm.hpp"

namespace stepcore::detail {

/// Propagates carries so every digit is below 2^32, exactly for any 64-bit digits (the
/// value sum d[k] * 2^(32k) is kept: the carry into a digit stays below 2^33, and a
/// digit's high half moves up without wrapping). Returns false when the value needs more
/// than N digits (impossible for fewer than 2^64 elements; then the digits hold the
/// value modulo 2^(32 N)). N is kNormDigits for a NormPartial; the p-norm's power sum
/// (core/norm_p.hpp) uses a wider array of the same digits.
template <int N>
STEPCORE_HD_INLINE bool normalize_digits(std::uint64_t (&d)[N]) {
  std::uint64_t carry = 0;  // < 2^33
  for (int k = 0; k < N; ++k) {
    const std::uint64_t v = (d[k] & 0xFFFFFFFFull) + carry;    // < 2^32 + 2^33: no wrap
    carry = (v >> kNormDigitBits) + (d[k] >> kNormDigitBits);  // < 2^3 + 2^32
    d[k] = v & 0xFFFFFFFFull;
  }
  return carry == 0;
}

/// Adds `value` * 2^bit_offset to the digits (value < 2^64, offset >= 0, the
/// value's top bit below 32 N - 64). Leaves carries in the digits: the caller
/// normalises at least every 2^31 deposits.
template <int N>
STEPCORE_HD_INLINE void deposit(std::uint64_t (&d)[N], std::uint64_t value, int bit_offset) {
  const int k = bit_offset / kNormDigitBits;
  const int r = bit_offset % kNormDigitBits;
  // value << r spans at most 96 bits: three 32-bit digits.
  const std::uint64_t lo = value << r;                      // bits [0, 64)
  const std::uint64_t hi = r == 0 ? 0 : value >> (64 - r);  // bits [64, 96)
  d[k] += lo & 0xFFFFFFFFull;
  d[k + 1] += lo >> 32;
  if (k + 2 < N) d[k + 2] += hi;
}

/// Adds |x| of a binary32 bit pattern `abs_bits` (finite, sign cleared) to digits that
/// count units of 2^-149 (the 1-norm's, docs/numerics.md 6.6): |x| = M * 2^(e-150) for a
/// normal x (M with the implicit bit), M * 2^-149 for a subnormal one, exactly.
template <int N>
STEPCORE_HD_INLINE void deposit_abs(std::uint64_t (&d)[N], std::uint32_t abs_bits) {
  const std::uint32_t e = abs_bits >> 23;
  const std::uint64_t m = e == 0 ? (abs_bits & 0x7FFFFFu) : ((abs_bits & 0x7FFFFFu) | 0x800000u);
  deposit(d, m, e == 0 ? 0 : static_cast<int>(e) - 1);
}

/// Adds a non-negative finite double that is a multiple of 2^Unit to digits counting
/// units of 2^Unit, exactly. Unit -298: every double sum of squares of binary32 values
/// (the 2-norm); -149: every double sum of |x| (the 1-norm); -1074: any double (the
/// p-norm's power sum, subnormal doubles included).
template <int Unit = kNormUnitExponent, int N>
STEPCORE_HD_INLINE void deposit_double(std::uint64_t (&d)[N], double x) {
#if defined(__CUDA_ARCH__)
  const auto bits = static_cast<std::uint64_t>(__double_as_longlong(x));
#else
  const auto bits = __builtin_bit_cast(std::uint64_t, x);
#endif
  const int biased = static_cast<int>(bits >> 52);
  std::uint64_t m = bits & ((std::uint64_t{1} << 52) - 1);
  if (biased == 0) {  // zero, or a subnormal m * 2^-1074 (a multiple of 2^Unit only for -1074)
    if constexpr (Unit == -1074)
      if (m != 0) deposit(d, m, 0);
    return;
  }
  m |= std::uint64_t{1} << 52;
  int offset = biased - 1075 - Unit;  // x = m * 2^(biased-1075)
  if (offset < 0) {                   // the low bits are zero because x is a multiple of 2^Unit
    m >>= -offset;
    offset = 0;
  }
  deposit(d, m, offset);
}

/// The body of stepcore::merge (norm.hpp), host or device: adds `b` into `a` exactly,
/// the result normalised; a sum of 2^640 or more saturates to 2^640 - 1.
STEPCORE_HD_INLINE void merge_partials(NormPartial& a, const NormPartial& b) {
  // Exact for any digits: both sides normalised first (digits below 2^32), so the sums
  // stay below 2^33. A value of 2^640 or more (possible only far outside the documented
  // range) saturates to 2^640 - 1, which finalises to +Inf: its exact rounding.
  std::uint64_t bd[kNormDigits];
  for (int k = 0; k < kNormDigits; ++k) bd[k] = b.digits[k];
  bool fits = normalize_digits(a.digits) && normalize_digits(bd);
  if (fits) {
    for (int k = 0; k < kNormDigits; ++k) a.digits[k] += bd[k];
    fits = normalize_digits(a.digits);
  }
  if (!fits)
    for (auto& x : a.digits) x = 0xFFFFFFFFull;
  a.nan_count += b.nan_count;
  a.inf_count += b.inf_count;
  a.max_abs_bits = a.max_abs_bits > b.max_abs_bits ? a.max_abs_bits : b.max_abs_bits;
  a.approximate |= b.approximate;
}

}  // namespace stepcore::detail
