// FileBytes: open, fstat, pread in chunks into one buffer, fstat again, close. A short
// read (end of file before fstat's size) or a smaller size afterwards is the file
// shrinking under us: an InputError.
#include "diff/file_bytes.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "stepcore/diff.hpp"

namespace stepcore::diff {

namespace {

constexpr std::size_t kChunk = std::size_t{8} << 20;         // bytes per pread
constexpr std::uint64_t kHugePage = std::uint64_t{2} << 20;  // a large buffer's alignment

// ScopedReadHook's read size (0: none set) and call, on this thread.
thread_local std::size_t tl_read_chunk = 0;
thread_local std::function<void(std::uint64_t)> tl_read_hook;

// Closes the descriptor when the read ends, however it ends.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

FileBytes::FileBytes(const std::string& path) : path_(path) {
  const Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) throw InputError(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0)
    throw InputError(path, std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw InputError(path, "not a regular file");
  size_ = static_cast<std::uint64_t>(st.st_size);
  if (size_ == 0) return;
  // A file of 8 MiB or more: 2 MiB-aligned and advised for huge pages (faulting in a large
  // buffer 4 KiB page by page costs more than copying the file into it); smaller ones
  // 64-byte aligned, so that many small files do not each hold a huge page.
  const bool huge = size_ >= 4 * kHugePage;
  const std::uint64_t align = huge ? kHugePage : 64;
  const std::uint64_t rounded = (size_ + align - 1) / align * align;
  data_.reset(static_cast<std::byte*>(std::aligned_alloc(align, rounded)));
  if (!data_)
    throw InputError(path, "cannot hold its " + std::to_string(size_) + " bytes in memory");
  if (huge) (void)::madvise(data_.get(), rounded, MADV_HUGEPAGE);
  const std::size_t chunk = tl_read_chunk > 0 ? tl_read_chunk : kChunk;
  for (std::uint64_t done = 0; done < size_;) {
    if (tl_read_hook) tl_read_hook(done);
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, size_ - done));
    const ssize_t got = ::pread(f.fd, data_.get() + done, want, static_cast<off_t>(done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw InputError(path,
                       "cannot read at byte " + std::to_string(done) + ": " + std::strerror(errno));
    }
    if (got == 0)
      throw InputError(path, "ends at byte " + std::to_string(done) + " while being read, " +
                                 "not at its size " + std::to_string(size_) +
                                 " (truncated by another process?)");
    done += static_cast<std::uint64_t>(got);
  }
  // A truncation racing the last read can hand it zeros for the bytes it cut (the kernel
  // lowers the size before it clears the page tail): a size that changed meanwhile is
  // the same error, and a size still whole means every byte read was the file's.
  struct stat after {};
  if (::fstat(f.fd, &after) != 0)
    throw InputError(path, std::string("cannot stat: ") + std::strerror(errno));
  if (static_cast<std::uint64_t>(after.st_size) < size_)
    throw InputError(path, "shrank from " + std::to_string(size_) + " to " +
                               std::to_string(after.st_size) + " bytes while being read " +
                               "(truncated by another process?)");
}

void FileBytes::Free::operator()(std::byte* p) const noexcept { std::free(p); }

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

}  // namespace stepcore::diff
