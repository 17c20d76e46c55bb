// The multi-tensor kernels' launch plans (internal): plain-data kernel arguments built
// on the host, the plan builders, the per-thread launch limits, and the CPU executor
// (gpu::emulate) that runs a plan through the same __host__ __device__ block bodies as
// the CUDA kernels, so every CPU-only test runs the kernels' own logic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/optimizers/all.hpp"
#include "stepcore/config.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::gpu {

/// Threads per block of every multi-tensor kernel.
inline constexpr int kBlockThreads = 256;

/// The exact reduction of a norm's block partials runs one block per partial field and
/// slice: more than kPartialsPerSlice block partials are reduced in slices of
/// consecutive partials first (at most kMaxReduceSlices, so 24 x slices blocks fill the
/// GPU), then the slices' partials in one more pass. Integer sums, max and or: the same
/// bits for any slicing. The slices grow past kPartialsPerSlice partials each once the
/// slice count is at its cap (beyond 2^18 blocks), so every partial is read whatever the
/// count; the workspace holds at most kMaxReduceSlices slice partials.
inline constexpr std::uint64_t kPartialsPerSlice = 2048;
inline constexpr std::uint64_t kMaxReduceSlices = 128;

/// The first reduction pass over a number of block partials: `slices` slices of
/// `per_slice` consecutive partials, the last one possibly shorter; slices == 1: the
/// partials are reduced in one pass (per_slice = their count).
struct ReducePlan {
  std::uint64_t per_slice;
  std::uint32_t slices;
};

/// Returns the reduction plan of `blocks` partials (blocks <= 2^32): one pass up to
/// `min_per_slice`, else ceil(blocks / per_slice) slices of per_slice =
/// max(min_per_slice, ceil(blocks / max_slices)) partials, so 2 <= slices <= max_slices
/// and (slices - 1) * per_slice < blocks <= slices * per_slice. The limits are
/// parameters only for the executor's test hook (testing::ScopedReduceSlicing); the
/// CUDA launchers use the constants. Requires min_per_slice >= 1, max_slices >= 2.
STEPCORE_HD_INLINE ReducePlan reduce_plan(std::uint64_t blocks,
                                          std::uint64_t min_per_slice = kPartialsPerSlice,
                                          std::uint64_t max_slices = kMaxReduceSlices) {
  if (blocks <= min_per_slice) return ReducePlan{blocks, 1};
  std::uint64_t per = (blocks + max_slices - 1) / max_slices;
  if (per < min_per_slice) per = min_per_slice;
  return ReducePlan{per, static_cast<std::uint32_t>((blocks + per - 1) / per)};
}

/// Partials [begin, end) of a reduction pass: those of slice s of a pass over `blocks`
/// partials in slices of `per_slice` (slice s < the plan's slices: never empty). The one
/// definition of the slices, read by the CUDA reduction kernel and the executor.
struct SliceBounds {
  std::uint64_t begin;
  std::uint64_t end;
};
STEPCORE_HD_INLINE SliceBounds slice_bounds(std::uint64_t blocks, std::uint64_t per_slice,
                                            std::uint32_t s) {
  const std::uint64_t begin = s * per_slice;
  if (begin >= blocks) return SliceBounds{blocks, blocks};
  return SliceBounds{begin, blocks - begin < per_slice ? blocks : begin + per_slice};
}

/// Returns the slices of the first reduction pass over `blocks` partials (1: one pass).
inline std::uint32_t reduce_slices(std::uint64_t blocks) { return reduce_plan(blocks).slices; }

/// Tensors and blocks one launch carries in its by-value kernel argument. A launch's
/// blocks are described per tensor (a BlockMap), so the block count costs no argument
/// space: a launch fills the GPU (1 GiB of bf16 is 8,192 blocks in one launch). 256
/// tensors (~10 KB of argument: CUDA 12.1's large kernel parameters, up to 32,764 bytes
/// on sm_70 and later) let a list of small tensors, one block each, fill 132 SMs.
inline constexpr int kMaxTensorsPerLaunch = 256;
/// The most bytes of a kernel argument (CUDA 12.1+, sm_70+).
inline constexpr std::size_t kMaxKernelArgumentBytes = 32764;
inline constexpr int kMaxBlocksPerLaunch = 1 << 16;
/// Bytes one thread loads at once where the tensors are aligned to it (the executor
/// runs the same grouping, so the bits it tests are the device's).
inline constexpr int kVectorBytes = 16;

/// One block's work: elements [begin, end) of tensor `tensor` of its launch.
struct BlockTask {
  std::uint16_t tensor;
  std::uint64_t begin;
  std::uint64_t end;
};

/// The blocks of one launch, per tensor slot: slot s owns blocks [start(s), block_end[s])
/// (start(0) = 0, start(s) = block_end[s - 1]); its j-th block covers chunk
/// first_chunk[s] + j of a tensor of numel[s] elements. Every block but a tensor's
/// last covers exactly kBlockElements elements.
template <int N>
struct BlockMap {
  std::uint64_t numel[N];
  std::uint64_t first_chunk[N];
  std::uint32_t block_end[N];

