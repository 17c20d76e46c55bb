// A whole file read into memory through the library's file reader (host/file_reader.hpp:
// chunked pread, never mmap): a file that another process truncates while it is read is
// an InputError, never a SIGBUS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace stepcore::diff {

/// The bytes of a regular file, read whole when constructed. Throws InputError naming
/// the path when it cannot be opened, is not a regular file, cannot be read, or ends
/// before the size fstat gave or has a smaller size after the read (it shrank while
/// being read; one that grew, a journal being appended to, keeps what was read). An
/// empty file has no bytes (data() is null, size() 0). What is read stays valid
/// whatever happens to the file.
class FileBytes {
 public:
  explicit FileBytes(const std::string& path);

  const std::byte* data() const { return data_.get(); }
  std::uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept;
  };
  std::string path_;
  std::unique_ptr<std::byte, Free> data_;  ///< aligned_alloc'd (large: 2 MiB, huge pages)
  std::uint64_t size_ = 0;
};

}  // namespace stepcore::diff
