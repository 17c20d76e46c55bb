// The device managers' adapter onto the device's optimizer step (managers/device_step.hpp).
#include "managers/device_step.hpp"

#include "stepcore/gpu.hpp"

namespace stepcore::detail {

std::vector<double> device_step_table(const OptimizerConfig& config) {
  return gpu::make_optimizer_table(config);
}

void device_optimizer_step(device::Device& dev, std::span<const OptimizerTensor> tensors,
                           const OptimizerConfig& config, const DeviceStepArgs& args) {
  OptimizerDeviceArgs d;
  d.scale = args.scale;
  d.clip = args.clip;
  d.found_inf = args.found_inf;
  d.hyper = args.hyper;
  d.table = args.table;
  d.q8_codebooks = args.q8_codebooks;
  dev.optimizer_step(tensors, config, d);
}

}  // namespace stepcore::detail
