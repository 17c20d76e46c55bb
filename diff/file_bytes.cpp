// FileBytes: the library's FileReader into one buffer sized and aligned for the file; its
// errors (Errc::io_error, "<path>: <what is wrong>") become InputErrors saying the same.
#include "diff/file_bytes.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <string_view>

#include "host/file_reader.hpp"
#include "stepcore/diff.hpp"
#include "stepcore/error.hpp"

namespace stepcore::diff {

namespace {

constexpr std::uint64_t kHugePage = std::uint64_t{2} << 20;  // a large buffer's alignment

}  // namespace

FileBytes::FileBytes(const std::string& path) : path_(path) {
  try {
    const detail::FileReader file(path);
    size_ = file.size();
    if (size_ == 0) return;
    // A file of 8 MiB or more: 2 MiB-aligned and advised for huge pages (faulting in a
    // large buffer 4 KiB page by page costs more than copying the file into it); smaller
    // ones 64-byte aligned, so that many small files do not each hold a huge page.
    const bool huge = size_ >= 4 * kHugePage;
    const std::uint64_t align = huge ? kHugePage : 64;
    const std::uint64_t rounded = (size_ + align - 1) / align * align;
    data_.reset(static_cast<std::byte*>(std::aligned_alloc(align, rounded)));
    if (!data_)
      throw InputError(path, "cannot hold its " + std::to_string(size_) + " bytes in memory");
    if (huge) (void)::madvise(data_.get(), rounded, MADV_HUGEPAGE);
    file.read(data_.get(), 0, size_);
    // A truncation racing the last read can hand it zeros for the bytes it cut (the kernel
    // lowers the size before it clears the page tail): a size that shrank meanwhile is
    // the same error, and a size still whole means every byte read was the file's.
    file.check_size(/*grown_ok=*/true);
  } catch (const Error& e) {
    std::string_view what = e.what();  // "<path>: <what is wrong>"
    if (what.starts_with(path + ": ")) what.remove_prefix(path.size() + 2);
    throw InputError(path, std::string(what));
  }
}

void FileBytes::Free::operator()(std::byte* p) const noexcept { std::free(p); }

}  // namespace stepcore::diff
