// GPU kernels' public API (no CUDA headers): multi-tensor launch plans as plain data,
// the fused scale + norm-partial kernel, and a CPU executor that runs the same plans
// through the same __host__ __device__ block bodies, so kernel logic is tested on
// machines without a GPU.
//
// A step on the device, with no host synchronisation (every scalar in device memory):
//   scale_and_norm_partial -> [all-reduce the partial] -> finalize_and_clip ->
//   exact_norm_partial_if_needed -> [all-reduce] -> finalize_exact_and_clip ->
//   adamw_step / sign_sgd_step (lazy clip on read, skipped on found-inf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "stepcore/config.hpp"
#include "stepcore/cuda.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::gpu {

/// Elements of one tensor handled by one thread block: a compile-time constant shared
/// by every kernel, never derived from the device (so results and partials do not
/// depend on the GPU model).
inline constexpr std::size_t kChunkElements = std::size_t{1} << 16;
/// Values of the device found-inf flag finalize_and_clip writes.
inline constexpr std::int32_t kFoundInfNone = 0;       ///< finite norm, clip set
inline constexpr std::int32_t kFoundInfNonFinite = 1;  ///< NaN/Inf seen or norm overflow
inline constexpr std::int32_t kFoundInfNeedsExact =
    2;  ///< uncertified rounding: run the exact pass
/// Threads per block of every multi-tensor kernel.
inline constexpr int kBlockThreads = 256;
/// Tensors and blocks one launch carries in its by-value kernel argument. A launch's
/// blocks are described per tensor (a BlockMap), so the block count costs no argument
/// space: a launch fills the GPU (1 GiB of bf16 is 8,192 blocks in one launch).
inline constexpr int kMaxTensorsPerLaunch = 64;
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
/// last covers exactly kChunkElements elements.
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
    const std::uint64_t begin = (first_chunk[lo] + (b - start)) * kChunkElements;
    const std::uint64_t end =
        begin + kChunkElements < numel[lo] ? begin + kChunkElements : numel[lo];
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

/// Tensors of one AdamW launch (fewer than kMaxTensorsPerLaunch: five pointers each).
inline constexpr int kMaxAdamWTensorsPerLaunch = 32;
inline constexpr int kMaxAdamWBlocksPerLaunch = 1 << 16;

/// The kernel argument of one AdamW launch: per-tensor pointers, the configuration's
/// constants and the blocks. The per-step scalars are not here: each block derives them
/// from device memory when it runs (its step counter, the bias table, lr and weight
/// decay), so a replayed graph takes the step it is at, never the one it was captured at.
struct AdamWLaunchArgs {
  float* param[kMaxAdamWTensorsPerLaunch];
  float* exp_avg[kMaxAdamWTensorsPerLaunch];
  float* exp_avg_sq[kMaxAdamWTensorsPerLaunch];
  const void* grad[kMaxAdamWTensorsPerLaunch];
  void* out[kMaxAdamWTensorsPerLaunch];
  const float* step[kMaxAdamWTensorsPerLaunch];  ///< the counter before this step (device)
  DType grad_dtype[kMaxAdamWTensorsPerLaunch];
  std::int8_t out_kind[kMaxAdamWTensorsPerLaunch];  ///< 0: no compute copy, else 1 + DType
  std::uint64_t tail_begin[kMaxAdamWTensorsPerLaunch];
  BlockMap<kMaxAdamWTensorsPerLaunch> map;
  AdamWConfig config;  ///< betas, eps, formula; lr and weight decay unless from device memory
  int num_tensors;
  int num_blocks;
  STEPCORE_HD_INLINE BlockTask task(int b) const {
    return map.task(static_cast<std::uint32_t>(b), num_tensors);
  }
};

/// Step counters one counter launch advances (one thread each).
inline constexpr int kMaxCountersPerLaunch = 128;

/// The kernel argument of one step-counter launch: counter k becomes counter k + 1
/// unless the step was skipped (found-inf). It runs after every AdamW launch of the step
/// has read the counters.
struct StepCounterArgs {
  float* step[kMaxCountersPerLaunch];
  int count;
};

/// An AdamW step's launches: the updates, then the counter advances.
struct AdamWPlan {
  std::vector<AdamWLaunchArgs> launches;
  std::vector<StepCounterArgs> counters;
};

