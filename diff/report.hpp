// stepcore-diff's two outputs of a DiffResult: the human table and summary line, and
// the JSON object (the schema the Python comparer shares, docs/diff.md).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include "diff/diff.hpp"

namespace stepcore::diff {

/// The decimal value of an element's bits: for floats the shortest text that reads back
/// to the same value ("1.0000001", "-0", "nan", "inf", "-inf"; bf16/f16 as their exact
/// f32 value), for integers the integer (BOOL: the byte's value).
std::string value_string(DType t, std::uint64_t bits);

/// The bits as "0x" and two lowercase hex digits per byte of the dtype ("0x3f800000").
std::string hex_string(DType t, std::uint64_t bits);

/// Writes the table of the non-identical tensors (every tensor with `all`), then the
/// summary: "first divergence: step S, point P, name N, rank R" (files: "name N") and
/// the counts; or "identical: K tensors" when every tensor is bitwise identical; or
/// "within tolerance: K tensors (I identical, W within N ulps)" when --max-ulps accepted
/// some. `max_ulps` is the tolerance in force, if any.
void write_human(std::ostream& out, const DiffResult& r, bool all,
                 std::optional<std::uint64_t> max_ulps);

/// Writes one JSON object and a newline (docs/diff.md, "JSON output").
void write_json(std::ostream& out, const DiffResult& r);

/// Writes a JSON array, one object per tensor of `r` in its order, of what the Python
/// report draws beyond the JSON output: "hist" (ElementStats::ulp_log2, its 34 buckets,
/// for a differing tensor of an ulp-aware dtype; else null), "a" and
/// "b" (each side's [dtype, shape], null when missing) and "shards" (A's gathered
/// shards, 0 when none).
void write_details_json(std::ostream& out, const DiffResult& r);

}  // namespace stepcore::diff
