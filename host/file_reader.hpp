// The one reader of whole files: a regular file read with pread, in chunks, never
// mapped, so that another process truncating it while it is read makes the read an
// error naming the file, never a SIGBUS. The checkpoint loader
// (managers/checkpoint_reader.cpp) and the comparer (diff/file_bytes.cpp) read through
// it; its test hook is host/testing.hpp's ScopedReadHook.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace stepcore::detail {

/// A regular file open for reading. Every error is Errc::io_error naming "path", its
/// message "<path>: <what is wrong>" (with the system's reason where there is one).
class FileReader {
 public:
  /// Bytes per pread, unless a ScopedReadHook says otherwise.
  static constexpr std::size_t kChunk = std::size_t{8} << 20;

  /// Opens `path` and takes its size: throws when it cannot be opened or stat'ed, is a
  /// directory ("cannot read: Is a directory") or another non-regular file (a FIFO is
  /// refused, never waited on). Takes this thread's ScopedReadHook, if one is set.
  explicit FileReader(std::string path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  const std::string& path() const noexcept { return path_; }
  /// The file's size when it was opened.
  std::uint64_t size() const noexcept { return size_; }

  /// Reads bytes [from, to) of the file (to <= size()) into out + from, EINTR retried.
  /// Throws when a read fails ("cannot read at byte N: <reason>") or the file ends before
  /// `to` ("ends at byte N while being read, not at its size S"). Several threads may
  /// read disjoint ranges at once; the hook is then called one read at a time.
  void read(std::byte* out, std::uint64_t from, std::uint64_t to) const;
  /// Reads bytes [from, to) of the file into dst[0, to - from), as read does.
  void read_to(std::byte* dst, std::uint64_t from, std::uint64_t to) const;

  /// Throws unless the file's size is still size() (`grown_ok`: or larger): a file that
  /// shrank (or grew) while it was read. After the last read, this tells a truncation
  /// that raced it, whose zeroed bytes a read may have returned.
  void check_size(bool grown_ok = false) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::size_t chunk_ = kChunk;
  std::function<void(std::uint64_t)> hook_;  ///< the opening thread's ScopedReadHook
  mutable std::mutex hook_mu_;               ///< one hook call at a time
};

}  // namespace stepcore::detail
