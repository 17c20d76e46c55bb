// The shared argument checks and launch plans of the multi-tensor entry points
// (kernels/checked_plans.hpp).
#include "kernels/checked_plans.hpp"

#include "core/validate.hpp"
#include "stepcore/error.hpp"

namespace stepcore::gpu::detail {
namespace {

// Memory checks of a tensor list (after the host-side checks).
void check_tensor_memory(std::span<const TensorView> d_tensors, const char* base,
                         const MemoryCheck& check) {
  for (std::size_t i = 0; i < d_tensors.size(); ++i)
    if (d_tensors[i].numel != 0)
      check(d_tensors[i].data, d_tensors[i].bytes(),
            ::stepcore::detail::arg_name(base, i, nullptr));
}

// The memory check of an optimizer tensor's out-of-place source (validated: empty, or
// f32 with its destination's size), after its destination's.
void check_source(const ConstTensorView& src, const std::string& name, const MemoryCheck& check) {
  if (src.data != nullptr) check(src.data, src.bytes(), name);
}

void check_scalar(const void* p, std::size_t bytes, const char* name, const MemoryCheck& check) {
  if (p == nullptr) throw Error(Errc::null_pointer, name, "null");
  check(p, bytes, name);
}

}  // namespace

std::vector<TensorView> as_views(std::span<const ConstTensorView> tensors) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (const ConstTensorView& t : tensors)
    views.push_back({const_cast<void*>(t.data), t.numel, t.dtype});
  return views;
}

LaunchPlan checked_norm_plan(std::span<const TensorView> d_tensors, const NormPartial* d_partial,
                             const char* partial_name, const void* d_workspace,
                             std::size_t workspace_bytes, const MemoryCheck& check) {
  if (d_partial == nullptr) throw Error(Errc::null_pointer, partial_name, "null");
  ::stepcore::detail::validate_tensors(d_tensors);  // the one checker: names "tensors[i]"
  const std::size_t need = scale_and_norm_workspace_bytes(d_tensors);
  if (workspace_bytes < need)
    throw Error(Errc::out_of_range, "workspace_bytes",
                std::to_string(workspace_bytes) + " < " + std::to_string(need) +
                    " (scale_and_norm_workspace_bytes)");
  if (need != 0 && d_workspace == nullptr) throw Error(Errc::null_pointer, "d_workspace", "null");
  check(d_partial, sizeof(NormPartial), partial_name);
  check_tensor_memory(d_tensors, "tensors", check);
  if (need != 0) check(d_workspace, need, "d_workspace");
  const LaunchLimits lim = launch_limits(false);
  return make_plan(d_tensors, {}, lim.max_blocks, lim.max_tensors);
}

LaunchPlan checked_scale_plan(std::span<const TensorView> d_tensors, const float* d_factor,
                              const MemoryCheck& check) {
  if (d_factor == nullptr) throw Error(Errc::null_pointer, "d_factor", "null");
  ::stepcore::detail::validate_scale_tensors(d_tensors);
  check(d_factor, sizeof(float), "d_factor");
  check_tensor_memory(d_tensors, "tensors", check);
  const LaunchLimits lim = launch_limits(false);
  return make_plan(d_tensors, {}, lim.max_blocks, lim.max_tensors);
}

std::vector<std::pair<bool, LaunchPlan>> checked_accumulate_plans(
    std::span<const AccumulatePair> d_pairs, const MemoryCheck& check) {
  ::stepcore::detail::validate_accumulate(d_pairs);
  std::vector<TensorView> acc;
  std::vector<ConstTensorView> src;
  acc.reserve(d_pairs.size());
  src.reserve(d_pairs.size());
  for (const AccumulatePair& p : d_pairs) {
    acc.push_back(p.acc);
    src.push_back(p.src);
  }
  for (std::size_t i = 0; i < d_pairs.size(); ++i) {
    using ::stepcore::detail::arg_name;
    if (acc[i].numel != 0) check(acc[i].data, acc[i].bytes(), arg_name("pairs", i, "acc"));
    if (src[i].numel != 0) check(src[i].data, src[i].bytes(), arg_name("pairs", i, "src"));
  }
  // One copy flag per launch: split the pairs by it (usually all the same).
  std::vector<std::pair<bool, LaunchPlan>> plans;
  const LaunchLimits lim = launch_limits(false);
  for (bool copy : {false, true}) {
    std::vector<TensorView> a;
    std::vector<ConstTensorView> s;
    for (std::size_t i = 0; i < d_pairs.size(); ++i)
      if (d_pairs[i].copy == copy) {
        a.push_back(acc[i]);
        s.push_back(src[i]);
      }
    if (!a.empty()) plans.emplace_back(copy, make_plan(a, s, lim.max_blocks, lim.max_tensors));
  }
  return plans;
}

