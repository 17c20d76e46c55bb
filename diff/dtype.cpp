// The dtype table of stepcore-diff: header names, sizes and kinds, in one place.
#include "diff/dtype.hpp"

#include <array>

namespace stepcore::diff {

namespace {

struct Row {
  DType type;
  std::string_view name;
  std::size_t size;
  bool ulps;
  bool is_float;
};

constexpr std::array<Row, 10> kRows{{
    {DType::f32, "F32", 4, true, true},
    {DType::bf16, "BF16", 2, true, true},
    {DType::f16, "F16", 2, true, true},
    {DType::f64, "F64", 8, false, true},
    {DType::i64, "I64", 8, false, false},
    {DType::i32, "I32", 4, false, false},
    {DType::i16, "I16", 2, false, false},
    {DType::i8, "I8", 1, false, false},
    {DType::u8, "U8", 1, false, false},
    {DType::boolean, "BOOL", 1, false, false},
}};

constexpr bool rows_in_enum_order() {
  for (std::size_t i = 0; i < kRows.size(); ++i)
    if (static_cast<std::size_t>(kRows[i].type) != i) return false;
  return true;
}
static_assert(rows_in_enum_order(), "kRows is indexed by DType");

const Row& row(DType t) { return kRows[static_cast<std::size_t>(t)]; }

}  // namespace

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const Row& r : kRows)
    if (r.name == name) return r.type;
  return std::nullopt;
}

std::string_view dtype_name(DType t) { return row(t).name; }
std::size_t dtype_size(DType t) { return row(t).size; }
bool dtype_has_ulps(DType t) { return row(t).ulps; }
bool dtype_is_float(DType t) { return row(t).is_float; }

}  // namespace stepcore::diff
