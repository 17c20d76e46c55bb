// Block-wise 8-bit state slots (docs/numerics.md 8f) for the fast paths: a codebook per
// map and rounding rule whose bucket table turns y = x / absmax into its code with integer
// operations only (one table read), so every ISA and the device compute the same code.
// The reference keeps its own literal quantizers (the oracle).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// How a block's values become codes: `nearest` is 8f's exact nearest code (ties away from
/// zero, NaN: the zero code and absmax 0x7FC00000, absmax a); `torchao` is 8f.1's search
/// (ties up, NaN: code 0 and absmax 0xFFFFFFFF, absmax max(a, 1e-12f)).
enum class Q8Rule : std::uint8_t { nearest, torchao };

// The bucket table. A code is a non-decreasing function of y (both rules), so it changes at
// 255 thresholds. A value's magnitude, clamped to [kQ8KeyFloor, kQ8KeyCeil] (2^-24 and 1 as
// f32 bit patterns: every code is constant below 2^-24, and |y| <= 1), minus kQ8KeyFloor,
// is its key: consecutive f32 magnitudes have consecutive keys. The key's high bits are a
// bucket number, its low kQ8KeyShift bits the offset within the bucket; with the sign they
// name one of 2 * kQ8Buckets entries. No bucket holds more than one threshold (checked when
// the table is built). An entry holds the code at the bucket's smallest magnitude (bits
// 24..31), whether the code moves in this bucket (kQ8MovesBit: one step away from it, up
// for +y, down for -y, at offsets >= pos), and pos + kQ8PosBias (bits 0..18): the offset of
// the threshold nearest the bucket within kQ8Guard keys of it (its own, or a neighbour's
// just beyond an edge: pos in (-kQ8Guard, 0] or [1 << kQ8KeyShift, ...)), or kQ8PosNone.
//
// The guard makes a division unnecessary: y' = x * RN(1 / a) is within 3 keys of
// y = RN(x / a) when a is in [2^-125, 2^125] (two roundings of relative size 2^-24 against
// one; an underflowed y' is far below the floor, where keys clamp), so where no threshold
// lies within kQ8Guard keys of y' (pos - kQ8Guard <= offset < pos + kQ8Guard fails), y' and
// y have the same code; elsewhere the fast paths divide.
inline constexpr std::uint32_t kQ8KeyFloor = 0x33800000u;  // 2^-24
inline constexpr std::uint32_t kQ8KeyCeil = 0x3F800000u;   // 1
inline constexpr int kQ8KeyShift = 16;
inline constexpr std::uint32_t kQ8KeyLowMask = (1u << kQ8KeyShift) - 1u;
inline constexpr std::uint32_t kQ8Buckets = ((kQ8KeyCeil - kQ8KeyFloor) >> kQ8KeyShift) + 1u;
inline constexpr std::int32_t kQ8Guard = 4;
inline constexpr std::int32_t kQ8PosBias = 8;
inline constexpr std::uint32_t kQ8PosMask = (1u << 19) - 1u;
inline constexpr std::uint32_t kQ8PosNone = kQ8PosMask;  ///< no threshold near the bucket
inline constexpr std::uint32_t kQ8MovesBit = 1u << 19;
/// The reciprocal path's range of block maxima (f32 patterns of 2^-125 and 2^125).
inline constexpr std::uint32_t kQ8FastMinBits = 0x01000000u;
inline constexpr std::uint32_t kQ8FastMaxBits = 0x7E000000u;
/// The f32 bit pattern of 1e-12f, torchao's least stored block maximum.
inline constexpr std::uint32_t kQ8TorchaoFloorBits = 0x2B8CBCCCu;
/// torchao's stored maximum of a block holding a NaN: ATen's vector maximum, which its
/// compiled amax runs, sets every bit of a lane whose operands are unordered.
inline constexpr std::uint32_t kQ8TorchaoNanBits = 0xFFFFFFFFu;