  /// Returns block b's task; b < block_end[num_tensors - 1].
  STEPCORE_HD_INLINE BlockTask task(std::uint32_t b, int num_tensors) const {
    int lo = 0, hi = num_tensors - 1;  // the first slot whose block_end exceeds b
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (block_end[mid] > b)
        hi = mid;
      else
        lo = mid + 1;
    }
    const std::uint32_t start = lo == 0 ? 0u : block_end[lo - 1];
    const std::uint64_t begin = (first_chunk[lo] + (b - start)) * kBlockElements;
    const std::uint64_t end =
        begin + kBlockElements < numel[lo] ? begin + kBlockElements : numel[lo];
    return BlockTask{static_cast<std::uint16_t>(lo), begin, end};
  }
};

/// The kernel argument of one launch: tensors (device pointers) and their blocks, by
/// value. Plain data: built on the host, copied into the launch's parameter space.
struct LaunchArgs {
  void* data[kMaxTensorsPerLaunch];
  const void* src[kMaxTensorsPerLaunch];  ///< second operand (accumulate's source)
  DType dtype[kMaxTensorsPerLaunch];
  DType src_dtype[kMaxTensorsPerLaunch];
  BlockMap<kMaxTensorsPerLaunch> map;
  int num_tensors;
  int num_blocks;
  std::uint32_t first_block;  ///< index of this launch's block 0 among all blocks of the plan
  STEPCORE_HD_INLINE BlockTask task(int b) const {
    return map.task(static_cast<std::uint32_t>(b), num_tensors);
  }
};

/// Tensors of one optimizer launch: fewer than kMaxTensorsPerLaunch, since each carries
/// up to eleven pointers (~15 KB of argument with three state slots).
inline constexpr int kMaxOptimizerTensorsPerLaunch = 128;
inline constexpr int kMaxOptimizerBlocksPerLaunch = 1 << 16;

/// The kernel argument of one launch of optimizer unit Opt (core/optimizers/unit.hpp):
/// per-tensor pointers, the configuration and the blocks. Array 0 is the parameter,
/// array 1 + s the state slot s; the old values are loaded from src (the destinations
/// themselves when the tensor steps in place) and the new ones stored to dst. The
/// per-step scalars are not here: each block derives them when it runs, with the unit's
/// step_scalars, from device memory (its step counter, lr and weight decay, the unit's
/// table), so a replayed graph takes the step it is at, never the one it was captured at.
/// The 8-bit slots of a launch's tensors (units that take them; docs/numerics.md 8f):
/// codes and block maxima of slot s of tensor t, null where the tensor's slots are f32.
template <class Opt, bool = ::stepcore::detail::unit_takes_q8<Opt>()>
struct Q8LaunchSlots {
  STEPCORE_HD_INLINE bool q8(int) const { return false; }
};
template <class Opt>
struct Q8LaunchSlots<Opt, true> {
  std::uint8_t* codes[Opt::kSlots][kMaxOptimizerTensorsPerLaunch];
  float* absmax[Opt::kSlots][kMaxOptimizerTensorsPerLaunch];
  /// Whether tensor t's slots are 8-bit (validation: all of its used slots or none).
  STEPCORE_HD_INLINE bool q8(int t) const { return codes[0][t] != nullptr; }
};

template <class Opt>
struct OptimizerLaunchArgs : Q8LaunchSlots<Opt> {
  static constexpr int kArrays = 1 + Opt::kSlots;
  float* dst[kArrays][kMaxOptimizerTensorsPerLaunch];
  const float* src[kArrays][kMaxOptimizerTensorsPerLaunch];
  const void* grad[kMaxOptimizerTensorsPerLaunch];
  void* out[kMaxOptimizerTensorsPerLaunch];
  const float* step[kMaxOptimizerTensorsPerLaunch];  ///< the counter before this step (device)
  DType grad_dtype[kMaxOptimizerTensorsPerLaunch];
  std::int8_t out_kind[kMaxOptimizerTensorsPerLaunch];  ///< 0: no compute copy, else 1 + DType
  BlockMap<kMaxOptimizerTensorsPerLaunch> map;
  typename Opt::Config config;  ///< lr and weight decay used unless from device memory
  int num_tensors;
  int num_blocks;
  STEPCORE_HD_INLINE BlockTask task(int b) const {
    return map.task(static_cast<std::uint32_t>(b), num_tensors);
  }
};

/// Step counters one counter launch advances (one thread each).
inline constexpr int kMaxCountersPerLaunch = 128;

/// The kernel argument of one step-counter launch: counter k becomes counter k + 1
/// unless the step was skipped (found-inf). It runs after every update launch of the
/// step has read the counters.
struct StepCounterArgs {
  float* step[kMaxCountersPerLaunch];
  int count;
};

/// One step of unit Opt: the update launches, then (units that count steps) the counter
/// advances. Nothing in it depends on the step: the same plan runs every step.
template <class Opt>
struct OptimizerPlan {
  std::vector<OptimizerLaunchArgs<Opt>> launches;
  std::vector<StepCounterArgs> counters;
};

