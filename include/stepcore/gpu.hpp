// GPU kernels' public API (no CUDA headers): the multi-tensor launchers a trainer calls
// on device tensors, with every per-step scalar in device memory. Their launch plans and
// the CPU executor that runs them through the same __host__ __device__ block bodies are
// internal (kernels/plans.hpp), so kernel logic is tested on machines without a GPU.
//
// A step on the device, with no host synchronisation (every scalar in device memory):
//   scale_and_norm_partial -> [all-reduce the partial] -> finalize_and_clip ->
//   exact_norm_partial_if_needed -> [all-reduce] -> finalize_exact_and_clip ->
//   optimizer_step (lazy clip on read, skipped on found-inf).
// The norm launchers come in two forms: with the scale (and clip) in device memory, read
// when the kernels run (the form of a captured CUDA graph: each replay reads the values
// there), and with host values, which are kernel arguments fixed when enqueued (a graph
// replays them as captured; for eager use).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "stepcore/cuda_host.hpp"
#include "stepcore/determinism.hpp"  // the levels named in "Determinism:" lines
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::gpu {

/// Elements of one tensor handled by one thread block: a compile-time constant shared
/// by every kernel, never derived from the device (so results and partials do not
/// depend on the GPU model).
inline constexpr std::size_t kBlockElements = std::size_t{1} << 16;
/// Values of the device found-inf flag finalize_and_clip writes.
inline constexpr std::int32_t kFoundInfNone = 0;       ///< finite norm, clip set
inline constexpr std::int32_t kFoundInfNonFinite = 1;  ///< NaN/Inf seen or norm overflow
inline constexpr std::int32_t kFoundInfNeedsExact =
    2;  ///< uncertified rounding: run the exact pass
/// Most steps an optimizer table covers (make_optimizer_table): beyond its last entries
/// every value is the limit (for a bias correction 1 - beta^t, exactly 1).
inline constexpr std::uint32_t kMaxBiasTableSteps = std::uint32_t{1} << 22;

/// Returns the optimizer's table for device memory (OptimizerDeviceArgs::table): the
/// binary64 values of each step the device cannot compute bit-exactly (pow), each
/// exactly the host step's value, one column per value: {len_0 .. len_{K-1}, column 0's
/// entries for steps 1 .. len_0, column 1's, ...}, where column k stops before the first
/// step whose value is its limit (every later step has that value too; AdamW and Adam:
/// the bias corrections 1 - beta1^t and 1 - beta2^t, limit 1). Empty for an optimizer
/// that needs none (SGD, Adagrad, SignSGD). Validates the configuration (errors name
/// "config.<field>"); throws Errc::not_supported naming the column's hyper-parameter
/// ("config.beta2") when a column would pass kMaxBiasTableSteps steps (1 - beta < ~8.6e-6).
std::vector<double> make_optimizer_table(const OptimizerConfig& config);

/// Returns the words optimizer_step reads to dequantize and requantize block-wise 8-bit
/// state slots (OptimizerTensor::q8, docs/numerics.md 8f): both maps under both rounding
/// rules with their code tables, the same for every configuration (about 100 KB). Copy it
/// to device memory once and pass it as OptimizerDeviceArgs::q8_codebooks.
std::vector<std::uint32_t> q8_codebooks();

/// Returns the workspace bytes scale_and_norm_partial needs for these tensors.
std::size_t scale_and_norm_workspace_bytes(std::span<const TensorView> tensors);

/// Fused pass over device tensors: g = R_T(f32(g) * scale) in place (skipped when
/// scale == 1), the approximate norm partial of the stored values and the
/// non-finite counts written to *d_partial (device memory). Reads and writes each
/// element once. Never allocates, never synchronises; capturable in a CUDA graph.
/// Determinism: bitwise for the stored values and the finalised norm (equal to
/// reference::norm_partial of the scaled values, for any launch shape: docs/numerics.md
/// 6.3); the partial itself is run_to_run.
void scale_and_norm_partial(std::span<const TensorView> d_tensors, float scale,
                            NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                            cudaStream_t stream);

/// As above with the scale an f32 in device memory (d_scale, not null), read when the
/// kernels run (unchecked: it is not on the host), so a replayed graph scales by the value
/// there at replay. Same bits as the host-value form with that value.
void scale_and_norm_partial(std::span<const TensorView> d_tensors, const float* d_scale,
                            NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                            cudaStream_t stream);

/// Norm partial of device tensors read as R_T(R_T(g*scale)*clip), nothing written;
/// same workspace as scale_and_norm_partial. Determinism: as scale_and_norm_partial.
void norm_partial(std::span<const ConstTensorView> d_tensors, GradientRead read,
                  NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                  cudaStream_t stream);

/// As above with scale and clip in device memory (d_read), read when the kernels run.
void norm_partial(std::span<const ConstTensorView> d_tensors, const DeviceGradientRead& d_read,
                  NormPartial* d_partial, void* d_workspace, std::size_t workspace_bytes,
                  cudaStream_t stream);

/// In place g = R_T(f32(g) * *d_factor) with the factor in device memory (the clip
/// coefficient, applied eagerly); capturable in a graph. Determinism: bitwise.
void scale_(std::span<const TensorView> d_tensors, const float* d_factor, cudaStream_t stream);

/// acc = acc + f32(src) (or a copy) on device tensors. Determinism: bitwise.
void accumulate(std::span<const AccumulatePair> d_pairs, cudaStream_t stream);

/// Finalises a (reduced) norm partial on the device and derives the step's clip
/// coefficient, without a host round trip: *d_result = finalize(*d_partial);
/// *d_found_inf = 1 when the norm is not finite (NaN/Inf values or overflow), else 0;
/// *d_clip = clip_coefficient(norm, max_norm) when the norm is certified and finite,
/// else 0 (callers skip the step on found-inf). When d_result->needs_exact (a rounding
/// tie or near-tie, ~1 in 2^16 norms) *d_found_inf is kFoundInfNeedsExact: run
/// exact_norm_partial_if_needed and finalize_exact_and_clip next (always enqueue them;
/// they do nothing otherwise). All pointers device memory. Determinism: bitwise
/// (stepcore::finalize and clip_coefficient on the host).
void finalize_and_clip(const NormPartial* d_partial, float max_norm, NormResult* d_result,
                       float* d_clip, std::int32_t* d_found_inf, cudaStream_t stream);

/// The exact fallback, pass 1: when *d_found_inf == kFoundInfNeedsExact, writes the
/// exact partial (integer deposits of every square, approximate = 0) of the values read
/// as R_T(R_T(g*scale)*clip) to *d_exact_partial; otherwise writes a zero partial (so an
/// all-reduce of it across ranks, which every rank enqueues, stays harmless). Same
/// workspace as scale_and_norm_partial; reads each element once when needed, nothing
/// otherwise. Never allocates, never synchronises; capturable. Determinism: bitwise:
/// reference::norm_partial digit for digit, for any launch shape.
void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors, GradientRead read,
                                  const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                  void* d_workspace, std::size_t workspace_bytes,
                                  cudaStream_t stream);

