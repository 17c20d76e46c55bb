// The shared argument checks and launch plans of the multi-tensor entry points
// (kernels/checked_plans.hpp).
#include "kernels/checked_plans.hpp"

#include "core/validate.hpp"
#include "kernels/plan_cache.hpp"
#include "stepcore/error.hpp"

namespace stepcore::gpu::detail {

using ::stepcore::detail::Arg;  // an argument's name, built only for an error

namespace {

// The keys list every field of the argument structs: a new field must join its key.
static_assert(sizeof(AdamWTensor) == 8 * sizeof(TensorView) + sizeof(float*));
static_assert(sizeof(SignSgdTensor) == 4 * sizeof(TensorView));
static_assert(sizeof(AdamWConfig) == 5 * sizeof(double) + 2 * sizeof(int));
static_assert(sizeof(SignSgdConfig) == 2 * sizeof(double));
static_assert(sizeof(AdamWDeviceArgs) == 5 * sizeof(void*));
static_assert(sizeof(SignSgdDeviceArgs) == 2 * sizeof(void*));

void add_limits(CallKey& key, const LaunchLimits& lim) {
  key.add(static_cast<std::uint64_t>(static_cast<std::uint32_t>(lim.max_blocks)) << 32 |
          static_cast<std::uint32_t>(lim.max_tensors));
}

void add_views(CallKey& key, std::span<const TensorView> views) {
  key.add(static_cast<std::uint64_t>(views.size()));
  for (const TensorView& v : views) key.add(ConstTensorView(v));
}

// Memory checks of a tensor list (after the host-side checks).
void check_tensor_memory(std::span<const TensorView> d_tensors, const char* base,
                         const MemoryCheck& check) {
  for (std::size_t i = 0; i < d_tensors.size(); ++i)
    if (d_tensors[i].numel != 0)
      check(d_tensors[i].data, d_tensors[i].bytes(), Arg{base, i, nullptr});
}

// The memory check of an optimizer tensor's out-of-place source (validated: empty, or
// f32 with its destination's size), after its destination's.
void check_source(const ConstTensorView& src, const Arg& name, const MemoryCheck& check) {
  if (src.data != nullptr) check(src.data, src.bytes(), name);
}

void check_scalar(const void* p, std::size_t bytes, const char* name, const MemoryCheck& check) {
  if (p == nullptr) throw Error(Errc::null_pointer, name, "null");
  check(p, bytes, Arg{name});
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
  static PlanCache<LaunchPlan> cache;
  const LaunchLimits lim = launch_limits(false);
  CallKey key(2 * d_tensors.size() + 8);
  add_views(key, d_tensors);
  key.add(d_partial);
  key.add(d_workspace);
  key.add(static_cast<std::uint64_t>(workspace_bytes));
  add_limits(key, lim);
  key.add(&check);  // the device whose memory was checked
  if (auto hit = cache.find(key)) return *std::move(hit);
  const std::uint64_t epoch = memory_epoch();
  if (d_partial == nullptr) throw Error(Errc::null_pointer, partial_name, "null");
  ::stepcore::detail::validate_tensors(d_tensors);  // the one checker: names "tensors[i]"
  const std::size_t need = scale_and_norm_workspace_bytes(d_tensors);
  if (workspace_bytes < need)
    throw Error(Errc::out_of_range, "workspace_bytes",
                std::to_string(workspace_bytes) + " < " + std::to_string(need) +
                    " (scale_and_norm_workspace_bytes)");
  if (need != 0 && d_workspace == nullptr) throw Error(Errc::null_pointer, "d_workspace", "null");
  check(d_partial, sizeof(NormPartial), Arg{partial_name});
  check_tensor_memory(d_tensors, "tensors", check);
  if (need != 0) check(d_workspace, need, Arg{"d_workspace"});
  LaunchPlan plan = make_plan(d_tensors, {}, lim.max_blocks, lim.max_tensors);
  cache.insert(std::move(key), plan, epoch);
  return plan;
}

LaunchPlan checked_scale_plan(std::span<const TensorView> d_tensors, const float* d_factor,
                              const MemoryCheck& check) {
  static PlanCache<LaunchPlan> cache;
  const LaunchLimits lim = launch_limits(false);
  CallKey key(2 * d_tensors.size() + 4);
  add_views(key, d_tensors);
  key.add(d_factor);
  add_limits(key, lim);
  key.add(&check);  // the device whose memory was checked
  if (auto hit = cache.find(key)) return *std::move(hit);
  const std::uint64_t epoch = memory_epoch();
  if (d_factor == nullptr) throw Error(Errc::null_pointer, "d_factor", "null");
  ::stepcore::detail::validate_scale_tensors(d_tensors);
  check(d_factor, sizeof(float), Arg{"d_factor"});
  check_tensor_memory(d_tensors, "tensors", check);
  LaunchPlan plan = make_plan(d_tensors, {}, lim.max_blocks, lim.max_tensors);
  cache.insert(std::move(key), plan, epoch);
  return plan;
}

std::vector<std::pair<bool, LaunchPlan>> checked_accumulate_plans(
    std::span<const AccumulatePair> d_pairs, const MemoryCheck& check) {
  using Plans = std::vector<std::pair<bool, LaunchPlan>>;
  static PlanCache<Plans> cache;
  const LaunchLimits lim = launch_limits(false);
  CallKey key(5 * d_pairs.size() + 4);
  key.add(static_cast<std::uint64_t>(d_pairs.size()));
  for (const AccumulatePair& p : d_pairs) {
    key.add(ConstTensorView(p.acc));
    key.add(p.src);
    key.add(static_cast<std::uint64_t>(p.copy));
  }
  add_limits(key, lim);
  key.add(&check);  // the device whose memory was checked
  if (auto hit = cache.find(key)) return *std::move(hit);
  const std::uint64_t epoch = memory_epoch();
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
    if (acc[i].numel != 0) check(acc[i].data, acc[i].bytes(), Arg{"pairs", i, "acc"});
    if (src[i].numel != 0) check(src[i].data, src[i].bytes(), Arg{"pairs", i, "src"});
  }
  // One copy flag per launch: split the pairs by it (usually all the same).
  Plans plans;
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
  cache.insert(std::move(key), plans, epoch);
  return plans;
}

AdamWPlan checked_adamw_plan(std::span<const AdamWTensor> d_tensors, const AdamWConfig& config,
                             const AdamWDeviceArgs& d, const MemoryCheck& check) {
  static PlanCache<AdamWPlan> cache;
  const LaunchLimits lim = launch_limits(true);
  CallKey key(17 * d_tensors.size() + 16);
  key.add(static_cast<std::uint64_t>(d_tensors.size()));
  for (const AdamWTensor& t : d_tensors) {
    for (const TensorView* v : {&t.param, &t.exp_avg, &t.exp_avg_sq, &t.compute_param})
      key.add(ConstTensorView(*v));
    for (const ConstTensorView* v : {&t.grad, &t.param_src, &t.exp_avg_src, &t.exp_avg_sq_src})
      key.add(*v);
    key.add(t.step);
  }
  for (double v : {config.lr, config.beta1, config.beta2, config.eps, config.weight_decay})
    key.add(v);
  key.add(static_cast<std::uint64_t>(config.formula));
  key.add(static_cast<std::uint64_t>(static_cast<std::uint32_t>(config.torch_tail_width)));
  // Every field of the configuration is in the key: a flag the plan refuses (amsgrad,
  // maximize) must reach validation, never a plan cached without it.
  key.add(static_cast<std::uint64_t>(config.amsgrad) | static_cast<std::uint64_t>(config.maximize)
                                                           << 1);
  for (const void* p : {static_cast<const void*>(d.scale), static_cast<const void*>(d.clip),
                        static_cast<const void*>(d.found_inf), static_cast<const void*>(d.hyper),
                        static_cast<const void*>(d.bias_table)})
    key.add(p);
  add_limits(key, lim);
  key.add(&check);  // the device whose memory was checked
  if (auto hit = cache.find(key)) return *std::move(hit);
  const std::uint64_t epoch = memory_epoch();
  if (d.scale == nullptr) throw Error(Errc::null_pointer, "d.scale", "required");
  if (d.clip == nullptr) throw Error(Errc::null_pointer, "d.clip", "required");
  if (d.bias_table == nullptr)
    throw Error(Errc::null_pointer, "d.bias_table", "required: gpu::make_adamw_bias_table(config)");
  // The plan validates every host-side argument (before any memory is looked at) and
  // touches no buffer: build it first, then check the memory, so validation runs once.
  AdamWPlan plan = make_adamw_plan(d_tensors, config, lim.max_blocks, lim.max_tensors);
  check(d.scale, sizeof(float), Arg{"d.scale"});
  check(d.clip, sizeof(float), Arg{"d.clip"});
  check(d.bias_table, 2 * sizeof(double), Arg{"d.bias_table"});
  if (d.found_inf != nullptr) check(d.found_inf, sizeof(std::int32_t), Arg{"d.found_inf"});
  if (d.hyper != nullptr) check(d.hyper, sizeof(StepHyper), Arg{"d.hyper"});
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    const AdamWTensor& t = d_tensors[i];
    check(t.step, sizeof(float), Arg{"tensors", i, "step"});
    if (t.param.numel == 0) continue;
    check(t.param.data, t.param.bytes(), Arg{"tensors", i, "param"});
    check(t.exp_avg.data, t.exp_avg.bytes(), Arg{"tensors", i, "exp_avg"});
    check(t.exp_avg_sq.data, t.exp_avg_sq.bytes(), Arg{"tensors", i, "exp_avg_sq"});
    check(t.grad.data, t.grad.bytes(), Arg{"tensors", i, "grad"});
    if (t.compute_param.data != nullptr)
      check(t.compute_param.data, t.compute_param.bytes(), Arg{"tensors", i, "compute_param"});
    check_source(t.param_src, Arg{"tensors", i, "param_src"}, check);
    check_source(t.exp_avg_src, Arg{"tensors", i, "exp_avg_src"}, check);
    check_source(t.exp_avg_sq_src, Arg{"tensors", i, "exp_avg_sq_src"}, check);
  }
  cache.insert(std::move(key), plan, epoch);
  return plan;
}