/// Returns the plan of unit Opt for `tensors`, validated by validate_unit with the step
/// counters unread (device memory: only their pointers are checked). Instantiated for
/// every unit of AllUnits (launch_plan.cpp).
template <class Opt>
OptimizerPlan<Opt> make_optimizer_plan(std::span<const OptimizerTensor> tensors,
                                       const typename Opt::Config& config,
                                       int max_blocks = kMaxOptimizerBlocksPerLaunch,
                                       int max_tensors = kMaxOptimizerTensorsPerLaunch);

/// Every kernel's parameters (its launch argument, its device arguments and a few
/// scalars, by value) fit CUDA 12.1's parameter space (the build requires 12.1).
static_assert(sizeof(LaunchArgs) + 512 <= kMaxKernelArgumentBytes);
template <class... Units>
constexpr bool optimizer_arguments_fit(::stepcore::detail::UnitList<Units...>) {
  return ((sizeof(OptimizerLaunchArgs<Units>) + sizeof(OptimizerDeviceArgs) + 512 <=
           kMaxKernelArgumentBytes) &&
          ...);
}
static_assert(optimizer_arguments_fit(::stepcore::detail::AllUnits{}));

/// A multi-tensor launch plan: every element of every tensor covered exactly once, in
/// tensor order then chunk order; empty tensors get no block.
struct LaunchPlan {
  std::vector<LaunchArgs> launches;
  std::uint32_t total_blocks = 0;
};

/// Returns the plan for `tensors` (with optional second operands `sources`, same
/// length, for two-operand kernels). `max_blocks` and `max_tensors` may be lowered
/// (tests use this to get many launches) but not raised above the compile-time limits.
LaunchPlan make_plan(std::span<const TensorView> tensors,
                     std::span<const ConstTensorView> sources = {},
                     int max_blocks = kMaxBlocksPerLaunch, int max_tensors = kMaxTensorsPerLaunch);

namespace detail {

/// The limits in force on this thread: {max_blocks, max_tensors}, capped for optimizer
/// launches (`optimizer`: their compile-time tensor limit is smaller).
struct LaunchLimits {
  int max_blocks;
  int max_tensors;
};
LaunchLimits launch_limits(bool optimizer);

}  // namespace detail

namespace emulate {

/// Runs the scale_and_norm_partial plan on host memory through the kernels' block
/// bodies, with `threads` emulated threads per block; returns the partial. The same
/// code the device runs, except for the thread scheduling.
NormPartial scale_and_norm_partial(const LaunchPlan& plan, float scale,
                                   int threads = kBlockThreads);

/// Returns the norm partial of the read values R_T(R_T(g*scale)*clip) without writing.
NormPartial norm_partial(const LaunchPlan& plan, GradientRead read, int threads = kBlockThreads);

/// The device-memory forms (the kernels' own arguments): the scale (and clip) read from
/// host memory standing for device memory when the plan runs, not checked, as the device
/// reads them. A plan and these arguments built once and run again replay a captured graph.
NormPartial scale_and_norm_partial(const LaunchPlan& plan, const float* d_scale,
                                   int threads = kBlockThreads);
NormPartial norm_partial(const LaunchPlan& plan, const DeviceGradientRead& d_read,
                         int threads = kBlockThreads);
NormPartial exact_norm_partial_if_needed(const LaunchPlan& plan, const DeviceGradientRead& d_read,
                                         std::int32_t found_inf, int threads = kBlockThreads);

/// g = R_T(f32(g) * factor) in place (the clip applied eagerly).
void scale_(const LaunchPlan& plan, float factor, int threads = kBlockThreads);

/// The host twin of gpu::finalize_and_clip (same __host__ __device__ code).
void finalize_and_clip(const NormPartial& partial, float max_norm, NormResult& result, float& clip,
                       std::int32_t& found_inf);

/// The host twin of gpu::exact_norm_partial_if_needed: the exact partial of the read
/// values when found_inf == kFoundInfNeedsExact, else a zero partial.
NormPartial exact_norm_partial_if_needed(const LaunchPlan& plan, GradientRead read,
                                         std::int32_t found_inf, int threads = kBlockThreads);

/// The host twin of gpu::finalize_exact_and_clip.
void finalize_exact_and_clip(const NormPartial& exact_partial, float max_norm, NormResult& result,
                             float& clip, std::int32_t& found_inf);

/// Runs a plan of unit Opt on host memory (every pointer of `d` host memory standing for
/// device memory, read when it runs): the updates, then the counter advances, as the
/// device runs them; *d.found_inf != 0 writes nothing. Instantiated for every unit.
template <class Opt>
void optimizer_step(const OptimizerPlan<Opt>& plan, const OptimizerDeviceArgs& d,
                    int threads = kBlockThreads);

/// Runs an accumulate plan (tensors: f32 accumulators; sources: f32/bf16/f16) on host
/// memory: acc = acc + f32(src), or a copy when `copy`.
void accumulate(const LaunchPlan& plan, bool copy, int threads = kBlockThreads);

}  // namespace emulate
}  // namespace stepcore::gpu
