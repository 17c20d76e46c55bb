// A test-only safetensors writer for stepcore-diff's tests, independent of the reader:
// the JSON header is written out by hand and the length by byte shifts, so crafted
// files (well formed or corrupt) are exactly the bytes a test asks for.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace test_support {

using Bytes = std::vector<std::uint8_t>;

/// One tensor to write: its header name and dtype ("F32", ...), shape and raw data.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  Bytes data;
};

/// The little-endian bytes of 32-bit words (f32 bit patterns, I32 values).
inline Bytes words32(const std::vector<std::uint32_t>& v) {
  Bytes out;
  for (std::uint32_t w : v)
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(w >> (8 * i)));
  return out;
}

/// The little-endian bytes of 16-bit words (bf16/f16 bit patterns).
inline Bytes words16(const std::vector<std::uint16_t>& v) {
  Bytes out;
  for (std::uint16_t w : v) {
    out.push_back(static_cast<std::uint8_t>(w));
    out.push_back(static_cast<std::uint8_t>(w >> 8));
  }
  return out;
}

/// Writes `bytes` to `path` as they are.
inline void write_bytes(const std::filesystem::path& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path.string());
}

/// A file of: the 8-byte little-endian `header_length`, the header text, then `data`.
inline Bytes file_bytes(const std::string& header, const Bytes& data, std::uint64_t header_length) {
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(header_length >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

/// The same with the header's true length.
inline Bytes file_bytes(const std::string& header, const Bytes& data) {
  return file_bytes(header, data, header.size());
}

/// The JSON header of `tensors` laid out back to back in the given order (names are
/// plain ASCII without quotes or backslashes), plus "__metadata__" when `metadata` is
/// not empty (a JSON object text such as {"step":"3"}).
inline std::string header_of(const std::vector<RawTensor>& tensors,
                             const std::string& metadata = "") {
  std::string h = "{";
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const RawTensor& t = tensors[i];
    if (i > 0) h += ",";
    h += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (std::size_t d = 0; d < t.shape.size(); ++d)
      h += (d ? "," : "") + std::to_string(t.shape[d]);
    h += "],\"data_offsets\":[" + std::to_string(at) + "," + std::to_string(at + t.data.size()) +
         "]}";
    at += t.data.size();
  }
  if (!metadata.empty())
    h += std::string(tensors.empty() ? "" : ",") + "\"__metadata__\":" + metadata;
  return h + "}";
}

/// Writes a well-formed safetensors file of `tensors` to `path`.
inline void write_safetensors(const std::filesystem::path& path,
                              const std::vector<RawTensor>& tensors,
                              const std::string& metadata = "") {
  Bytes data;
  for (const RawTensor& t : tensors) data.insert(data.end(), t.data.begin(), t.data.end());
  write_bytes(path, file_bytes(header_of(tensors, metadata), data));
}

/// Writes `text` to `path` (a manifest).
inline void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace test_support
