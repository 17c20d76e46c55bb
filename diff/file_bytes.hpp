// A whole file read into memory (chunked pread, never mmap): a file that another process
// truncates while it is read is an InputError, never a SIGBUS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace stepcore::diff {

/// The bytes of a regular file, read whole when constructed. Throws InputError naming
/// the path when it cannot be opened, is not a regular file, cannot be read, or ends
/// before the size fstat gave or has a smaller size after the read (it shrank while
/// being read). An empty file has no bytes
/// (data() is null, size() 0). What is read stays valid whatever happens to the file.
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

namespace testing {

/// While alive, FileBytes on this thread reads `chunk_bytes` at a time (> 0) and calls
/// `before_read(offset)` before each read; the previous hook, if any, is back afterwards.
class ScopedReadHook {
 public:
  ScopedReadHook(std::size_t chunk_bytes, std::function<void(std::uint64_t offset)> before_read);
  ~ScopedReadHook();
  ScopedReadHook(const ScopedReadHook&) = delete;
  ScopedReadHook& operator=(const ScopedReadHook&) = delete;

 private:
  std::size_t saved_chunk_;
  std::function<void(std::uint64_t)> saved_hook_;
};

}  // namespace testing

}  // namespace stepcore::diff
