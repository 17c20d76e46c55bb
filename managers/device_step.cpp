// The device managers' adapter onto the device's optimizer calls (managers/device_step.hpp).
#include "managers/device_step.hpp"

#include <string>
#include <variant>

#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"

namespace stepcore::detail {

void check_device_optimizer(const OptimizerConfig& config) {
  std::string why;
  if (const auto* a = std::get_if<AdamWConfig>(&config)) {
    if (a->amsgrad) why = "AdamW with amsgrad";
    if (a->maximize) why = "AdamW with maximize";
  } else if (!std::holds_alternative<SignSgdConfig>(config)) {
    why = std::string(optimizer_name(config));
  }
  if (!why.empty())
    throw Error(Errc::not_supported, "optimizer",
                why +
                    " is not stepped on the device yet: modes none and optimizer step adamw "
                    "(without amsgrad and maximize) and sign_sgd; mode full (offload='full') "
                    "steps every optimizer");
}

std::vector<double> device_step_table(const OptimizerConfig& config) {
  if (const auto* a = std::get_if<AdamWConfig>(&config)) return gpu::make_adamw_bias_table(*a);
  return {};
}

void device_optimizer_step(device::Device& dev, std::span<const OptimizerTensor> tensors,
                           const OptimizerConfig& config, const DeviceStepArgs& args) {
  check_device_optimizer(config);
  if (const auto* a = std::get_if<AdamWConfig>(&config)) {
    std::vector<AdamWTensor> t;
    t.reserve(tensors.size());
    for (const OptimizerTensor& o : tensors) {
      AdamWTensor x{o.param, o.state[0], o.state[1], o.step, o.grad, o.compute_param};
      x.param_src = o.param_src;
      x.exp_avg_src = o.state_src[0];
      x.exp_avg_sq_src = o.state_src[1];
      t.push_back(x);
    }
    dev.adamw_step(t, *a,
                   AdamWDeviceArgs{args.scale, args.clip, args.found_inf, args.hyper, args.table});
    return;
  }
  std::vector<SignSgdTensor> t;
  t.reserve(tensors.size());
  for (const OptimizerTensor& o : tensors) {
    SignSgdTensor x{o.param, o.grad, o.compute_param};
    x.param_src = o.param_src;
    t.push_back(x);
  }
  dev.sign_sgd_step(t, std::get<SignSgdConfig>(config),
                    SignSgdDeviceArgs{args.found_inf, args.hyper});
}

}  // namespace stepcore::detail
