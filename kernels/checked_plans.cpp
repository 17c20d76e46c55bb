// The shared argument checks and launch plans of the multi-tensor entry points
// (kernels/checked_plans.hpp).
#include "kernels/checked_plans.hpp"

#include <tuple>

#include "core/q8.hpp"
#include "core/validate.hpp"
#include "kernels/plan_cache.hpp"
#include "stepcore/error.hpp"

namespace stepcore::gpu::detail {

using ::stepcore::detail::Arg;  // an argument's name, built only for an error

namespace {

// The keys list every field of the argument structs: a new field must join its key.
static_assert(sizeof(OptimizerTensor) == (4 + 2 * kMaxOptimizerSlots) * sizeof(TensorView) +
                                             sizeof(float*) + kMaxOptimizerSlots * sizeof(Q8Slot));
static_assert(sizeof(OptimizerDeviceArgs) == 6 * sizeof(void*));

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

// Returns the plan `store` holds for `key`, if any, counting the call as reused or
// validated (a miss: the caller validates it).
template <class Store>
auto reuse(Store& store, const CallKey& key, CallKind kind) {
  auto hit = store.find(key);
  count_call(kind, !hit.has_value());
  return hit;
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
  if (auto hit = reuse(cache, key, CallKind::norm)) return *std::move(hit);
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
  if (auto hit = reuse(cache, key, CallKind::scale)) return *std::move(hit);
  const std::uint64_t epoch = memory_epoch();
  if (d_factor == nullptr) throw Error(Errc::null_pointer, "d_factor", "null");
  ::stepcore::detail::validate_scale_tensors(d_tensors);
  check(d_factor, sizeof(float), Arg{"d_factor"});
  check_tensor_memory(d_tensors, "tensors", check);
  LaunchPlan plan = make_plan(d_tensors, {}, lim.max_blocks, lim.max_tensors);
  cache.insert(std::move(key), plan, epoch);
  return plan;
}

AccumulatePlans checked_accumulate_plans(std::span<const AccumulatePair> d_pairs,
                                         const MemoryCheck& check) {
  using Plans = AccumulatePlans;
  static PlanCache<Plans> cache;
  OwnedPlan<Plans>* const owned = ScopedOwnedPlan<Plans>::in_force();
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
  if (auto hit = owned != nullptr ? reuse(*owned, key, CallKind::accumulate)
                                  : reuse(cache, key, CallKind::accumulate))
    return *std::move(hit);
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
  if (owned != nullptr)
    owned->insert(std::move(key), plans, epoch);
  else
    cache.insert(std::move(key), plans, epoch);
  return plans;
}

template <class Opt>
OptimizerPlan<Opt> checked_optimizer_plan(std::span<const OptimizerTensor> d_tensors,
                                          const typename Opt::Config& config,
                                          const OptimizerDeviceArgs& d, const MemoryCheck& check) {
  // The device inputs the unit reads, then its configuration: checked on every call (a
  // cached plan holds no configuration check; the configuration is set below).
  if constexpr (Opt::kReadsScaled) {
    if (d.scale == nullptr) throw Error(Errc::null_pointer, "d.scale", "required");
    if (d.clip == nullptr) throw Error(Errc::null_pointer, "d.clip", "required");
  }
  if (Opt::kTableColumns > 0 && d.table == nullptr)
    throw Error(Errc::null_pointer, "d.table", "required: gpu::make_optimizer_table(config)");
  Opt::validate(config, GradientRead{});
  static PlanCache<OptimizerPlan<Opt>> cache;
  const LaunchLimits lim = launch_limits(true);
  // The tensors' validity depends on the configuration only through the slots its
  // variant uses: the variant is in the key, the rest of the configuration is not.
  const int used = Opt::slots(Opt::variant(config));
  CallKey key(27 * d_tensors.size() + 12);
  key.add(static_cast<std::uint64_t>(d_tensors.size()));
  for (const OptimizerTensor& t : d_tensors) {
    key.add(ConstTensorView(t.param));
    for (const TensorView& v : t.state) key.add(ConstTensorView(v));
    key.add(ConstTensorView(t.compute_param));
    key.add(t.grad);
    key.add(t.param_src);
    for (const ConstTensorView& v : t.state_src) key.add(v);
    key.add(t.step);
    for (const Q8Slot& q : t.q8) {
      key.add(static_cast<const void*>(q.codes));
      key.add(static_cast<const void*>(q.absmax));
    }
  }
  key.add(static_cast<std::uint64_t>(Opt::variant(config)));
  for (const void* p :
       {static_cast<const void*>(d.scale), static_cast<const void*>(d.clip),
        static_cast<const void*>(d.found_inf), static_cast<const void*>(d.hyper),
        static_cast<const void*>(d.table), static_cast<const void*>(d.q8_codebooks)})
    key.add(p);
  add_limits(key, lim);
  key.add(&check);  // the device whose memory was checked
  auto with_config = [&](OptimizerPlan<Opt> plan) {
    for (OptimizerLaunchArgs<Opt>& a : plan.launches) a.config = config;
    return plan;
  };
  if (auto hit = reuse(cache, key, CallKind::optimizer)) return with_config(*std::move(hit));
  const std::uint64_t epoch = memory_epoch();
  // The plan validates every host-side argument (validate_unit, before any memory is
  // looked at) and touches no buffer: build it first, then check the memory.
  OptimizerPlan<Opt> plan =
      make_optimizer_plan<Opt>(d_tensors, config, lim.max_blocks, lim.max_tensors);
  if constexpr (Opt::kReadsScaled) {
    check(d.scale, sizeof(float), Arg{"d.scale"});
    check(d.clip, sizeof(float), Arg{"d.clip"});
  }
  // The table's column lengths (its entries follow; the host built it for this config).
  if constexpr (Opt::kTableColumns > 0)
    check(d.table, Opt::kTableColumns * sizeof(double), Arg{"d.table"});
  if (d.found_inf != nullptr) check(d.found_inf, sizeof(std::int32_t), Arg{"d.found_inf"});
  if (d.hyper != nullptr) check(d.hyper, sizeof(StepHyper), Arg{"d.hyper"});
  bool codebooks_checked = false;
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    const OptimizerTensor& t = d_tensors[i];
    if constexpr (Opt::kCountsSteps) check(t.step, sizeof(float), Arg{"tensors", i, "step"});
    if (t.param.numel == 0) continue;
    check(t.param.data, t.param.bytes(), Arg{"tensors", i, "param"});
    const bool q8 = t.q8[0].codes != nullptr;  // validated: every used slot or none
    if (q8 && !codebooks_checked) {
      check_device_scalar(d.q8_codebooks, ::stepcore::detail::kQ8ImageWords * sizeof(std::uint32_t),
                          "d.q8_codebooks", &check);
      codebooks_checked = true;
    }
    for (int s = 0; s < used; ++s)
      if (q8) {
        const Arg name{"tensors", i, ::stepcore::detail::kQ8SlotFields[s]};
        const std::size_t blocks = (t.param.numel + kQ8BlockSize - 1) / kQ8BlockSize;
        check(t.q8[s].codes, t.param.numel, name);
        check(t.q8[s].absmax, blocks * sizeof(float), name);
      } else {
        check(t.state[s].data, t.state[s].bytes(), Arg{"tensors", i, Opt::kSlotNames[s]});
      }
    check(t.grad.data, t.grad.bytes(), Arg{"tensors", i, "grad"});
    if (t.compute_param.data != nullptr)
      check(t.compute_param.data, t.compute_param.bytes(), Arg{"tensors", i, "compute_param"});
    check_source(t.param_src, Arg{"tensors", i, "param_src"}, check);
    for (int s = 0; s < used; ++s)
      check_source(t.state_src[s], Arg{"tensors", i, Opt::kSlotSourceNames[s]}, check);
  }
  cache.insert(std::move(key), plan, epoch);
  return plan;
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

// Every unit's checked plan (AllUnits), by address, as in launch_plan.cpp.
template <class... Units>
constexpr auto checked_instances(::stepcore::detail::UnitList<Units...>) {
  return std::make_tuple(&checked_optimizer_plan<Units>...);
}
extern const auto kCheckedInstances = checked_instances(::stepcore::detail::AllUnits{});

void check_pointer_device(const PointerInfo& info, int launch_device,
                          const ::stepcore::detail::Arg& name) {
  switch (info.kind) {
    case PointerInfo::managed:
      return;
    case PointerInfo::device:
      if (info.ordinal == launch_device) return;
      throw Error(Errc::invalid_argument, name.str(),
                  "device memory of CUDA device " + std::to_string(info.ordinal) +
                      ", but the launch runs on device " + std::to_string(launch_device) +
                      " (the current device): make the memory's device current for the call");
    case PointerInfo::host:
      throw Error(Errc::invalid_argument, name.str(),
                  "a host pointer where device memory is needed");
    case PointerInfo::unknown:
      break;
  }
  throw Error(Errc::invalid_argument, name.str(), "not a CUDA pointer");
}

}  // namespace stepcore::gpu::detail
