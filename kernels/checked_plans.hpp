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
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/optimizers/all.hpp"
#include "core/validate.hpp"
#include "kernels/plans.hpp"
#include "stepcore/gpu.hpp"

namespace stepcore::gpu::detail {

/// Throws unless [p, p + bytes) is memory the device's kernels may use; `name` names the
/// argument (a string only for the error). The CUDA launchers ask the runtime; the host
/// device checks its allocations.
using MemoryCheck =
    std::function<void(const void* p, std::size_t bytes, const ::stepcore::detail::Arg& name)>;

/// What the CUDA runtime says of a pointer (cudaPointerGetAttributes), for the launchers'
/// memory check.
struct PointerInfo {
  enum Kind : std::uint8_t {
    unknown,  ///< the runtime could not say (the query failed)
    host,     ///< host memory, registered or not
    device,   ///< device memory of CUDA device `ordinal`
    managed,  ///< managed memory (any device may use it)
  } kind = unknown;
  int ordinal = -1;  ///< the device of device memory
};

/// Returns what the CUDA runtime says of p (cudaPointerGetAttributes; a failed query is
/// `unknown`). Defined in CUDA builds only (step_kernels.cu).
PointerInfo pointer_info(const void* p) noexcept;

/// The launchers' pointer rule: a kernel launched on CUDA device `launch_device` (the
/// current device) may use device memory of that device or managed memory. Anything else
/// throws Errc::invalid_argument naming `name`, saying what it is: not a CUDA pointer, a
/// host pointer, or device memory of another device (a multi-GPU caller's pointer from
/// another GPU would fault with a sticky illegal-address error in the kernel).
void check_pointer_device(const PointerInfo& info, int launch_device,
                          const ::stepcore::detail::Arg& name);

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

/// The plans of one accumulate call: one per copy flag present, as {copy, plan} (a launch
/// carries one flag).
using AccumulatePlans = std::vector<std::pair<bool, LaunchPlan>>;

/// Validates accumulate pairs and returns their plans. A caller that owns the plan of
/// this call (ScopedOwnedPlan<AccumulatePlans> on this thread) gets it from there and
/// keeps it there instead of in the shared cache.
AccumulatePlans checked_accumulate_plans(std::span<const AccumulatePair> d_pairs,
                                         const MemoryCheck& check);

/// Validates a step of unit Opt (the device inputs it needs: d.scale and d.clip when the
/// unit applies the read, d.table when it has a table; the configuration and tensors by
/// validate_unit with the counters unread: they are device memory; then the memory of
/// every buffer, counter and device scalar) and returns its plan. Nothing is read from
/// device memory. Instantiated for every unit of AllUnits.
template <class Opt>
OptimizerPlan<Opt> checked_optimizer_plan(std::span<const OptimizerTensor> d_tensors,
                                          const typename Opt::Config& config,
                                          const OptimizerDeviceArgs& d, const MemoryCheck& check);

/// Calls fn(plan) with the checked plan of the unit whose configuration `config` holds
/// (std::visit over the OptimizerConfig alternatives, each its unit's): the one dispatch
/// of a device's generic optimizer step.
template <class Fn>
void with_checked_optimizer_plan(std::span<const OptimizerTensor> d_tensors,
                                 const OptimizerConfig& config, const OptimizerDeviceArgs& d,
                                 const MemoryCheck& check, Fn&& fn) {
  std::visit(
      [&](const auto& c) {
        using Opt = typename ::stepcore::detail::UnitForConfig<std::decay_t<decltype(c)>,
                                                               ::stepcore::detail::AllUnits>::type;
        fn(checked_optimizer_plan<Opt>(d_tensors, c, d, check));
      },
      config);
}

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
