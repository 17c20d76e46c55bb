// MappedFile: open, fstat, mmap(PROT_READ, MAP_SHARED), close; munmap on destruction.
#include "mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "error.hpp"

namespace stepcore_diff {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw InputError(path, std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(path, "not a regular file");
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw InputError(path, std::string("cannot map: ") + std::strerror(e));
    }
    data_ = static_cast<const std::byte*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

}  // namespace stepcore_diff
