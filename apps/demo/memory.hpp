// stepcore-demo's memory: AlignedArray, a zero-filled page-aligned array whose pages
// are all touched before any timed phase -- pre-faulted anonymous memory, or a
// NUMA-placed stepcore::numa::HostBuffer the engine's workers first-touched.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "stepcore/numa.hpp"

namespace stepcore_demo {

/// A zero-filled, page-aligned array of trivially copyable T whose pages are all
/// touched before any timed phase, so none pays for first-touch page faults: either
/// anonymous memory pre-faulted at allocation by the allocating thread, or a
/// NUMA-placed numa::HostBuffer the engine's workers have first-touched.
template <class T>
class AlignedArray {
 public:
  AlignedArray() = default;
  /// Allocates n zeroed elements, pre-faulted; throws std::bad_alloc.
  explicit AlignedArray(std::size_t n) : n_(n) {
    if (n == 0) return;
    bytes_ = (n * sizeof(T) + 4095) / 4096 * 4096;
#if defined(__linux__)
    // MAP_POPULATE faults the (kernel-zeroed) pages in one go: about twice as fast
    // as touching them one by one on virtual machines.
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
#else
    void* p = std::aligned_alloc(4096, bytes_);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes_);
#endif
    p_.reset(static_cast<T*>(p));
    p_.get_deleter().bytes = bytes_;
  }
  /// Takes the first n elements of `placed` (already first-touched by the caller).
  AlignedArray(std::size_t n, stepcore::numa::HostBuffer placed)
      : placed_(std::move(placed)), n_(n) {
    (void)placed_.at<T>(0, n);  // throws unless the buffer holds n elements of T
  }
  T* data() const { return p_ ? p_.get() : static_cast<T*>(placed_.data()); }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  /// Returns the placed buffer, or nullptr for pre-faulted anonymous memory.
  const stepcore::numa::HostBuffer* placed() const { return placed_.data() ? &placed_ : nullptr; }

 private:
  struct Release {
    std::size_t bytes = 0;
    void operator()(T* p) const {
#if defined(__linux__)
      munmap(p, bytes);
#else
      std::free(p);
#endif
    }
  };
  std::unique_ptr<T, Release> p_;
  stepcore::numa::HostBuffer placed_;
  std::size_t n_ = 0;
  std::size_t bytes_ = 0;
};

/// Returns a copy of `a` (same size, same bytes).
template <class T>
AlignedArray<T> clone(const AlignedArray<T>& a) {
  AlignedArray<T> c(a.size());
  if (a.size() != 0) std::memcpy(c.data(), a.data(), a.bytes());
  return c;
}

}  // namespace stepcore_demo
