// A cache of validated multi-tensor calls (internal): a call whose arguments (every
// tensor's pointer, size and dtype, the configuration's bits, the device arguments, the
// launch limits and the device's memory check) equal those of a call already validated
// and memory-checked reuses that call's plan, so a trainer that repeats the same calls
// each step pays the checks, and the runtime's per-pointer memory queries, once. Two
// stores: one shared cache per kind of call (PlanCache, for any caller), and the plans a
// caller owns (OwnedPlan: a gradient manager keeps one per parameter and copy flag, so
// its per-parameter accumulates never compete for the shared cache's entries).
//
// Invariant: a store holds only a call that passed every check, and it is used only while
// no memory has been released through a stepcore device, and no device destroyed, since
// (the memory epoch): a released buffer's pointers are checked again. Memory freed outside stepcore
// (a framework's allocator) is trusted to stay the kind it was checked as; builds without NDEBUG
// check every call.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
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

/// The kinds of validated calls, counted (testing::call_counts) as reused or validated.
enum class CallKind : std::uint8_t { norm, scale, accumulate, optimizer };
inline constexpr int kCallKinds = 4;
/// Counts one call of `kind`: its plan reused (validated = false) or validated.
void count_call(CallKind kind, bool validated) noexcept;

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
  /// A hash of the words (the shared cache's index; equality stays exact).
  std::uint64_t hash() const noexcept {
    std::uint64_t h = 0x9E3779B97F4A7C15ull ^ n_;
    for (std::size_t i = 0; i < n_; ++i) {
      h ^= words_[i] + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
      h *= 0xBF58476D1CE4E5B9ull;
    }
    return h ^ (h >> 31);
  }
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

/// The most recent validated calls of one kind, least recently used first out, found
/// through a hash of their keys. kEntries holds a trainer's working set: a step's
/// distinct calls (per group, per chunk) and, for a caller that calls per parameter,
/// one per parameter tensor of a large model (a 405B-parameter transformer has ~1,100).
/// At most kEntries plans are kept per kind (a one-launch plan is ~10 KB).
template <class Plan>
class PlanCache {
 public:
  static constexpr std::size_t kEntries = 2048;

  /// Returns the plan of a cached call equal to `key`, if any (and still valid).
  std::optional<Plan> find(const CallKey& key) {
    if (!plan_cache_enabled()) return std::nullopt;
    const std::uint64_t epoch = memory_epoch();
    const std::uint64_t h = key.hash();
    const std::lock_guard lock(mu_);
    for (auto [it, end] = index_.equal_range(h); it != end; ++it) {
      const auto e = it->second;
      if (e->epoch == epoch && e->key == key) {
        entries_.splice(entries_.begin(), entries_, e);  // most recently used first
        return entries_.front().plan;
      }
    }
    return std::nullopt;
  }

  /// Records a call that passed every check, under the epoch read before its checks.
  void insert(CallKey key, const Plan& plan, std::uint64_t epoch) {
    if (!plan_cache_enabled()) return;
    const std::uint64_t h = key.hash();
    const std::lock_guard lock(mu_);
    const std::uint64_t now = memory_epoch();
    for (auto it = entries_.begin(); it != entries_.end();) {  // entries of an older epoch
      auto next = std::next(it);
      if (it->epoch != now) erase(it);
      it = next;
    }
    entries_.push_front(Entry{std::move(key), plan, epoch, h});
    index_.emplace(h, entries_.begin());
    if (entries_.size() > kEntries) erase(std::prev(entries_.end()));
  }

 private:
  struct Entry {
    CallKey key;
    Plan plan;
    std::uint64_t epoch;
    std::uint64_t hash;
  };
  using Iterator = typename std::list<Entry>::iterator;
  void erase(Iterator e) {
    for (auto [it, end] = index_.equal_range(e->hash); it != end; ++it)
      if (it->second == e) {
        index_.erase(it);
        break;
      }
    entries_.erase(e);
  }
  std::mutex mu_;
  std::list<Entry> entries_;
  std::unordered_multimap<std::uint64_t, Iterator> index_;
};

/// One validated call a caller owns (not shared, not locked: its owner serialises its
/// calls), under the same rules as PlanCache: used only with the cache enabled and in the
/// epoch it was validated in. A new key replaces the old call.
template <class Plan>
class OwnedPlan {
 public:
  /// Returns the plan when `key` is the owned call's (and it is still valid).
  std::optional<Plan> find(const CallKey& key) const {
    if (!plan_cache_enabled() || !key_ || epoch_ != memory_epoch() || !(*key_ == key))
      return std::nullopt;
    return plan_;
  }
  /// Records a call that passed every check, under the epoch read before its checks.
  void insert(CallKey key, const Plan& plan, std::uint64_t epoch) {
    if (!plan_cache_enabled()) return;
    key_.emplace(std::move(key));
    plan_ = plan;
    epoch_ = epoch;
  }

 private:
  std::optional<CallKey> key_;
  Plan plan_{};
  std::uint64_t epoch_ = 0;
};

/// Makes the entry point of kind Plan called on this thread while alive use `owned`
/// instead of the shared cache: how a caller hands its own plan through a device's
/// entry point (a device validates on its caller's thread). Nests; not movable.
template <class Plan>
class ScopedOwnedPlan {
 public:
  explicit ScopedOwnedPlan(OwnedPlan<Plan>& owned) : saved_(current) { current = &owned; }
  ~ScopedOwnedPlan() { current = saved_; }
  ScopedOwnedPlan(const ScopedOwnedPlan&) = delete;
  ScopedOwnedPlan& operator=(const ScopedOwnedPlan&) = delete;
  /// The owned plan in force on this thread, or null (the shared cache).
  static OwnedPlan<Plan>* in_force() noexcept { return current; }

 private:
  static inline thread_local OwnedPlan<Plan>* current = nullptr;
  OwnedPlan<Plan>* saved_;
};

}  // namespace stepcore::gpu::detail