/// As above with scale and clip in device memory (d_read), read when the kernels run.
void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors,
                                  const DeviceGradientRead& d_read, const std::int32_t* d_found_inf,
                                  NormPartial* d_exact_partial, void* d_workspace,
                                  std::size_t workspace_bytes, cudaStream_t stream);

/// The exact fallback, pass 2: when *d_found_inf == kFoundInfNeedsExact, finalises the
/// (reduced) exact partial into *d_result, *d_clip and *d_found_inf as finalize_and_clip
/// does; otherwise leaves all three unchanged. Capturable, no host synchronisation.
void finalize_exact_and_clip(const NormPartial* d_exact_partial, float max_norm,
                             NormResult* d_result, float* d_clip, std::int32_t* d_found_inf,
                             cudaStream_t stream);

/// One step of any optimizer on device tensors (the alternative `config` holds selects
/// it; the tensors' state in its slot order, docs/numerics.md: e.g. AdamW's state[0]
/// exp_avg, state[1] exp_avg_sq), with the gradient read lazily as R_T(R_T(g * *d.scale)
/// * *d.clip) where the optimizer applies the read: bit-identical to scaling and clipping
/// in place first (docs/numerics.md section 3), to the reference and to the CPU engine's
/// Engine::step, for any launch shape. Step counters, lr and weight decay (d.hyper, else
/// the config's), the optimizer's table (d.table: make_optimizer_table(config); AdamW's
/// and Adam's bias corrections), the 8-bit codebooks (d.q8_codebooks: q8_codebooks(), for
/// tensors with 8-bit slots, whose blocks of 256 each thread block requantizes after a
/// block-wide maximum) and the found-inf flag are device memory, read when the
/// kernels run: a captured graph replays the next step with the current values, and
/// *d.found_inf != 0 leaves parameters, state and counters untouched (no rollback).
/// Validation: the CPU engine's (the unit's checker), except that the counters' values and
/// the device scalars are not read (they are device memory). Never allocates device
/// memory, never synchronises. Determinism: bitwise.
void optimizer_step(std::span<const OptimizerTensor> d_tensors, const OptimizerConfig& config,
                    const OptimizerDeviceArgs& d, cudaStream_t stream);

}  // namespace stepcore::gpu
