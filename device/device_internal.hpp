// Internals shared by the device implementations (host_device.cpp, cuda_device.cu): the
// one definition of Event::State (an interface each device derives from), and the
// registry of a device's allocations that range-checks copies before they are queued.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "core/validate.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/numa.hpp"

namespace stepcore::device {

// What every device's events are: complete() polls, wait() blocks the calling thread.
struct Event::State {
  virtual ~State();
  // Returns true once the work recorded before the event has finished.
  virtual bool complete() = 0;
  // Blocks the calling thread until complete(); may throw the device's runtime error.
  virtual void wait() = 0;
  // wait() for at most `timeout`; returns complete() (a failed wait may throw, as wait()).
  virtual bool wait_for(std::chrono::milliseconds timeout) = 0;
};

namespace detail {

/// Returns how many CUDA events the CUDA device `d` has made for record() and record_on()
/// (they come from a pool and are reused; 0 for other devices). Defined with CUDA only.
std::uint64_t cuda_events_made(const Device& d) noexcept;

// An argument's name for an error: as given, or built from its parts.
inline const std::string& name_string(const std::string& name) { return name; }
inline std::string name_string(const char* name) { return name; }
inline std::string name_string(const ::stepcore::detail::Arg& name) { return name.str(); }

// The byte ranges of one kind of allocation (device or host) of a device, by start.
class Allocations {
 public:
  void add(const void* p, std::size_t bytes) { ranges_[addr(p)] = bytes; }  // bytes >= 1
  void remove(const void* p) { ranges_.erase(addr(p)); }
  bool owns(const void* p) const { return ranges_.count(addr(p)) != 0; }
  bool empty() const noexcept { return ranges_.empty(); }
  // Returns the start of the first allocation (the registry must not be empty).
  void* first() const { return reinterpret_cast<void*>(ranges_.begin()->first); }

  // Returns the allocation holding address p as {begin, bytes}, or {0, 0}.
  std::pair<std::uintptr_t, std::size_t> find(const void* p) const {
    auto it = ranges_.upper_bound(addr(p));
    if (it == ranges_.begin()) return {0, 0};
    --it;
    if (addr(p) - it->first >= it->second) return {0, 0};
    return {it->first, it->second};
  }
  // Returns true when p lies in an allocation; throws Errc::out_of_range when
  // [p, p + bytes) starts inside one and runs past its end.
  /// `name`: a string, or a ::stepcore::detail::Arg (built only for the error).
  template <class Name>
  bool check_inside(const void* p, std::size_t bytes, const Name& name) const {
    const auto [begin, size] = find(p);
    if (size == 0) return false;
    if (bytes > size - (addr(p) - begin))
      throw Error(Errc::out_of_range, name_string(name),
                  std::to_string(bytes) + " bytes run past the end of a " + std::to_string(size) +
                      "-byte allocation");
    return true;
  }

  static std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

 private:
  std::map<std::uintptr_t, std::size_t> ranges_;
};

// Validates copy(q, dst, src, bytes) against the device's allocations: null pointers,
// ranges past the end of an allocation, overlapping source and destination.
inline void check_copy(const Allocations& device_mem, const Allocations& host_mem, void* dst,
                       const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr) throw Error(Errc::null_pointer, "dst", "null");
  if (src == nullptr) throw Error(Errc::null_pointer, "src", "null");
  if (!device_mem.check_inside(dst, bytes, "dst")) host_mem.check_inside(dst, bytes, "dst");
  if (!device_mem.check_inside(src, bytes, "src")) host_mem.check_inside(src, bytes, "src");
  const std::uintptr_t d = Allocations::addr(dst), s = Allocations::addr(src);
  if (d < s + bytes && s < d + bytes) throw Error(Errc::overlap, "dst", "overlaps src");
}

// Validates zero(q, dst, bytes) against the device's allocations.
inline void check_zero(const Allocations& device_mem, const Allocations& host_mem, void* dst,
                       std::size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr) throw Error(Errc::null_pointer, "dst", "null");
  if (!device_mem.check_inside(dst, bytes, "dst")) host_mem.check_inside(dst, bytes, "dst");
}

// Throws Errc::invalid_argument unless q is one of the three queues.
inline void check_queue(Queue q) {
  if (q != Queue::compute && q != Queue::d2h && q != Queue::h2d)
    throw Error(Errc::invalid_argument, "q", "not a queue");
}