/// One map under one rule: what the fast paths read to dequantize and requantize a slot.
struct Q8Codebook {
  const std::uint32_t* map;      ///< the 256 values, f32 bit patterns (core/q8_maps.hpp)
  const std::uint32_t* buckets;  ///< 2 * kQ8Buckets entries: [kQ8Buckets - 1 - k] for -y,
                                 ///< [kQ8Buckets + k] for +y, k the bucket number
  std::uint32_t nan_code;        ///< the code of a NaN y
  std::uint32_t floor_bits;      ///< the least stored absmax (f32 bits; 0: none)
  std::uint32_t nan_max_bits;    ///< the stored absmax of a block holding a NaN (f32 bits)
};

/// The codebook of the signed (exp_avg) or unsigned (non-negative slots) map under `rule`,
/// built on first use (thread-safe) and checked: throws Errc::internal if a bucket held two
/// thresholds (the maps are constants, so it never does; a test builds every codebook).
const Q8Codebook& q8_codebook(bool non_negative, Q8Rule rule);

/// The bucket-table entry index of y's bit pattern `b` and the offset within its bucket.
STEPCORE_HD_INLINE std::uint32_t q8_bucket_index(std::uint32_t b, std::uint32_t& low) {
  std::uint32_t m = b & 0x7FFFFFFFu;
  m = m < kQ8KeyFloor ? kQ8KeyFloor : (m > kQ8KeyCeil ? kQ8KeyCeil : m);
  const std::uint32_t key = m - kQ8KeyFloor;
  low = key & kQ8KeyLowMask;
  const std::uint32_t k = key >> kQ8KeyShift;
  return (b >> 31) != 0 ? kQ8Buckets - 1u - k : kQ8Buckets + k;
}

/// The code of y (one element; the vector bodies compute the same integer operations).
STEPCORE_HD_INLINE std::uint32_t q8_code(const Q8Codebook& cb, float y) {
  const std::uint32_t b = f32_bits(y);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return cb.nan_code;
  std::uint32_t low = 0;
  const std::uint32_t e = cb.buckets[q8_bucket_index(b, low)];
  std::uint32_t code = e >> 24;
  const auto pos = static_cast<std::int32_t>(e & kQ8PosMask) - kQ8PosBias;
  if ((e & kQ8MovesBit) != 0 && static_cast<std::int32_t>(low) >= pos)
    code = (b >> 31) != 0 ? code - 1u : code + 1u;
  return code;
}

/// The block maximum a stored for values whose largest magnitude pattern is `max_bits`
/// (NaN patterns included: then the rule's NaN, cb.nan_max_bits), with the rule's floor.
STEPCORE_HD_INLINE float q8_stored_max(const Q8Codebook& cb, std::uint32_t max_bits) {
  if (max_bits > 0x7F800000u) return f32_from_bits(cb.nan_max_bits);
  return f32_from_bits(max_bits < cb.floor_bits ? cb.floor_bits : max_bits);
}

/// The device's image of every codebook (gpu::q8_codebooks): codebook (rule, map) at word
/// kQ8ImageStride * (2 * rule + non_negative): its map's 256 words, its 2 * kQ8Buckets
/// bucket entries, nan_code, floor_bits, nan_max_bits.
inline constexpr std::size_t kQ8ImageStride = 256 + 2 * std::size_t{kQ8Buckets} + 3;
inline constexpr std::size_t kQ8ImageWords = 4 * kQ8ImageStride;

/// The image's words (q8_codebook's tables, copied).
std::vector<std::uint32_t> q8_codebook_image();

/// Codebook (non_negative, rule) read from an image in device memory.
STEPCORE_HD_INLINE Q8Codebook q8_image_codebook(const std::uint32_t* image, bool non_negative,
                                                Q8Rule rule) {
  const std::uint32_t* at =
      image + kQ8ImageStride * (2 * static_cast<std::size_t>(rule) + (non_negative ? 1 : 0));
  const std::uint32_t* tail = at + 256 + 2 * std::size_t{kQ8Buckets};
  return Q8Codebook{at, at + 256, tail[0], tail[1], tail[2]};
}

}  // namespace stepcore::detail
