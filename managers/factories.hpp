// The constructors of the concrete managers, for the factory (managers/factory.cpp).
#pragma once

#include <memory>

#include "managers/manager_impl.hpp"
#include "stepcore/managers.hpp"

namespace stepcore::detail {

/// Returns the device-resident manager: mode none (GpuGradientManager) or optimizer
/// (the same, with AdamW/SignSGD state in host memory streamed through the device).
std::unique_ptr<ManagerImpl> make_gpu_gradient_manager(ManagerConfig config);

/// Returns the full-offload manager (OffloadGradientManager).
std::unique_ptr<ManagerImpl> make_offload_gradient_manager(ManagerConfig config);

}  // namespace stepcore::detail
