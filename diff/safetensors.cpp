// SafetensorsFile: the header's length, JSON and every tensor entry checked against the
// file's bytes (read whole into memory) before anything reads a tensor's bytes.
#include "diff/safetensors.hpp"

#include <algorithm>
#include <limits>

#include "diff/json_parse.hpp"
#include "stepcore/diff.hpp"

namespace stepcore::diff {

namespace {

using nlohmann::json;

std::string in_quotes(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string known_dtypes() {
  std::string s;
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i64, DType::i32,
                  DType::i16, DType::i8, DType::u8, DType::boolean}) {
    if (!s.empty()) s += ' ';
    s += dtype_name(t);
  }
  return s;
}

// Reads one tensor entry `v` named `name`; throws InputError(path, ...) when it is malformed.
TensorInfo read_entry(const std::string& path, const std::string& name, const json& v,
                      std::uint64_t data_size) {
  const std::string who = "tensor " + in_quotes(name);
  const auto fail = [&](const std::string& what) { throw InputError(path, who + ": " + what); };
  if (!v.is_object()) fail("its entry is " + json_kind(v) + ", not an object");
  TensorInfo t;
  t.name = name;

  const auto dt = v.find("dtype");
  if (dt == v.end()) fail("no \"dtype\"");
  if (!dt->is_string()) fail("\"dtype\" is " + json_kind(*dt) + ", not a string");
  const auto type = dtype_from_name(dt->get_ref<const std::string&>());
  if (!type)
    fail("unknown dtype \"" + dt->get<std::string>() + "\" (known: " + known_dtypes() + ")");
  t.dtype = *type;

  const auto sh = v.find("shape");
  if (sh == v.end()) fail("no \"shape\"");
  if (!sh->is_array()) fail("\"shape\" is " + json_kind(*sh) + ", not an array");
  std::uint64_t elements = 1;
  bool overflow = false;
  for (std::size_t i = 0; i < sh->size(); ++i) {
    const json& d = (*sh)[i];
    const std::string at = "shape[" + std::to_string(i) + "]";
    if (d.is_number_integer() && !d.is_number_unsigned())
      fail(at + " is " + std::to_string(d.get<std::int64_t>()) + ", negative");
    if (!d.is_number_unsigned()) fail(at + " is " + json_kind(d) + ", not an integer");
    const std::uint64_t n = d.get<std::uint64_t>();
    if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail(at + " is " + std::to_string(n) + ", more than 2^63 - 1");
    t.shape.push_back(static_cast<std::int64_t>(n));
    overflow = overflow || __builtin_mul_overflow(elements, n, &elements);
  }
  std::uint64_t bytes = 0;
  if (overflow || __builtin_mul_overflow(elements, dtype_size(t.dtype), &bytes))
    fail("the element count of shape " + shape_string(t.shape) + " overflows 64 bits");
  t.elements = elements;

  const auto off = v.find("data_offsets");
  if (off == v.end()) fail("no \"data_offsets\"");
  if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned())
    fail("\"data_offsets\" is " + off->dump() + ", not an array of two non-negative integers");
  t.begin = (*off)[0].get<std::uint64_t>();
  t.end = (*off)[1].get<std::uint64_t>();
  const std::string range =
      "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "]";
  if (t.begin > t.end) fail(range + ": begin > end");
  if (t.end > data_size)
    fail(range + " run past the end of the data (" + std::to_string(data_size) +
         " bytes after the header)");
  if (t.end - t.begin != bytes)
    fail(range + " hold " + std::to_string(t.end - t.begin) + " bytes, but shape " +
         shape_string(t.shape) + " of " + std::string(dtype_name(t.dtype)) + " needs " +
         std::to_string(bytes));
  return t;
}

}  // namespace

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

SafetensorsFile::SafetensorsFile(const std::string& path) : bytes_(path) {
  const std::uint64_t size = bytes_.size();
  if (size < 8)
    throw InputError(path, "the file is " + std::to_string(size) +
                               " bytes, shorter than the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(bytes_.data()[i]);
  if (n > size - 8)
    throw InputError(path, "the header length " + std::to_string(n) +
                               " runs past the end of the file (8 + " + std::to_string(n) + " > " +
                               std::to_string(size) + " bytes)");
  data_start_ = 8 + n;
  const std::string_view text(reinterpret_cast<const char*>(bytes_.data()) + 8, n);
  const json header = parse_json(text, path, "the header");
  if (!header.is_object())
    throw InputError(path, "the header is " + json_kind(header) + ", not a JSON object");
  const std::uint64_t data_size = size - data_start_;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object())
        throw InputError(path, "\"__metadata__\" is " + json_kind(v) + ", not an object");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string())
          throw InputError(path, "\"__metadata__\" entry " + in_quotes(k) + " is " + json_kind(s) +
                                     ", not a string");
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    tensors_.push_back(read_entry(path, name, v, data_size));
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& x, const TensorInfo& y) {
    if (x.begin != y.begin) return x.begin < y.begin;
    if (x.end != y.end) return x.end < y.end;
    return x.name < y.name;
  });
  // Sorted by begin: a non-empty range overlaps another exactly when it starts before the
  // end of the furthest-reaching non-empty range before it.
  const TensorInfo* reach = nullptr;
  for (const TensorInfo& t : tensors_) {
    if (t.begin == t.end) continue;
    if (reach != nullptr && t.begin < reach->end)
      throw InputError(path, "tensors " + in_quotes(reach->name) + " [" +
                                 std::to_string(reach->begin) + ", " + std::to_string(reach->end) +
                                 ") and " + in_quotes(t.name) + " [" + std::to_string(t.begin) +
                                 ", " + std::to_string(t.end) + ") overlap");
    if (reach == nullptr || t.end > reach->end) reach = &t;
  }
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace stepcore::diff
