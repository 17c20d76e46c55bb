// The argument checks and launch plans every implementation of the multi-tensor
// entry points shares (the CUDA launchers in step_kernels.cu and the host device that
// runs the same plans on the CPU): host-side checks first (shapes, dtypes, sizes,
// workspace), then the pointers through the caller's memory check, then the plan. One
// copy, so both devices refuse the same input with the same argument name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/validate.hpp"
#include "kernels/plans.hpp"
#include "stepcore/gpu.hpp"

namespace stepcore::gpu::detail {

/// Throws unless [p, p + bytes) is memory the device's kernels may use; `name` names the
/// argument (a string only for the error). The CUDA launchers ask the runtime; the host
/// device checks its allocations.
using MemoryCheck =
    std::function<void(const void* p, std::size_t bytes, const ::stepcore::detail::Arg& name)>;

/// Returns writable views of read-only tensors (the norm kernels write only when asked).
std::vector<TensorView> as_views(std::span<const ConstTensorView> tensors);

/// Validates a norm pass (partial pointer, tensor shapes, workspace size, then memory)
/// and returns its plan under the thread's launch limits.
LaunchPlan checked_norm_plan(std::span<const TensorView> d_tensors, const NormPartial* d_partial,
                             const char* partial_name, const void* d_workspace,
                             std::size_t workspace_bytes, const MemoryCheck& check);

/// Validates an in-place scale by a device factor and returns its plan.
LaunchPlan checked_scale_plan(std::span<const TensorView> d_tensors, const float* d_factor,
                              const MemoryCheck& check);

/// Validates accumulate pairs and returns one plan per copy flag present, as
/// {copy, plan} (a launch carries one flag).
std::vector<std::pair<bool, LaunchPlan>> checked_accumulate_plans(
    std::span<const AccumulatePair> d_pairs, const MemoryCheck& check);

/// Validates an AdamW call (device inputs, tensors, then memory: every tensor's
/// buffers and step counter) and returns its plan. Nothing is read from device memory.
AdamWPlan checked_adamw_plan(std::span<const AdamWTensor> d_tensors, const AdamWConfig& config,
                             const AdamWDeviceArgs& d, const MemoryCheck& check);

/// Validates a SignSGD call and returns its launches.
std::vector<SignSgdLaunchArgs> checked_sign_sgd_plan(std::span<const SignSgdTensor> d_tensors,
                                                     const SignSgdConfig& config,
                                                     const SignSgdDeviceArgs& d,
                                                     const MemoryCheck& check);

/// Throws Errc::null_pointer naming `name` when the device scalar p is null, then (with
/// `check`) runs the memory check of its `bytes`: a kernel reads it when it runs.
void check_device_scalar(const void* p, std::size_t bytes, const char* name,
                         const MemoryCheck* check);

/// check_device_scalar of a device gradient read: "d_read.scale", then "d_read.clip".
void check_device_read(const DeviceGradientRead& d_read, const MemoryCheck* check);

/// Validates the scalars of finalize_and_clip / finalize_exact_and_clip.
void check_finalize_args(const NormPartial* d_partial, const char* partial_name, float max_norm,
                         const NormResult* d_result, const float* d_clip,
                         const std::int32_t* d_found_inf, const MemoryCheck& check);

}  // namespace stepcore::gpu::detail