// The host allocations of a device (allocate_host): NUMA-placed, zero-filled buffers by
// start, and their ranges for the copy checks. Both devices keep them alike; the CUDA
// device also page-locks each one (the `pin` step of add, `unpin` on release).
class HostBuffers {
 public:
  // Returns a new buffer of max(bytes, 1) bytes placed on `numa_node` (>= -1), after
  // pin(data, bytes) succeeded (if it throws, nothing is kept).
  template <class Pin>
  void* add(std::size_t bytes, int numa_node, Pin&& pin) {
    if (numa_node < -1) throw Error(Errc::invalid_argument, "numa_node", "must be >= -1");
    const std::size_t n = bytes == 0 ? 1 : bytes;
    numa::HostBuffer buffer(n, numa_node);  // mmap'd: page-aligned, zero-filled, bound
    pin(buffer.data(), buffer.bytes());
    void* p = buffer.data();
    buffers_.emplace(p, std::move(buffer));
    ranges_.add(p, n);
    return p;
  }
  bool owns(const void* p) const { return buffers_.count(const_cast<void*>(p)) != 0; }
  // Frees buffer p (its queued work must be done); a pointer not from add is ignored.
  void remove(void* p) {
    if (buffers_.erase(p) != 0) ranges_.remove(p);
  }
  // Abandons buffer p (never unmapped or unpinned: work that may still use it is running);
  // a pointer not from add is ignored.
  void abandon(void* p) noexcept {
    auto it = buffers_.find(p);
    if (it == buffers_.end()) return;
    leak(std::move(it->second));
    buffers_.erase(it);
    ranges_.remove(p);
  }
  // Abandons every buffer (abandon(p) of each).
  void abandon() noexcept {
    while (!buffers_.empty()) abandon(buffers_.begin()->first);
  }
  // Calls f(start) for every buffer (e.g. to unpin them all before the device goes).
  template <class F>
  void for_each(F&& f) const {
    for (const auto& entry : buffers_) f(entry.first);
  }
  const Allocations& ranges() const noexcept { return ranges_; }

 private:
  // Keeps a buffer's mapping for the life of the process (its destructor never runs).
  static void leak(numa::HostBuffer&& b) noexcept {
    if (auto* kept = new (std::nothrow) numa::HostBuffer(std::move(b))) (void)kept;
  }

  std::map<void*, numa::HostBuffer> buffers_;
  Allocations ranges_;
};

// The arguments of host-memory zeroes enqueued as host callbacks (the CUDA device's
// cudaLaunchHostFunc), owned by the device for its lifetime: a callback captured into a
// CUDA graph runs at every replay, so its argument must outlive any one run (a
// callback that freed its argument would read freed memory from the second replay on).
// One record per (dst, bytes), reused; records inside a released range go with it.
class HostZeroRecords {
 public:
  struct Record {
    void* dst;
    std::size_t bytes;
  };
  /// The callback: zeroes the record's range; runs any number of times.
  static void run(void* record) noexcept {
    const auto* r = static_cast<const Record*>(record);
    std::memset(r->dst, 0, r->bytes);
  }
  /// Returns the stable record of (dst, bytes).
  Record* get(void* dst, std::size_t bytes) {
    const std::lock_guard lock(mu_);
    auto& slot = records_[{addr(dst), bytes}];
    if (!slot) slot = std::make_unique<Record>(Record{dst, bytes});
    return slot.get();
  }
  /// Drops the records inside [begin, begin + bytes) (the range was released, after the
  /// device finished with it).
  void release(const void* begin, std::size_t bytes) {
    const std::lock_guard lock(mu_);
    const std::uintptr_t b = addr(begin);
    for (auto it = records_.lower_bound({b, 0});
         it != records_.end() && it->first.first < b + bytes;)
      it = records_.erase(it);
  }
  std::size_t size() const {
    const std::lock_guard lock(mu_);
    return records_.size();
  }
  /// Leaks every record (work that may still run them was abandoned).
  void abandon() noexcept {
    const std::lock_guard lock(mu_);
    for (auto& [key, record] : records_) (void)record.release();
    records_.clear();
  }

 private:
  static std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
  mutable std::mutex mu_;
  std::map<std::pair<std::uintptr_t, std::size_t>, std::unique_ptr<Record>> records_;
};

}  // namespace detail
}  // namespace stepcore::device
