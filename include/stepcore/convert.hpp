// Exact conversions between binary32 and bf16/f16, usable on host and device.
//
// Contract (docs/numerics.md, "Conversions"):
//  * widening (bf16 -> f32, f16 -> f32) is exact, NaN payloads and signs kept;
//  * narrowing rounds to nearest, ties to even; overflow goes to +-Inf;
//    subnormal results are rounded on the subnormal grid;
//  * narrowing a NaN gives the positive quiet NaN, sign and payload dropped: bf16
//    0x7FC0 (PyTorch's CPU conversion does the same), f16 0x7E00 (PyTorch keeps the
//    sign; stepcore drops it because an arithmetic NaN's sign differs between paths).
#pragma once

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

#include "stepcore/config.hpp"
#include "stepcore/dtype.hpp"

namespace stepcore {

/// Returns the bit pattern of `f`.
STEPCORE_HD_INLINE std::uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

/// Returns the float whose bit pattern is `u`.
STEPCORE_HD_INLINE float f32_from_bits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

/// Returns the exact binary32 value of a bfloat16 bit pattern.
STEPCORE_HD_INLINE float bf16_bits_to_f32(std::uint16_t h) {
  return f32_from_bits(static_cast<std::uint32_t>(h) << 16);
}

/// Returns `f` rounded to bfloat16 (nearest, ties to even); NaN -> 0x7FC0.
STEPCORE_HD_INLINE std::uint16_t f32_to_bf16_bits(float f) {
  const std::uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  // Adding 0x7FFF plus the lowest kept bit rounds the dropped 16 bits to
  // nearest-even; a carry out of the fraction correctly bumps the exponent
  // (and turns the largest values into Inf).
  const std::uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

/// Returns the exact binary32 value of an IEEE binary16 bit pattern.
STEPCORE_HD_INLINE float f16_bits_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t frac = h & 0x3FFu;
  if (exp == 0x1Fu) return f32_from_bits(sign | 0x7F800000u | (frac << 13));
  if (exp == 0) {
    if (frac == 0) return f32_from_bits(sign);
    // Subnormal: frac * 2^-24. Normalise so the leading one sits at bit 10.
    exp = 1;
    while ((frac & 0x400u) == 0) {
      frac <<= 1;
      --exp;
    }
    frac &= 0x3FFu;
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (frac << 13));
}

/// Returns `f` rounded to binary16 (nearest, ties to even); NaN -> 0x7E00 (sign dropped).
STEPCORE_HD_INLINE std::uint16_t f32_to_f16_bits(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7E00u;
  // 65520 = 0x477FF000 is the midpoint between 65504 (largest finite, odd
  // significand) and 65536; ties-to-even sends it, and everything above, to Inf.
  if (a >= 0x477FF000u) return sign | 0x7C00u;
  if (a >= 0x38800000u) {                     // result is a normal binary16 (|f| >= 2^-14)
    const std::uint32_t t = a - 0x38000000u;  // rebias exponent: 127 -> 15
    const std::uint32_t r = t + 0xFFFu + ((t >> 13) & 1u);
    return sign | static_cast<std::uint16_t>(r >> 13);
  }
  // Subnormal or zero result: value / 2^-24 rounded to an integer.
  const std::uint32_t exp = a >> 23;
  if (exp == 0) return sign;                               // f32 subnormals are far below 2^-25
  const std::uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;  // value = mant * 2^(exp-150)
  const std::uint32_t shift = 126u - exp;                  // >= 14 here
  if (shift > 24u) return sign;                            // < 2^-25: rounds to zero
  std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<std::uint16_t>(q);
}

/// Returns the binary32 value of a stored element (exact).
STEPCORE_HD_INLINE float to_f32(float x) { return x; }
STEPCORE_HD_INLINE float to_f32(bfloat16_t x) { return bf16_bits_to_f32(x.bits); }
STEPCORE_HD_INLINE float to_f32(float16_t x) { return f16_bits_to_f32(x.bits); }

/// Returns `x` rounded to storage type T (identity for float).
template <class T>
STEPCORE_HD_INLINE T from_f32(float x);
template <>
STEPCORE_HD_INLINE float from_f32<float>(float x) {
  return x;
}
template <>
STEPCORE_HD_INLINE bfloat16_t from_f32<bfloat16_t>(float x) {
  return bfloat16_t{f32_to_bf16_bits(x)};
}
template <>
STEPCORE_HD_INLINE float16_t from_f32<float16_t>(float x) {
  return float16_t{f32_to_f16_bits(x)};
}

/// Returns `x` rounded to T and widened back: R_T(x) of the spec.
template <class T>
STEPCORE_HD_INLINE float round_to(float x) {
  return to_f32(from_f32<T>(x));
}

}  // namespace stepcore
