// The element types a safetensors file may hold for stepcore-diff: their names in the
// header, their sizes, and which of them are compared in ulps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace stepcore::diff {

/// A safetensors dtype stepcore-diff knows. f32, bf16 and f16 are compared ulp-aware;
/// the others bitwise (equal or not).
enum class DType : std::uint8_t { f32, bf16, f16, f64, i64, i32, i16, i8, u8, boolean };

/// Returns the dtype named `name` in a safetensors header ("F32", "BF16", ...), or
/// nullopt when stepcore-diff does not know it.
std::optional<DType> dtype_from_name(std::string_view name);

/// Returns the header name of `t` ("F32", "BF16", ..., "BOOL").
std::string_view dtype_name(DType t);

/// Returns the size in bytes of one element of `t`.
std::size_t dtype_size(DType t);

/// True for the dtypes compared in ulps: f32, bf16, f16.
bool dtype_has_ulps(DType t);

/// True for the floating-point dtypes (their values print as numbers with a fraction).
bool dtype_is_float(DType t);

}  // namespace stepcore::diff