std::vector<SignSgdLaunchArgs> checked_sign_sgd_plan(std::span<const SignSgdTensor> d_tensors,
                                                     const SignSgdConfig& config,
                                                     const SignSgdDeviceArgs& d,
                                                     const MemoryCheck& check) {
  static PlanCache<std::vector<SignSgdLaunchArgs>> cache;
  const LaunchLimits lim = launch_limits(true);
  CallKey key(8 * d_tensors.size() + 8);
  key.add(static_cast<std::uint64_t>(d_tensors.size()));
  for (const SignSgdTensor& t : d_tensors) {
    key.add(ConstTensorView(t.param));
    key.add(t.grad);
    key.add(ConstTensorView(t.compute_param));
    key.add(t.param_src);
  }
  key.add(config.lr);
  key.add(config.weight_decay);
  key.add(d.found_inf);
  key.add(d.hyper);
  add_limits(key, lim);
  key.add(&check);  // the device whose memory was checked
  if (auto hit = cache.find(key)) return *std::move(hit);
  const std::uint64_t epoch = memory_epoch();
  // The plan validates, as for AdamW.
  std::vector<SignSgdLaunchArgs> launches =
      make_sign_sgd_plan(d_tensors, config, lim.max_blocks, lim.max_tensors);
  if (d.found_inf != nullptr) check(d.found_inf, sizeof(std::int32_t), Arg{"d.found_inf"});
  if (d.hyper != nullptr) check(d.hyper, sizeof(StepHyper), Arg{"d.hyper"});
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    const SignSgdTensor& t = d_tensors[i];
    if (t.param.numel == 0) continue;
    check(t.param.data, t.param.bytes(), Arg{"tensors", i, "param"});
    check(t.grad.data, t.grad.bytes(), Arg{"tensors", i, "grad"});
    if (t.compute_param.data != nullptr)
      check(t.compute_param.data, t.compute_param.bytes(), Arg{"tensors", i, "compute_param"});
    check_source(t.param_src, Arg{"tensors", i, "param_src"}, check);
  }
  cache.insert(std::move(key), launches, epoch);
  return launches;
}

void check_device_scalar(const void* p, std::size_t bytes, const char* name,
                         const MemoryCheck* check) {
  if (p == nullptr) throw Error(Errc::null_pointer, name, "required (device memory)");
  if (check != nullptr) (*check)(p, bytes, Arg{name});
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