/// Returns the AdamW plan for `tensors` (validated like reference::adamw_step, except
/// that step counters are device memory, so their values are not read here). Nothing is
/// prepared from the step: the plan is the same for every step of these tensors.
AdamWPlan make_adamw_plan(std::span<const AdamWTensor> tensors, const AdamWConfig& config,
                          int max_blocks = kMaxAdamWBlocksPerLaunch,
                          int max_tensors = kMaxAdamWTensorsPerLaunch);

/// Most steps a bias table covers: beyond its last entry 1 - beta^t rounds to 1 exactly.
inline constexpr std::uint32_t kMaxBiasTableSteps = std::uint32_t{1} << 22;

/// Returns the bias table of `config`'s betas, for device memory (AdamWDeviceArgs):
/// {len1, len2, 1 - beta1^1 .. 1 - beta1^len1, 1 - beta2^1 .. 1 - beta2^len2} in binary64,
/// each exactly prepare_adamw_scalars' value (the host's pow), where len is the first t
/// at which 1 - beta^t rounds to 1 (so every later step's correction is exactly 1).
/// Throws Errc::not_supported naming "config.beta1"/"config.beta2" when a beta is so
/// close to 1 that this takes more than kMaxBiasTableSteps steps (1 - beta < ~8.6e-6).
std::vector<double> make_adamw_bias_table(const AdamWConfig& config);

/// The kernel argument of one SignSGD launch.
struct SignSgdLaunchArgs {
  float* param[kMaxAdamWTensorsPerLaunch];
  const void* grad[kMaxAdamWTensorsPerLaunch];
  void* out[kMaxAdamWTensorsPerLaunch];
  DType grad_dtype[kMaxAdamWTensorsPerLaunch];
  std::int8_t out_kind[kMaxAdamWTensorsPerLaunch];
  BlockMap<kMaxAdamWTensorsPerLaunch> map;
  double lr;            ///< the config's, unless read from device memory
  double weight_decay;  ///< the config's, unless read from device memory
  int num_tensors;
  int num_blocks;
  STEPCORE_HD_INLINE BlockTask task(int b) const {
    return map.task(static_cast<std::uint32_t>(b), num_tensors);
  }
};

/// Returns the SignSGD launches (validated like reference::sign_sgd_step with a
/// positive read; the read does not change a sign and is not applied).
std::vector<SignSgdLaunchArgs> make_sign_sgd_plan(std::span<const SignSgdTensor> tensors,
                                                  const SignSgdConfig& config,
                                                  int max_blocks = kMaxAdamWBlocksPerLaunch,
                                                  int max_tensors = kMaxAdamWTensorsPerLaunch);

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

/// Returns the workspace bytes scale_and_norm_partial needs for these tensors.
std::size_t scale_and_norm_workspace_bytes(std::span<const TensorView> tensors);

/// Fused pass over device tensors: g = R_T(f32(g) * scale) in place (skipped when
/// scale == 1), the approximate norm partial of the stored values and the
/// non-finite counts written to *d_partial (device memory). Reads and writes each
/// element once. Never allocates, never synchronises; capturable in a CUDA graph.
/// Determinism: the finalized norm equals reference::norm_partial of the scaled
/// values on the host, bit for bit, for any launch shape (docs/numerics.md 6.3).
void scale_and_norm_partial(std::span<const TensorView> d_tensors, float scale,
                            NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                            cudaStream_t stream);

/// Norm partial of device tensors read as R_T(R_T(g*scale)*clip), nothing written;
/// same workspace as scale_and_norm_partial. Same determinism contract.
void norm_partial(std::span<const ConstTensorView> d_tensors, GradientRead read,
                  NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                  cudaStream_t stream);

/// In place g = R_T(f32(g) * *d_factor) with the factor in device memory (the clip
/// coefficient, applied eagerly); capturable in a graph.
void scale_by_device_scalar(std::span<const TensorView> d_tensors, const float* d_factor,
                            cudaStream_t stream);

/// acc = acc + f32(src) (or a copy) on device tensors.
void accumulate(std::span<const AccumulatePair> d_pairs, cudaStream_t stream);

/// Finalises a (reduced) norm partial on the device and derives the step's clip
/// coefficient, without a host round trip: *d_result = finalize(*d_partial);
/// *d_found_inf = 1 when the norm is not finite (NaN/Inf values or overflow), else 0;
/// *d_clip = clip_coefficient(norm, max_norm) when the norm is certified and finite,
/// else 0 (callers skip the step on found-inf). When d_result->needs_exact (a rounding
/// tie or near-tie, ~1 in 2^16 norms) *d_found_inf is kFoundInfNeedsExact: run
/// exact_norm_partial_if_needed and finalize_exact_and_clip next (always enqueue them;
/// they do nothing otherwise). All pointers device memory. Determinism: the same bits
/// as stepcore::finalize and clip_coefficient on the host.
void finalize_and_clip(const NormPartial* d_partial, float max_norm, NormResult* d_result,
                       float* d_clip, std::int32_t* d_found_inf, cudaStream_t stream);

