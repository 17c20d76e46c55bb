// A whole file memory-mapped read-only (mmap), unmapped when the object goes away.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace stepcore_diff {

/// A regular file mapped read-only and shared. Throws InputError naming the path when it
/// cannot be opened, is not a regular file, or cannot be mapped. An empty file maps to
/// no bytes (data() is null, size() 0).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&&) = delete;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  std::uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

}  // namespace stepcore_diff
