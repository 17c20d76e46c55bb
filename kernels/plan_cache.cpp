// The memory epoch and the switch of the validated-call cache (kernels/plan_cache.hpp).
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

}  // namespace

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

}  // namespace stepcore::gpu::testing