/// The exact fallback, pass 1: when *d_found_inf == kFoundInfNeedsExact, writes the
/// exact partial (integer deposits of every square, approximate = 0) of the values read
/// as R_T(R_T(g*scale)*clip) to *d_exact_partial; otherwise writes a zero partial (so an
/// all-reduce of it across ranks, which every rank enqueues, stays harmless). Same
/// workspace as scale_and_norm_partial; reads each element once when needed, nothing
/// otherwise. Never allocates, never synchronises; capturable. Determinism: equal to
/// reference::norm_partial digit for digit, for any launch shape.
void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors, GradientRead read,
                                  const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                  void* d_workspace, std::size_t workspace_bytes,
                                  cudaStream_t stream);

/// The exact fallback, pass 2: when *d_found_inf == kFoundInfNeedsExact, finalises the
/// (reduced) exact partial into *d_result, *d_clip and *d_found_inf as finalize_and_clip
/// does; otherwise leaves all three unchanged. Capturable, no host synchronisation.
void finalize_exact_and_clip(const NormPartial* d_exact_partial, float max_norm,
                             NormResult* d_result, float* d_clip, std::int32_t* d_found_inf,
                             cudaStream_t stream);

/// AdamW on device tensors with the gradient read lazily as R_T(R_T(g * *d.scale) *
/// *d.clip): bit-identical to scaling and clipping in place first (docs/numerics.md
/// section 3) and to the CPU engine. Step counters, lr and weight decay (d.hyper), the
/// bias corrections (d.bias_table) and the found-inf flag are device memory, read when
/// the kernels run: a captured graph replays the next step with the current lr, and
/// *d.found_inf != 0 leaves parameters, moments and counters untouched (no rollback).
/// Never allocates, never synchronises.
void adamw_step(std::span<const AdamWTensor> d_tensors, const AdamWConfig& config,
                const AdamWDeviceArgs& d, cudaStream_t stream);

/// SignSGD on device tensors; lr and weight decay from d.hyper when given, read when the
/// kernels run; *d.found_inf != 0 (optional) writes nothing.
void sign_sgd_step(std::span<const SignSgdTensor> d_tensors, const SignSgdConfig& config,
                   const SignSgdDeviceArgs& d, cudaStream_t stream);

namespace detail {

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

/// The limits in force on this thread: {max_blocks, max_tensors}, capped for AdamW-like
/// launches by `adamw` (their compile-time tensor limit is smaller).
struct LaunchLimits {
  int max_blocks;
  int max_tensors;
};
LaunchLimits launch_limits(bool adamw);

}  // namespace detail

namespace emulate {

/// Runs the scale_and_norm_partial plan on host memory through the kernels' block
/// bodies, with `threads` emulated threads per block; returns the partial. The same
/// code the device runs, except for the thread scheduling.
NormPartial scale_and_norm_partial(const LaunchPlan& plan, float scale,
                                   int threads = kBlockThreads);

/// Returns the norm partial of the read values R_T(R_T(g*scale)*clip) without writing.
NormPartial norm_partial(const LaunchPlan& plan, GradientRead read, int threads = kBlockThreads);

/// g = R_T(f32(g) * factor) in place (the clip applied eagerly).
void scale(const LaunchPlan& plan, float factor, int threads = kBlockThreads);

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

/// Runs an AdamW plan on host memory (every pointer of `d` host memory standing for
/// device memory): the updates, then the counter advances, as the device runs them.
void adamw(const AdamWPlan& plan, const AdamWDeviceArgs& d, int threads = kBlockThreads);

/// Runs SignSGD launches on host memory; *d.found_inf != 0 writes nothing.
void sign_sgd(const std::vector<SignSgdLaunchArgs>& launches, const SignSgdDeviceArgs& d,
              int threads = kBlockThreads);

/// Runs an accumulate plan (tensors: f32 accumulators; sources: f32/bf16/f16) on host
/// memory: acc = acc + f32(src), or a copy when `copy`.
void accumulate(const LaunchPlan& plan, bool copy, int threads = kBlockThreads);

}  // namespace emulate

}  // namespace stepcore::gpu
