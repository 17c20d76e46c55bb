// The one place where the device managers (modes none and optimizer) hand an optimizer
// step to the device: an OptimizerTensor list and an OptimizerConfig in, the device's
// optimizer call out. Today the device steps AdamW (without amsgrad and maximize) and
// SignSGD through its per-optimizer calls; the others are refused here, before any
// memory is allocated. (To be replaced by device::Device::optimizer_step, generic over the
// units, when the device has it.)
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "stepcore/device.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// The device-memory inputs of a manager's device step (read when the kernels run).
struct DeviceStepArgs {
  const float* scale = nullptr;             ///< the read's gradient scale
  const float* clip = nullptr;              ///< the read's clip coefficient
  const std::int32_t* found_inf = nullptr;  ///< != 0: nothing written, counters kept
  const StepHyper* hyper = nullptr;         ///< the group's lr and weight decay
  const double* table = nullptr;            ///< the group's device_step_table (if any)
};

/// Throws Errc::not_supported naming "optimizer" (saying that mode full steps it) unless
/// the device managers can step `config`.
void check_device_optimizer(const OptimizerConfig& config);

/// Returns the per-group table the device step of `config` reads from device memory
/// (AdamW: its bias corrections, gpu::make_adamw_bias_table; empty: none). Throws like
/// the table's maker for a configuration it cannot tabulate (a beta too close to 1).
std::vector<double> device_step_table(const OptimizerConfig& config);

/// Enqueues one step of `config` over `tensors` (device memory; slots in the unit's
/// order, the counters in device memory) on `dev`.
void device_optimizer_step(device::Device& dev, std::span<const OptimizerTensor> tensors,
                           const OptimizerConfig& config, const DeviceStepArgs& args);

}  // namespace stepcore::detail
