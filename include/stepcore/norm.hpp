// The exact, order-independent L2 and L1 norms: their partial (an integer
// superaccumulator) and the final correctly rounded result; the order of any other
// p-norm. docs/numerics.md, "Norm" (6) and "Other norms" (6.6), is the spec.
//
// A partial holds S = sum of x^2 * 2^298 exactly (the 2-norm's; the 1-norm's partial
// holds S = sum of |x| * 2^149, every |x| being an integer multiple of 2^-149). Every x^2 of a
// binary32 x is an integer multiple of 2^-298 (the square of the smallest subnormal), so S is an
// integer and partials from threads, blocks and ranks combine by integer
// addition, which is associative: the result cannot depend on order, thread
// count, ISA, device, rank count, sharding or the collective's algorithm.
#pragma once

#include <cstdint>

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

/// A 1-norm partial's S counts units of 2^kNorm1UnitExponent (the smallest subnormal).
inline constexpr int kNorm1UnitExponent = -149;

/// Which sum a NormPartial's digits hold. The layout is the same for both, and partials
/// combine the same way; only partials of one order may be merged.
enum class NormOrder : std::uint8_t {
  two = 0,  ///< S = sum of x^2 * 2^298: the Euclidean norm (the default everywhere)
  one = 1,  ///< S = sum of |x| * 2^149: the 1-norm (< 2^341 for up to 2^64 values)
};
/// Number of NormOrder values (table sizes).
inline constexpr int kNormOrders = 2;

/// How a norm partial is computed.
enum class NormMode : std::uint8_t {
  fast = 0,   ///< exact squares, binary64 block sums: an approximate, certified partial
  exact = 1,  ///< one exact integer deposit per element (the fallback; several times slower)
};

/// An exact partial of the L2 (or L1, NormOrder::one) norm and inf-norm of a set of
/// binary32 values.
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
  float norm = 0.0f;     ///< RN_f32(sqrt(S * 2^-298)) (order one: RN_f32(S * 2^-149); a
                         ///< p-norm: docs/numerics.md 6.6); NaN if any NaN, else +Inf if any Inf
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

/// Adds `b` into `a` (exact). Both may carry unpropagated digits; the result
/// is normalised. Commutative and associative. A sum of 2^640 or more (possible only far
/// outside the documented range) saturates to 2^640 - 1, which finalises to +Inf.
void merge(NormPartial& a, const NormPartial& b) noexcept;

/// Propagates the carries of partial.digits so every digit is below 2^32, exactly: the
/// value S is kept (for a partial received as raw words, e.g. from a transport of the
/// caller's). Returns false when S needs more than kNormDigits digits; the digits then
/// hold S modulo 2^(32 kNormDigits).
bool normalize(NormPartial& partial) noexcept;

/// Returns the final norm of a partial (host only). For an exact partial: a pure
/// function of S. For an approximate one: the same bits whenever it can certify
/// them (every S within the error bound rounds to the same float), otherwise a
/// result with needs_exact set. Either way the returned norm, when set, is
/// RN_f32(sqrt(S_exact * 2^-298)): independent of order, ISA, device and ranks.
NormResult finalize(const NormPartial& partial);
/// finalize() of a partial of the given order: for NormOrder::one the norm is
/// RN_f32(S_exact * 2^-149), the correctly rounded 1-norm, with the same certification
/// (needs_exact when an approximate S cannot be certified). finalize(p) is
/// finalize(p, NormOrder::two).
NormResult finalize(const NormPartial& partial, NormOrder order);

/// Returns true when both partials represent the same S, counts and max.
bool same_value(const NormPartial& a, const NormPartial& b);

}  // namespace stepcore
