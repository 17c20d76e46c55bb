// The one place where the device managers (modes none and optimizer) hand an optimizer
// step to the device: an OptimizerTensor list and an OptimizerConfig in,
// device::Device::optimizer_step (generic over the units) out.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "stepcore/device.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// The device-memory inputs of a manager's device step (read when the kernels run).
struct DeviceStepArgs {
  const float* scale = nullptr;                 ///< the read's gradient scale
  const float* clip = nullptr;                  ///< the read's clip coefficient
  const std::int32_t* found_inf = nullptr;      ///< != 0: nothing written, counters kept
  const StepHyper* hyper = nullptr;             ///< the group's lr and weight decay
  const double* table = nullptr;                ///< the group's device_step_table (if any)
  const std::uint32_t* q8_codebooks = nullptr;  ///< gpu::q8_codebooks() (8-bit slots)
};

/// Returns the per-group table the device step of `config` reads from device memory
/// (gpu::make_optimizer_table: AdamW's and Adam's bias corrections; empty: none). Throws
/// like the table's maker for a configuration it cannot tabulate (a beta too close to 1).
std::vector<double> device_step_table(const OptimizerConfig& config);

/// Enqueues one step of `config` over `tensors` (device memory; slots in the unit's
/// order, the counters in device memory) on `dev`.
void device_optimizer_step(device::Device& dev, std::span<const OptimizerTensor> tensors,
                           const OptimizerConfig& config, const DeviceStepArgs& args);

}  // namespace stepcore::detail
