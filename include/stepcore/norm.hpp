// The exact, order-independent L2 norm: its partial (an integer superaccumulator)
// and the final correctly rounded result. docs/numerics.md, "Norm", is the spec.
//
// A partial holds S = sum of x^2 * 2^298 exactly. Every x^2 of a binary32 x is an
// integer multiple of 2^-298 (the square of the smallest subnormal), so S is an
// integer and partials from threads, blocks and ranks combine by integer
// addition, which is associative: the result cannot depend on order, thread
// count, ISA, device, rank count, sharding or the collective's algorithm.
#pragma once

#include <cstdint>

#include "stepcore/config.hpp"

namespace stepcore {

/// Bits per digit of the superaccumulator; each digit lives in a 64-bit word so
/// that up to 2^32 normalised partials add without carrying (e.g. in an NCCL or
/// MPI integer sum).
inline constexpr int kNormDigitBits = 32;
/// Number of digits: 640 bits cover every finite x^2 (< 2^554 after scaling)
/// summed over up to 2^64 elements.
inline constexpr int kNormDigits = 20;
/// S counts units of 2^kNormUnitExponent.
inline constexpr int kNormUnitExponent = -298;
/// Fast partials sum squares in double within blocks; no element's square may pass
/// through more than this many double additions before its block sum is deposited
/// exactly. Bounds the relative error of an approximate S by gamma(4096) < 2^-40.
inline constexpr int kNormMaxBlockAdditions = 4096;
/// log2 of the relative error bound finalize() assumes for approximate partials.
inline constexpr int kNormApproxErrorLog2 = -40;

/// How a norm partial is computed.
enum class NormMode : std::uint8_t {
  fast = 0,   ///< exact squares, binary64 block sums: an approximate, certified partial
  exact = 1,  ///< one exact integer deposit per element (the fallback; several times slower)
};

/// An exact partial of the L2 norm and inf-norm of a set of binary32 values.
/// Plain data: can be copied to and from devices and summed digit by digit.
struct NormPartial {
  /// digits[k] holds bits [32k, 32k+32) of S, plus not-yet-propagated carries.
  std::uint64_t digits[kNormDigits] = {};
  std::uint64_t nan_count = 0;     ///< number of NaN values seen
  std::uint64_t inf_count = 0;     ///< number of +-Inf values seen
  std::uint32_t max_abs_bits = 0;  ///< bit pattern of max |x| over finite x
  /// 0: S is exact (the reference, or an exact fast path). Non-zero: S is the exact
  /// sum of double block sums, each within gamma(kNormMaxBlockAdditions) of its exact
  /// value, so |S - S_exact| <= 2^-40 * S; finalize() certifies or asks for exact.
  std::uint32_t approximate = 0;
};

/// The final norm of one or more merged partials.
struct NormResult {
  float norm = 0.0f;     ///< RN_f32(sqrt(S * 2^-298)); NaN if any NaN, else +Inf if any Inf
  float max_abs = 0.0f;  ///< max |x|; NaN if any NaN, else +Inf if any Inf
  bool finite =
      true;  ///< false when any value was NaN or Inf (found-inf), the norm overflows f32, or the
             ///< partial is one no finite values give (a NaN/Inf/negative max-abs record: norm NaN)
  std::uint64_t nan_count = 0;
  std::uint64_t inf_count = 0;
  /// True when the partial was approximate and S lies so close to a rounding
  /// boundary that the result could not be certified: `norm` is then unset (NaN)
  /// and the caller must recompute with exact partials (the global norm across ranks,
  /// comm.hpp, and the managers do).
  bool needs_exact = false;
};

namespace detail {

/// Propagates carries so every digit is below 2^32, exactly for any 64-bit digits (the
/// value sum d[k] * 2^(32k) is kept: the carry into a digit stays below 2^33, and a
/// digit's high half moves up without wrapping). Returns false when the value needs more
/// than kNormDigits digits (impossible for fewer than 2^64 elements; then the digits
/// hold the value modulo 2^(32 kNormDigits)).
STEPCORE_HD_INLINE bool normalize_digits(std::uint64_t (&d)[kNormDigits]) {
  std::uint64_t carry = 0;  // < 2^33
  for (int k = 0; k < kNormDigits; ++k) {
    const std::uint64_t v = (d[k] & 0xFFFFFFFFull) + carry;    // < 2^32 + 2^33: no wrap
    carry = (v >> kNormDigitBits) + (d[k] >> kNormDigitBits);  // < 2^3 + 2^32
    d[k] = v & 0xFFFFFFFFull;
  }
  return carry == 0;
}

/// Adds `value` * 2^bit_offset to the digits (value < 2^64, offset >= 0, the
/// value's top bit below 640 - 64). Leaves carries in the digits: the caller
/// normalises at least every 2^31 deposits.
STEPCORE_HD_INLINE void deposit(std::uint64_t (&d)[kNormDigits], std::uint64_t value,
                                int bit_offset) {
  const int k = bit_offset / kNormDigitBits;
  const int r = bit_offset % kNormDigitBits;
  // value << r spans at most 96 bits: three 32-bit digits.
  const std::uint64_t lo = value << r;                      // bits [0, 64)
  const std::uint64_t hi = r == 0 ? 0 : value >> (64 - r);  // bits [64, 96)
  d[k] += lo & 0xFFFFFFFFull;
  d[k + 1] += lo >> 32;
  if (k + 2 < kNormDigits) d[k + 2] += hi;
}

/// Adds a non-negative finite double that is a multiple of 2^-298 (every double sum
/// of squares of binary32 values is) to the digits, exactly.
STEPCORE_HD_INLINE void deposit_double(std::uint64_t (&d)[kNormDigits], double x) {
#if defined(__CUDA_ARCH__)
  const auto bits = static_cast<std::uint64_t>(__double_as_longlong(x));
#else
  const auto bits = __builtin_bit_cast(std::uint64_t, x);
#endif
  const int biased = static_cast<int>(bits >> 52);
  if (biased == 0) return;  // zero (a subnormal double is never such a sum)
  std::uint64_t m = (bits & ((std::uint64_t{1} << 52) - 1)) | (std::uint64_t{1} << 52);
  int offset = biased - 1075 - kNormUnitExponent;  // x = m * 2^(biased-1075)
  if (offset < 0) {  // the low bits are zero because x is a multiple of 2^-298
    m >>= -offset;
    offset = 0;
  }
  deposit(d, m, offset);
}

}  // namespace detail

/// Adds `b` into `a` (exact). Both may carry unpropagated digits; the result
/// is normalised. Commutative and associative.
STEPCORE_HD_INLINE void merge(NormPartial& a, const NormPartial& b) {
  // Exact for any digits: both sides normalised first (digits below 2^32), so the sums
  // stay below 2^33. A value of 2^640 or more (possible only far outside the documented
  // range) saturates to 2^640 - 1, which finalises to +Inf: its exact rounding.
  std::uint64_t bd[kNormDigits];
  for (int k = 0; k < kNormDigits; ++k) bd[k] = b.digits[k];
  bool fits = detail::normalize_digits(a.digits) && detail::normalize_digits(bd);
  if (fits) {
    for (int k = 0; k < kNormDigits; ++k) a.digits[k] += bd[k];
    fits = detail::normalize_digits(a.digits);
  }
  if (!fits)
    for (auto& x : a.digits) x = 0xFFFFFFFFull;
  a.nan_count += b.nan_count;
  a.inf_count += b.inf_count;
  a.max_abs_bits = a.max_abs_bits > b.max_abs_bits ? a.max_abs_bits : b.max_abs_bits;
  a.approximate |= b.approximate;
}

/// Returns the final norm of a partial (host only). For an exact partial: a pure
/// function of S. For an approximate one: the same bits whenever it can certify
/// them (every S within the error bound rounds to the same float), otherwise a
/// result with needs_exact set. Either way the returned norm, when set, is
/// RN_f32(sqrt(S_exact * 2^-298)): independent of order, ISA, device and ranks.
NormResult finalize(const NormPartial& partial);

/// Returns true when both partials represent the same S, counts and max.
bool same_value(const NormPartial& a, const NormPartial& b);

}  // namespace stepcore
