// A safetensors file, read into memory and validated: 8-byte little-endian header length N,
// N bytes of JSON header (tensor name -> dtype, shape, data_offsets; an optional
// "__metadata__" of strings), then the raw little-endian data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "diff/dtype.hpp"
#include "diff/file_bytes.hpp"

namespace stepcore::diff {

/// One tensor of a safetensors header, validated against the file.
struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t elements = 0;  ///< product of shape (1 for shape [])
  std::uint64_t begin = 0;     ///< data_offsets[0], relative to the byte after the header
  std::uint64_t end = 0;       ///< data_offsets[1]
};

/// A safetensors file, read whole into memory (FileBytes). The constructor validates everything
/// before returning (and throws InputError naming the path and the problem otherwise): the header
/// length fits in the file; the header is a JSON object without repeated keys; every tensor has a
/// known dtype, a shape of non-negative integers whose element count (and byte count) fits in 64
/// bits, and data_offsets [begin, end] with begin <= end <= the data's size and end - begin =
/// elements * element size; no two non-empty ranges overlap; "__metadata__", if present, maps
/// strings to strings.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return bytes_.path(); }
  /// The tensors in ascending data offset (begin, then end, then name).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The tensor named `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  /// The first byte of `t`'s data (t must be one of tensors()).
  const std::byte* data(const TensorInfo& t) const { return bytes_.data() + data_start_ + t.begin; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  FileBytes bytes_;
  std::uint64_t data_start_ = 0;  ///< 8 + N
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

/// Formats a shape as "[61, 12]" (messages and the human table).
std::string shape_string(const std::vector<std::int64_t>& shape);

}  // namespace stepcore::diff
