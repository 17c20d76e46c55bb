// Test hooks of the kernels (internal, not installed): tests run the launchers under
// other launch shapes to show that results do not depend on them, and run every
// conversion on the device to compare its bits with the host's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/plan_cache.hpp"
#include "kernels/plans.hpp"
#include "stepcore/cuda_host.hpp"

namespace stepcore::gpu::testing {

/// Lowers the blocks and tensors per launch of the CUDA entry points on this thread
/// while alive (tests run the device kernels under two launch shapes with it). Results
/// do not depend on it: that is what the tests show.
class ScopedLaunchLimits {
 public:
  ScopedLaunchLimits(int max_blocks, int max_tensors);
  ~ScopedLaunchLimits();
  ScopedLaunchLimits(const ScopedLaunchLimits&) = delete;
  ScopedLaunchLimits& operator=(const ScopedLaunchLimits&) = delete;

 private:
  int saved_blocks_, saved_tensors_;
};

/// Lowers the CPU executor's norm reduction limits on this thread while alive: more than
/// `min_per_slice` block partials are reduced in at most `max_slices` slices (the
/// constants kPartialsPerSlice and kMaxReduceSlices otherwise), so a test reaches many
/// slices, uneven ones and the growth of the slices past their cap with a few blocks.
/// The CUDA launchers keep the constants (their workspace is sized by them).
/// min_per_slice in [1, kPartialsPerSlice], max_slices in [2, kMaxReduceSlices].
class ScopedReduceSlicing {
 public:
  ScopedReduceSlicing(std::uint64_t min_per_slice, std::uint64_t max_slices);
  ~ScopedReduceSlicing();
  ScopedReduceSlicing(const ScopedReduceSlicing&) = delete;
  ScopedReduceSlicing& operator=(const ScopedReduceSlicing&) = delete;

 private:
  std::uint64_t saved_min_per_slice_, saved_max_slices_;
};

/// Turns the cache of validated calls (kernels/plan_cache.hpp) on or off while alive, so
/// that tests see both paths in every build type.
class ScopedPlanCache {
 public:
  explicit ScopedPlanCache(bool enabled);
  ~ScopedPlanCache();
  ScopedPlanCache(const ScopedPlanCache&) = delete;
  ScopedPlanCache& operator=(const ScopedPlanCache&) = delete;

 private:
  bool saved_;
};

/// Calls of one kind of entry point (detail::CallKind) on every thread since the process
/// started: those that reused a validated plan (the shared cache or a caller's own) and
/// those that were validated (a miss, or the cache off).
struct CallCounts {
  std::uint64_t reused = 0;
  std::uint64_t validated = 0;
};
CallCounts call_counts(detail::CallKind kind) noexcept;

}  // namespace stepcore::gpu::testing

namespace stepcore::cuda::testing {

/// Converts every bf16 and f16 bit pattern (65,536 each) to f32, and each of the `n` f32
/// values in `d_f32_in` to bf16 and f16, on the current device. Device buffers:
/// d_bf16_widened and d_f16_widened hold 65,536 floats each, d_bf16_out and d_f16_out
/// hold n uint16. Does not synchronise; throws Errc::not_supported without CUDA.
void convert_all_on_device(float* d_bf16_widened, float* d_f16_widened, const float* d_f32_in,
                           std::uint16_t* d_bf16_out, std::uint16_t* d_f16_out, std::size_t n,
                           cudaStream_t stream);

}  // namespace stepcore::cuda::testing
