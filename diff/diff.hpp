// Pairs the tensors of two inputs (recordings by (step, rank, point, name), files by
// tensor name), compares each pair, and finds the first divergence in A's order.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "diff/compare.hpp"
#include "diff/inputs.hpp"

namespace stepcore::diff {

enum class Status {
  identical,
  within_tolerance,
  different,
  missing_in_a,
  missing_in_b,
  shape_mismatch,
  dtype_mismatch,
};
constexpr std::size_t kStatusCount = 7;

/// "identical", "within_tolerance", ... (the JSON spelling).
std::string_view status_name(Status s);

/// One paired tensor: its coordinates (those of A's item, or B's when it is missing in
/// A), what each side holds, and when compared, the element statistics and the bits of
/// the first differing element on each side.
struct TensorResult {
  std::optional<std::int64_t> step;
  std::optional<std::int64_t> rank;
  std::optional<std::string> point;
  std::string name;
  std::string key;
  Status status = Status::identical;
  std::optional<TensorInfo> a;        ///< A's tensor (absent when missing in A)
  std::optional<TensorInfo> b;        ///< B's tensor (absent when missing in B)
  std::optional<ElementStats> stats;  ///< when both sides have the same dtype and shape
  std::uint64_t a_bits = 0;  ///< the first differing element's bits in A (with stats->first_index)
  std::uint64_t b_bits = 0;  ///< and in B
  std::uint32_t shards = 0;  ///< A's (or B's, when missing in A) gathered shards; 0: none

  /// The tensor's dtype and shape as reported: A's, or B's when it is missing in A.
  const TensorInfo& info() const { return a ? *a : *b; }
};

struct DiffOptions {
  std::optional<std::uint64_t> max_ulps;  ///< accept f32/bf16/f16 tensors within N ulps
  int threads = 1;
};

struct DiffResult {
  InputKind kind = InputKind::safetensors;
  /// A's tensors in A's order (recording order; ascending data offset), then those
  /// missing in A in B's order.
  std::vector<TensorResult> tensors;
  /// Index in `tensors` of the first one that is neither identical nor within tolerance.
  std::optional<std::size_t> first_divergence;
  std::array<std::uint64_t, kStatusCount> counts{};  ///< tensors per Status

  /// 0 when nothing diverges, else 1.
  int exit_status() const { return first_divergence ? 1 : 0; }
};

/// The threads to compare with by default: the CPUs of the affinity mask (at least 1).
int default_threads();

/// Compares `a` and `b`, which must be of the same kind (the caller checks).
DiffResult diff_inputs(const Input& a, const Input& b, const DiffOptions& options);

}  // namespace stepcore::diff
