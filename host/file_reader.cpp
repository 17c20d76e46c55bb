// FileReader: open, fstat, pread in chunks, fstat again after the last read; and the
// read hook of host/testing.hpp.
#include "host/file_reader.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "host/testing.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

namespace {

// ScopedReadHook's read size (0: none set) and call, on this thread.
thread_local std::size_t tl_read_chunk = 0;
thread_local std::function<void(std::uint64_t)> tl_read_hook;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(Errc::io_error, "path", path + ": " + what);
}

[[noreturn]] void fail(const std::string& path, const std::string& what, int err) {
  fail(path, what + ": " + std::strerror(err));
}

}  // namespace

FileReader::FileReader(std::string path) : path_(std::move(path)) {
  // O_NONBLOCK: a FIFO at `path` is refused below instead of blocking the open.
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(path_, "cannot open", errno);
  struct stat st {};
  const int stat_rc = ::fstat(fd, &st);
  const int stat_errno = errno;
  if (stat_rc != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    if (stat_rc != 0) fail(path_, "cannot stat", stat_errno);
    if (S_ISDIR(st.st_mode)) fail(path_, "cannot read", EISDIR);
    fail(path_, "not a regular file");
  }
  fd_ = fd;
  size_ = static_cast<std::uint64_t>(st.st_size);
  (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint: read front to back
  if (tl_read_chunk != 0) chunk_ = tl_read_chunk;
  hook_ = tl_read_hook;
}

FileReader::~FileReader() { ::close(fd_); }

void FileReader::read(std::byte* out, std::uint64_t from, std::uint64_t to) const {
  read_to(out + from, from, to);
}

void FileReader::read_to(std::byte* dst, std::uint64_t from, std::uint64_t to) const {
  for (std::uint64_t done = from; done < to;) {
    if (hook_) {
      const std::lock_guard lock(hook_mu_);
      hook_(done);
    }
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_, to - done));
    const ssize_t got = ::pread(fd_, dst + (done - from), want, static_cast<off_t>(done));
    if (got < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      fail(path_, "cannot read at byte " + std::to_string(done), err);
    }
    if (got == 0)
      fail(path_, "ends at byte " + std::to_string(done) + " while being read, not at its size " +
                      std::to_string(size_) + " (truncated by another process?)");
    done += static_cast<std::uint64_t>(got);
  }
}

void FileReader::check_size(bool grown_ok) const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail(path_, "cannot stat", errno);
  const auto now = static_cast<std::uint64_t>(st.st_size);
  if (now < size_)
    fail(path_, "shrank from " + std::to_string(size_) + " to " + std::to_string(now) +
                    " bytes while being read (truncated by another process?)");
  if (now > size_ && !grown_ok)
    fail(path_, "grew from " + std::to_string(size_) + " to " + std::to_string(now) +
                    " bytes while being read");
}

namespace testing {

ScopedReadHook::ScopedReadHook(std::size_t chunk_bytes,
                               std::function<void(std::uint64_t offset)> before_read)
    : saved_chunk_(tl_read_chunk), saved_hook_(std::move(tl_read_hook)) {
  tl_read_chunk = chunk_bytes;
  tl_read_hook = std::move(before_read);
}

ScopedReadHook::~ScopedReadHook() {
  tl_read_chunk = saved_chunk_;
  tl_read_hook = std::move(saved_hook_);
}

}  // namespace testing

}  // namespace stepcore::detail