AdamWPlan checked_adamw_plan(std::span<const AdamWTensor> d_tensors, const AdamWConfig& config,
                             const AdamWDeviceArgs& d, const MemoryCheck& check) {
  if (d.scale == nullptr) throw Error(Errc::null_pointer, "d.scale", "required");
  if (d.clip == nullptr) throw Error(Errc::null_pointer, "d.clip", "required");
  if (d.bias_table == nullptr)
    throw Error(Errc::null_pointer, "d.bias_table", "required: gpu::make_adamw_bias_table(config)");
  // The plan validates every host-side argument (before any memory is looked at) and
  // touches no buffer: build it first, then check the memory, so validation runs once.
  const LaunchLimits lim = launch_limits(true);
  AdamWPlan plan = make_adamw_plan(d_tensors, config, lim.max_blocks, lim.max_tensors);
  check(d.scale, sizeof(float), "d.scale");
  check(d.clip, sizeof(float), "d.clip");
  check(d.bias_table, 2 * sizeof(double), "d.bias_table");
  if (d.found_inf != nullptr) check(d.found_inf, sizeof(std::int32_t), "d.found_inf");
  if (d.hyper != nullptr) check(d.hyper, sizeof(StepHyper), "d.hyper");
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    const AdamWTensor& t = d_tensors[i];
    using ::stepcore::detail::arg_name;
    check(t.step, sizeof(float), arg_name("tensors", i, "step"));
    if (t.param.numel == 0) continue;
    check(t.param.data, t.param.bytes(), arg_name("tensors", i, "param"));
    check(t.exp_avg.data, t.exp_avg.bytes(), arg_name("tensors", i, "exp_avg"));
    check(t.exp_avg_sq.data, t.exp_avg_sq.bytes(), arg_name("tensors", i, "exp_avg_sq"));
    check(t.grad.data, t.grad.bytes(), arg_name("tensors", i, "grad"));
    if (t.compute_param.data != nullptr)
      check(t.compute_param.data, t.compute_param.bytes(), arg_name("tensors", i, "compute_param"));
    check_source(t.param_src, arg_name("tensors", i, "param_src"), check);
    check_source(t.exp_avg_src, arg_name("tensors", i, "exp_avg_src"), check);
    check_source(t.exp_avg_sq_src, arg_name("tensors", i, "exp_avg_sq_src"), check);
  }
  return plan;
}

std::vector<SignSgdLaunchArgs> checked_sign_sgd_plan(std::span<const SignSgdTensor> d_tensors,
                                                     const SignSgdConfig& config,
                                                     const SignSgdDeviceArgs& d,
                                                     const MemoryCheck& check) {
  const LaunchLimits lim = launch_limits(true);  // the plan validates, as for AdamW
  std::vector<SignSgdLaunchArgs> launches =
      make_sign_sgd_plan(d_tensors, config, lim.max_blocks, lim.max_tensors);
  if (d.found_inf != nullptr) check(d.found_inf, sizeof(std::int32_t), "d.found_inf");
  if (d.hyper != nullptr) check(d.hyper, sizeof(StepHyper), "d.hyper");
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    const SignSgdTensor& t = d_tensors[i];
    if (t.param.numel == 0) continue;
    using ::stepcore::detail::arg_name;
    check(t.param.data, t.param.bytes(), arg_name("tensors", i, "param"));
    check(t.grad.data, t.grad.bytes(), arg_name("tensors", i, "grad"));
    if (t.compute_param.data != nullptr)
      check(t.compute_param.data, t.compute_param.bytes(), arg_name("tensors", i, "compute_param"));
    check_source(t.param_src, arg_name("tensors", i, "param_src"), check);
  }
  return launches;
}

void check_device_scalar(const void* p, std::size_t bytes, const char* name,
                         const MemoryCheck* check) {
  if (p == nullptr) throw Error(Errc::null_pointer, name, "required (device memory)");
  if (check != nullptr) (*check)(p, bytes, name);
}

void check_device_read(const DeviceGradientRead& d_read, const MemoryCheck* check) {
  check_device_scalar(d_read.scale, sizeof(float), "d_read.scale", check);
  check_device_scalar(d_read.clip, sizeof(float), "d_read.clip", check);
}

void check_finalize_args(const NormPartial* d_partial, const char* partial_name, float max_norm,
                         const NormResult* d_result, const float* d_clip,
                         const std::int32_t* d_found_inf, const MemoryCheck& check) {
  ::stepcore::detail::check_max_norm(max_norm);
  check_scalar(d_partial, sizeof(NormPartial), partial_name, check);
  check_scalar(d_result, sizeof(NormResult), "d_result", check);
  check_scalar(d_clip, sizeof(float), "d_clip", check);
  check_scalar(d_found_inf, sizeof(std::int32_t), "d_found_inf", check);
}

}  // namespace stepcore::gpu::detail
