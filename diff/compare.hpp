// Element-by-element comparison of two arrays of one dtype: how many elements differ,
// where the first is, the ulp distances (f32, bf16, f16) with their exact maximum and
// median, and the class differences (NaN, signed zero, Inf). Runs on OpenMP threads;
// every result is the same for any thread count.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "diff/dtype.hpp"

namespace stepcore::diff {

/// The ordered integer of a float's bits (f32, bf16, f16): bits for a non-negative
/// value, -(bits & magnitude mask) for a negative one, so +0 and -0 are both 0 and
/// adjacent floats are adjacent integers across zero. `bits` must not be a NaN.
std::int64_t ordered_bits(DType t, std::uint32_t bits);

/// The ulp distance |ordered(a) - ordered(b)| of two f32/bf16/f16 bit patterns, or
/// nullopt when either is a NaN.
std::optional<std::uint64_t> ulp_distance(DType t, std::uint32_t a_bits, std::uint32_t b_bits);

/// Two arrays to compare: `elements` elements of `dtype` at `a` and at `b`.
struct ArrayPair {
  DType dtype = DType::f32;
  const std::byte* a = nullptr;
  const std::byte* b = nullptr;
  std::uint64_t elements = 0;
};

/// What comparing an ArrayPair gives. An element differs when its bits differ. For
/// f32/bf16/f16 each differing element falls in at most one class, tried in this order:
/// nan_vs_number (exactly one side NaN), nan_payload (both NaN), inf (an Inf on one side,
/// not the same Inf on the other), signed_zero (+0 against -0); the ulp statistics cover
/// the differing elements with no NaN on either side (ulp_counted of them; max and
/// median 0 when there are none). Other dtypes: differing and first_index only.
struct ElementStats {
  std::uint64_t elements = 0;
  std::uint64_t differing = 0;
  std::optional<std::uint64_t> first_index;  ///< row-major index of the first difference
  std::uint64_t nan_vs_number = 0;
  std::uint64_t nan_payload = 0;
  std::uint64_t inf = 0;
  std::uint64_t signed_zero = 0;
  std::uint64_t ulp_counted = 0;
  std::uint64_t max_ulps = 0;
  std::uint64_t median_ulps = 0;  ///< the lower median: the ((k - 1) / 2)-th smallest of k
  /// The ulp_counted distances by bit length: [0] distance 0, [1] 1, [2] 2-3, [3] 4-7, ...
  std::array<std::uint64_t, 34> ulp_log2{};

  std::uint64_t class_differences() const {
    return nan_vs_number + nan_payload + inf + signed_zero;
  }
};

/// Compares every pair on `threads` threads (at least 1); result i is pairs[i]'s. Pairs
/// under 8 MiB are compared whole, one per thread at a time; larger ones in chunks of
/// 2^20 elements across all threads, their partial results merged exactly (integer sums,
/// minima, maxima, histograms), so the results do not depend on the thread count.
std::vector<ElementStats> compare_arrays(const std::vector<ArrayPair>& pairs, int threads);

}  // namespace stepcore::diff
