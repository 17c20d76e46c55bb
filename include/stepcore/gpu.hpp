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
/// Tensors and blocks one launch carries in its by-value kernel argument.
inline constexpr int kMaxTensorsPerLaunch = 64;
inline constexpr int kMaxBlocksPerLaunch = 256;

/// One block's work: elements [begin, end) of tensor `tensor` of its launch.
struct BlockTask {
  std::uint16_t tensor;
  std::uint64_t begin;
  std::uint64_t end;
};

/// The kernel argument of one launch: tensors (device pointers) and block tasks, by
/// value. Plain data: built on the host, copied into the launch's parameter space.
struct LaunchArgs {
  void* data[kMaxTensorsPerLaunch];
  const void* src[kMaxTensorsPerLaunch];  ///< second operand (accumulate's source)
  DType dtype[kMaxTensorsPerLaunch];
  DType src_dtype[kMaxTensorsPerLaunch];
  BlockTask tasks[kMaxBlocksPerLaunch];
  int num_tensors;
  int num_blocks;
  std::uint32_t first_block;  ///< index of tasks[0] among all blocks of the plan
};

/// Tensors of one AdamW launch (fewer than kMaxTensorsPerLaunch: the per-tensor
/// scalars travel in the kernel argument too; CUDA 12.1+ allows 32 KiB of them).
inline constexpr int kMaxAdamWTensorsPerLaunch = 32;
inline constexpr int kMaxAdamWBlocksPerLaunch = 128;

/// The kernel argument of one AdamW launch: per-tensor pointers and host-prepared
/// scalars, and the block tasks.
struct AdamWLaunchArgs {
  float* param[kMaxAdamWTensorsPerLaunch];
  float* exp_avg[kMaxAdamWTensorsPerLaunch];
  float* exp_avg_sq[kMaxAdamWTensorsPerLaunch];
  const void* grad[kMaxAdamWTensorsPerLaunch];
  void* out[kMaxAdamWTensorsPerLaunch];
  DType grad_dtype[kMaxAdamWTensorsPerLaunch];
  std::int8_t out_kind[kMaxAdamWTensorsPerLaunch];  ///< 0: no compute copy, else 1 + DType
  AdamWScalars scalars[kMaxAdamWTensorsPerLaunch];
  std::uint64_t tail_begin[kMaxAdamWTensorsPerLaunch];
  BlockTask tasks[kMaxAdamWBlocksPerLaunch];
  int num_tensors;
  int num_blocks;
  bool torch;
};

/// Returns the AdamW launches for `tensors` (validated like reference::adamw_step; the
/// step counters are incremented and the scalars prepared here, on the host).
std::vector<AdamWLaunchArgs> make_adamw_plan(std::span<const AdamWTensor> tensors,
                                             const AdamWConfig& config,
                                             int max_blocks = kMaxAdamWBlocksPerLaunch,
                                             int max_tensors = kMaxAdamWTensorsPerLaunch);

/// The kernel argument of one SignSGD launch.
struct SignSgdLaunchArgs {
  float* param[kMaxAdamWTensorsPerLaunch];
  const void* grad[kMaxAdamWTensorsPerLaunch];
  void* out[kMaxAdamWTensorsPerLaunch];
  DType grad_dtype[kMaxAdamWTensorsPerLaunch];
  std::int8_t out_kind[kMaxAdamWTensorsPerLaunch];
  BlockTask tasks[kMaxAdamWBlocksPerLaunch];
  SignSgdScalars scalars;
  int num_tensors;
  int num_blocks;
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

/// AdamW on device tensors (step counters in host memory, incremented on the host) with
/// the gradient read lazily as R_T(R_T(g * *d_scale) * *d_clip): bit-identical to scaling
/// and clipping in place first (docs/numerics.md section 3) and to the CPU engine.
/// *d_found_inf != 0 (device memory, optional) makes the kernels write nothing — but
/// the host has already advanced the step counters: callers skip the call instead when
/// the flag is known on the host. Never allocates, never synchronises.
void adamw_step(std::span<const AdamWTensor> d_tensors, const AdamWConfig& config,
                const float* d_scale, const float* d_clip, const std::int32_t* d_found_inf,
                cudaStream_t stream);

/// SignSGD on device tensors; *d_found_inf != 0 (device memory, optional) writes nothing.
void sign_sgd_step(std::span<const SignSgdTensor> d_tensors, const SignSgdConfig& config,
                   const std::int32_t* d_found_inf, cudaStream_t stream);

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

/// The limits in force on this thread: {max_blocks, max_tensors}, scaled for AdamW-like
/// launches by `adamw` (their compile-time limits are smaller).
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

/// Runs AdamW launches on host memory with the lazy gradient read R_T(R_T(g*scale)*clip);
/// when *found_inf != 0 nothing is written (the flag, scale and clip live in device
/// memory on the GPU).
void adamw(const std::vector<AdamWLaunchArgs>& launches, const float* scale, const float* clip,
           const std::int32_t* found_inf, int threads = kBlockThreads);

/// Runs SignSGD launches on host memory; *found_inf != 0 writes nothing.
void sign_sgd(const std::vector<SignSgdLaunchArgs>& launches, const std::int32_t* found_inf,
              int threads = kBlockThreads);

/// Runs an accumulate plan (tensors: f32 accumulators; sources: f32/bf16/f16) on host
/// memory: acc = acc + f32(src), or a copy when `copy`.
void accumulate(const LaunchPlan& plan, bool copy, int threads = kBlockThreads);

}  // namespace emulate

}  // namespace stepcore::gpu
