// The memory epoch, the switch of the validated-call cache and its call counts
// (kernels/plan_cache.hpp).
#include "kernels/plan_cache.hpp"

#include <atomic>

#include "kernels/testing.hpp"

namespace stepcore::gpu::detail {
namespace {

std::atomic<std::uint64_t> g_epoch{0};
#ifdef NDEBUG
std::atomic<bool> g_enabled{true};
#else
std::atomic<bool> g_enabled{false};  // debug builds check every call
#endif

std::atomic<std::uint64_t> g_calls[kCallKinds][2]{};  // per kind: reused, validated

}  // namespace

void count_call(CallKind kind, bool validated) noexcept {
  g_calls[static_cast<int>(kind)][validated ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t memory_epoch() noexcept { return g_epoch.load(std::memory_order_acquire); }

void note_memory_released() noexcept { g_epoch.fetch_add(1, std::memory_order_acq_rel); }

bool plan_cache_enabled() noexcept { return g_enabled.load(std::memory_order_relaxed); }

bool set_plan_cache_enabled(bool enabled) noexcept {
  note_memory_released();  // either way, the cache starts empty
  return g_enabled.exchange(enabled, std::memory_order_relaxed);
}

}  // namespace stepcore::gpu::detail

namespace stepcore::gpu::testing {

ScopedPlanCache::ScopedPlanCache(bool enabled) : saved_(detail::set_plan_cache_enabled(enabled)) {}
ScopedPlanCache::~ScopedPlanCache() { detail::set_plan_cache_enabled(saved_); }

CallCounts call_counts(detail::CallKind kind) noexcept {
  const auto& c = detail::g_calls[static_cast<int>(kind)];
  return CallCounts{c[0].load(std::memory_order_relaxed), c[1].load(std::memory_order_relaxed)};
}

}  // namespace stepcore::gpu::testing
