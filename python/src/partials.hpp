// A norm partial as Python sees it: PARTIAL_WORDS int64 words (Engine.norm_partial's
// result, finalize's argument, stepcore.gpu.partial_words' result), one layout for the
// CPU engine and the GPU launchers.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "stepcore/norm.hpp"

namespace stepcore::python {

namespace nb = nanobind;

/// The words: 20 digits, nan_count, inf_count, max_abs_bits, approximate. SUM of every
/// word but max_abs_bits, MAX of that one, combine partials exactly (the digits stay below
/// 2^63 for up to 2^31 partials).
inline constexpr std::size_t kPartialWords = kNormDigits + 4;
/// The word combined with MAX (max_abs_bits).
inline constexpr std::size_t kMaxAbsWord = kNormDigits + 2;

/// The struct NormPartial itself, as the device keeps it and a collective reduces it in
/// place: words [0, kStructSumWords) are uint64 summed (digits, nan_count, inf_count);
/// the uint32 words [kStructMaxInt32, kStructMaxInt32 + 2) (max_abs_bits, approximate)
/// combined with max.
inline constexpr std::size_t kStructSumWords = kNormDigits + 2;
inline constexpr std::size_t kStructMaxInt32 = 2 * kStructSumWords;
static_assert(std::is_trivially_copyable_v<NormPartial>);
static_assert(sizeof(NormPartial) == 8 * kStructSumWords + 8);
static_assert(offsetof(NormPartial, nan_count) == 8 * kNormDigits);
static_assert(offsetof(NormPartial, max_abs_bits) == 4 * kStructMaxInt32);
static_assert(offsetof(NormPartial, approximate) == 4 * kStructMaxInt32 + 4);

/// Returns `p` as a new numpy array of kPartialWords int64 words.
inline nb::ndarray<nb::numpy, std::int64_t, nb::shape<-1>> partial_array(const NormPartial& p) {
  auto* words = new std::int64_t[kPartialWords];
  for (int k = 0; k < kNormDigits; ++k) words[k] = static_cast<std::int64_t>(p.digits[k]);
  words[kNormDigits] = static_cast<std::int64_t>(p.nan_count);
  words[kNormDigits + 1] = static_cast<std::int64_t>(p.inf_count);
  words[kMaxAbsWord] = static_cast<std::int64_t>(p.max_abs_bits);
  words[kNormDigits + 3] = static_cast<std::int64_t>(p.approximate);
  nb::capsule owner(words, [](void* w) noexcept { delete[] static_cast<std::int64_t*>(w); });
  return {words, {kPartialWords}, owner};
}

}  // namespace stepcore::python
