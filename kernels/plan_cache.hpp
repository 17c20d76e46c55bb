// A cache of validated multi-tensor calls (internal): a call whose arguments (every
// tensor's pointer, size and dtype, the configuration's bits, the device arguments, the
// launch limits and the device's memory check) equal those of a call already validated
// and memory-checked reuses that
// call's plan, so a trainer that repeats the same calls each step pays the checks, and
// the runtime's per-pointer memory queries, once.
//
// Invariant: an entry holds only a call that passed every check, and it is used only while
// no memory has been released through a stepcore device, and no device destroyed, since
// (the memory epoch): a released buffer's pointers are checked again. Memory freed outside stepcore
// (a framework's allocator) is trusted to stay the kind it was checked as; builds without NDEBUG
// check every call.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "stepcore/tensor.hpp"

namespace stepcore::gpu::detail {

/// The memory epoch: bumped whenever a stepcore device releases memory.
std::uint64_t memory_epoch() noexcept;
/// Called by the devices after they release device or pinned host memory.
void note_memory_released() noexcept;
/// True when validated calls are cached (release builds, unless a test turns it off).
bool plan_cache_enabled() noexcept;
/// Test hook (kernels/testing.hpp): overrides plan_cache_enabled and empties the cache;
/// returns the old value.
bool set_plan_cache_enabled(bool enabled) noexcept;

/// The exact arguments of one call, as 64-bit words (equality is exact, not a hash's).
class CallKey {
 public:
  explicit CallKey(std::size_t words_hint)
      : words_(new std::uint64_t[words_hint]), capacity_(words_hint) {}  // not zeroed
  void add(std::uint64_t w) {
    if (n_ == capacity_) grow();  // the hint was short
    words_[n_++] = w;
  }
  void add(const void* p) { add(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p))); }
  void add(double d) { add(std::bit_cast<std::uint64_t>(d)); }
  void add(const ConstTensorView& v) {
    add(v.data);
    // One word (dtype above 56 bits of size, bit 63 clear) or, for a size of 2^56 or
    // more, two (bit 63 set, then the size): the words decode uniquely either way.
    const auto dtype = static_cast<std::uint64_t>(v.dtype);
    const auto numel = static_cast<std::uint64_t>(v.numel);
    static_assert(sizeof(v.dtype) == 1);
    if (numel >> 56 == 0 && dtype < 128) {
      add(dtype << 56 | numel);
    } else {
      add(std::uint64_t{1} << 63 | dtype);
      add(numel);
    }
  }
  // Different calls differ early (their first pointers): no hash is needed to filter.
  bool operator==(const CallKey& o) const {
    return n_ == o.n_ && std::memcmp(words_.get(), o.words_.get(), n_ * sizeof(std::uint64_t)) == 0;
  }

 private:
  void grow() {
    capacity_ = 2 * capacity_ + 16;
    std::unique_ptr<std::uint64_t[]> more(new std::uint64_t[capacity_]);
    if (n_ != 0) std::memcpy(more.get(), words_.get(), n_ * sizeof(std::uint64_t));
    words_ = std::move(more);
  }
  std::unique_ptr<std::uint64_t[]> words_;
  std::size_t capacity_ = 0, n_ = 0;
};

/// The most recent validated calls of one kind (a trainer's step makes a few distinct
/// calls per kind: per group, per chunk), least recently used first out.
template <class Plan>
class PlanCache {
 public:
  static constexpr std::size_t kEntries = 64;

  /// Returns the plan of a cached call equal to `key`, if any (and still valid).
  std::optional<Plan> find(const CallKey& key) {
    if (!plan_cache_enabled()) return std::nullopt;
    const std::uint64_t epoch = memory_epoch();
    const std::lock_guard lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->epoch == epoch && it->key == key) {
        entries_.splice(entries_.begin(), entries_, it);  // most recently used first
        return entries_.front().plan;
      }
    return std::nullopt;
  }

  /// Records a call that passed every check, under the epoch read before its checks.
  void insert(CallKey key, const Plan& plan, std::uint64_t epoch) {
    if (!plan_cache_enabled()) return;
    const std::lock_guard lock(mu_);
    std::erase_if(entries_, [&](const Entry& e) { return e.epoch != memory_epoch(); });
    entries_.push_front(Entry{std::move(key), plan, epoch});
    if (entries_.size() > kEntries) entries_.pop_back();
  }

 private:
  struct Entry {
    CallKey key;
    Plan plan;
    std::uint64_t epoch;
  };
  std::mutex mu_;
  std::list<Entry> entries_;
};

}  // namespace stepcore::gpu::detail
