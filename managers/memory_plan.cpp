// plan_memory (stepcore/plan.hpp): the bytes each mode's manager allocates, by kind, from
// its configuration alone. The formulas are written here from the modes' layouts (slabs
// of 256-byte aligned views, the rings, the rollback space), not taken from the managers:
// tests/test_memory_plan.cpp checks them against GradientManager::memory() exactly.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/q8.hpp"  // kQ8ImageWords
#include "core/validate.hpp"
#include "managers/checkpoint_buffers.hpp"
#include "managers/manager_impl.hpp"
#include "managers/offload_layout.hpp"
#include "managers/optimizer.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/host_slab.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/plan.hpp"

namespace stepcore {
namespace {

std::size_t aligned(std::size_t bytes) {
  return (bytes + kSlabViewAlignment - 1) / kSlabViewAlignment * kSlabViewAlignment;
}
// A slab of these views, as allocated: its layout's total, never less than one block.
std::size_t slab_bytes(const std::vector<std::size_t>& views) {
  return std::max(layout_slab(views).total_bytes, kSlabViewAlignment);
}
bool owns_compute(const ParamSpec& p) {
  return p.has_compute_weights && p.compute_into.data == nullptr && p.compute_into.numel == 0;
}
std::string indexed(const char* base, std::size_t i, const char* field) {
  return std::string(base) + "[" + std::to_string(i) + "]." + field;
}

// The device manager's step scalars and pinned words (modes none and optimizer), as laid
// out in its slabs: the norm's summary, three partials, the scale, constants, the
// layout record.
struct Summary {
  comm::LayoutCheck check;
  NormResult result;
  float clip;
  std::int32_t found_inf;
};
struct StepScalars {
  NormPartial partial, exact, scratch;
  Summary summary;
  float scale, one;
  std::int32_t zero;
};
struct HostWords {
  Summary summary;
  float scale, one;
  comm::LayoutCheck check;
};
constexpr std::size_t kStreamingSlots = 3;  // mode optimizer: upload, step, download

// The kinds of a plan, in the order the manager declares them.
class Plan {
 public:
  void add(std::string kind, bool device, std::size_t bytes) {
    r_.kinds.push_back(MemoryUse{std::move(kind), device, bytes, bytes});
    (device ? r_.device_bytes : r_.host_bytes) += bytes;
  }
  // Every kind only grows until the checkpoint's buffers, held last and then released.
  MemoryReport finish(CheckpointPhase checkpoint) {
    r_.host_peak = r_.host_bytes;
    r_.device_peak = r_.device_bytes;
    if (checkpoint != CheckpointPhase::none) {
      const std::size_t held = checkpoint == CheckpointPhase::save
                                   ? detail::checkpoint::kSaveBufferBytes
                                   : detail::checkpoint::kLoadBufferBytes;
      r_.kinds.push_back(MemoryUse{"checkpoint", false, 0, held});
      r_.host_peak += held;
    }
    return r_;
  }

 private:
  MemoryReport r_;
};

// Validates `config` as the managers' constructors do (what needs no device).
void validate(const ManagerConfig& config) {
  using namespace detail;
  if (config.mode != OffloadMode::none && config.mode != OffloadMode::optimizer &&
      config.mode != OffloadMode::full)
    throw Error(Errc::invalid_argument, "mode", "not an OffloadMode");
  for (std::size_t i = 0; i < config.params.size(); ++i) {
    const ParamSpec& p = config.params[i];
    if (!dtype_valid(p.grad_dtype))
      throw Error(Errc::unsupported_dtype, indexed("params", i, "grad_dtype"), "");
    if (p.has_compute_weights && !dtype_valid(p.compute_dtype))
      throw Error(Errc::unsupported_dtype, indexed("params", i, "compute_dtype"), "");
  }
  // What every manager's construction refuses, checked by the same function.
  validate_manager_config(config);
  // The device modes' bias tables (a beta too close to 1 is refused there).
  if (config.mode != OffloadMode::full) {
    const std::vector<ParamGroup> groups =
        config.groups.empty() ? std::vector<ParamGroup>{default_group(config.optimizer)}
                              : config.groups;
    const std::string opt_prefix =
        "optimizer." + std::string(optimizer_name(config.optimizer)) + ".";
    for (std::size_t g = 0; g < groups.size(); ++g)
      with_group_names(config.groups.empty() ? opt_prefix : indexed("groups", g, ""), opt_prefix,
                       has_betas(config.optimizer), [&] {
                         (void)gpu::make_optimizer_table(group_config(config.optimizer, groups[g]));
                       });
  }
}

// The rollback budget: kAllChunks is everything.
std::size_t budget(std::int64_t bytes) {
  return bytes == ManagerConfig::kAllChunks ? SIZE_MAX : static_cast<std::size_t>(bytes);
}
bool reserves_rollback(const ManagerConfig& config, const MemoryPlanOptions& options) {
  return options.overlap && config.speculation_bytes != 0 &&
         config.speculation != Speculation::never;
}

// Mode full: host state slabs, the pinned rings, device gradient and compute buffers.
MemoryReport plan_full(const ManagerConfig& config, const MemoryPlanOptions& options) {
  const std::vector<std::string_view> slot_names = optimizer_slot_names(config.optimizer);
  std::size_t per_array = 0, per_slot = 0, grads = 0, computes = 0, compute_all = 0;
  std::size_t grad_width = 1, compute_width = 1;
  for (const ParamSpec& p : config.params) {
    per_array += aligned(p.numel * sizeof(float));
    // A state slot: f32 values, or 8-bit codes and block maxima (ManagerConfig::q8_state).
    per_slot += detail::q8_slots(config, p.numel)
                    ? aligned(p.numel) + aligned(q8_blocks(p.numel) * sizeof(float))
                    : aligned(p.numel * sizeof(float));
    grad_width = std::max(grad_width, dtype_size(p.grad_dtype));
    if (p.gradient_buffer) grads += aligned(p.numel * dtype_size(p.grad_dtype));
    if (!p.has_compute_weights) continue;
    compute_width = std::max(compute_width, dtype_size(p.compute_dtype));
    compute_all += aligned(p.numel * dtype_size(p.compute_dtype));
    if (owns_compute(p)) computes += aligned(p.numel * dtype_size(p.compute_dtype));
  }
  const detail::RingGeometry ring = detail::ring_geometry(config);
  const std::size_t ring_elements = ring.slots * ring.slot_elements;
  const bool rollback = reserves_rollback(config, options);
  std::size_t staged = 0;
  if (rollback && config.speculation_device_bytes != 0)
    staged = std::min(compute_all, budget(config.speculation_device_bytes));

  Plan plan;
  plan.add("master", false, per_array);
  for (std::string_view s : slot_names) plan.add(std::string(s), false, per_slot);
  plan.add("accumulator", false, options.micro_batches >= 2 ? per_array : 0);
  plan.add("staging", false, ring_elements * grad_width);
  plan.add("upload", false, ring_elements * compute_width);
  plan.add("fetch", false, ring_elements * grad_width);
  // The rollback space: every chunk's state spares and its compute weights' pinned space.
  plan.add("speculation", false,
           rollback ? std::min(per_array + slot_names.size() * per_slot + compute_all,
                               budget(config.speculation_bytes))
                    : 0);
  plan.add("gradient", true, grads);
  plan.add("compute", true, computes);
  plan.add("speculation_device", true, staged);
  return plan.finish(options.checkpoint);
}

// The chunks: consecutive parameters, up to chunk_elements elements (a larger one alone).
std::vector<std::pair<std::size_t, std::size_t>> chunks_of(const ManagerConfig& config) {
  std::vector<std::pair<std::size_t, std::size_t>> chunks;  // [first, last)
  std::size_t elements = 0;
  for (std::size_t i = 0; i < config.params.size(); ++i) {
    const std::size_t numel = config.params[i].numel;
    if (chunks.empty() || (elements != 0 && elements + numel > config.chunk_elements)) {
      chunks.push_back({i, i});
      elements = 0;
    }
    chunks.back().second = i + 1;
    elements += numel;
  }
  return chunks;
}

// Modes none and optimizer: one device slab (gradients, accumulators, compute weights,
// state in mode none, scalars, counters, hyper-parameters, tables, the streaming slots),
// the norm workspace, one pinned slab (words, hyper-parameters, mode optimizer's state
// blocks), and the rollback space.
MemoryReport plan_device(const ManagerConfig& config, const MemoryPlanOptions& options) {
  const bool streamed = config.mode == OffloadMode::optimizer;
  const std::vector<std::string_view> slot_names = optimizer_slot_names(config.optimizer);
  const std::size_t arrays = 1 + slot_names.size();
  const std::size_t n = config.params.size();
  const std::size_t ngroups = std::max<std::size_t>(config.groups.size(), 1);
  const auto chunks = chunks_of(config);
  // A parameter's state views: the master, then per slot its f32 values or 8-bit codes and
  // its block maxima (none for f32 slots; ManagerConfig::q8_state).
  auto state_views = [&](const ParamSpec& p) {
    const bool q8 = !slot_names.empty() && detail::q8_slots(config, p.numel);
    std::vector<std::size_t> v{p.numel * sizeof(float)};
    for (std::size_t s = 1; s < arrays; ++s) {
      v.push_back(q8 ? p.numel : p.numel * sizeof(float));
      v.push_back(q8 ? q8_blocks(p.numel) * sizeof(float) : 0);
    }
    return v;
  };

  std::vector<std::size_t> dev, host;
  std::size_t grads = 0, accs = 0, computes = 0;
  std::vector<std::size_t> per_slot(arrays, 0);  // the master's bytes, then each slot's
  for (const ParamSpec& p : config.params) {
    const std::size_t gb = p.gradient_buffer ? p.numel * dtype_size(p.grad_dtype) : 0;
    const std::size_t cb = owns_compute(p) ? p.numel * dtype_size(p.compute_dtype) : 0;
    dev.insert(dev.end(), {gb, p.numel * sizeof(float), cb});
    const std::vector<std::size_t> views = state_views(p);
    if (!streamed) dev.insert(dev.end(), views.begin(), views.end());
    for (std::size_t k = 0; k < views.size(); ++k) per_slot[(k + 1) / 2] += aligned(views[k]);
    grads += aligned(gb);
    accs += aligned(p.numel * sizeof(float));
    computes += aligned(cb);
  }
  std::size_t state = 0;
  for (std::size_t b : per_slot) state += b;
  dev.insert(dev.end(), {sizeof(StepScalars),
                         config.q8_state ? detail::kQ8ImageWords * sizeof(std::uint32_t) : 0,
                         sizeof(float) * n, sizeof(StepHyper) * ngroups});
  // The groups' distinct non-empty tables (AdamW's and Adam's bias corrections).
  std::vector<std::vector<double>> tables;
  for (std::size_t g = 0; g < ngroups; ++g) {
    const ParamGroup group =
        config.groups.empty() ? detail::default_group(config.optimizer) : config.groups[g];
    std::vector<double> t =
        gpu::make_optimizer_table(detail::group_config(config.optimizer, group));
    if (!t.empty() && std::find(tables.begin(), tables.end(), t) == tables.end())
      tables.push_back(std::move(t));
  }
  for (const auto& t : tables) dev.push_back(sizeof(double) * t.size());
  host.insert(host.end(), {sizeof(HostWords), sizeof(StepHyper) * ngroups});
  std::size_t block_max = 0;
  if (streamed)
    for (const auto& [first, last] : chunks) {  // a chunk's block: its arrays, slot-major
      std::vector<std::size_t> block;
      for (std::size_t i = first; i < last; ++i) {  // (every view aligned: any order)
        const std::vector<std::size_t> views = state_views(config.params[i]);
        block.insert(block.end(), views.begin(), views.end());
      }
      const std::size_t total = layout_slab(block).total_bytes;
      host.push_back(total);
      block_max = std::max(block_max, total);
    }
  const std::size_t nslots = streamed ? std::min(kStreamingSlots, chunks.size()) : 0;
  dev.insert(dev.end(), nslots, block_max);
  const std::size_t streaming = nslots * aligned(block_max);

  // The norm workspace: the largest of every set of accumulators a norm runs over.
  auto workspace = [&](auto&& member) {
    std::vector<TensorView> views;
    for (std::size_t i = 0; i < n; ++i)
      if (member(i)) views.push_back(TensorView{nullptr, config.params[i].numel, DType::f32});
    return config.device != nullptr ? config.device->norm_workspace_bytes(views)
                                    : gpu::scale_and_norm_workspace_bytes(views);
  };
  std::size_t ws =
      std::max({workspace([](std::size_t) { return true; }),
                workspace([&](std::size_t i) { return config.params[i].counts_toward_norm; }),
                workspace([&](std::size_t i) { return !config.params[i].counts_toward_norm; })});
  for (const auto& chunk : chunks)
    ws = std::max(
        ws, workspace([&chunk](std::size_t i) { return i >= chunk.first && i < chunk.second; }));

  // The rollback space: per chunk its counters, per parameter its arrays and compute weights.
  std::size_t rollback = 0;
  if (reserves_rollback(config, options)) {
    const bool counts = optimizer_counts_steps(config.optimizer);
    std::size_t need = 0;
    for (const auto& [first, last] : chunks) {
      if (counts) need += aligned(sizeof(float) * (last - first));
      for (std::size_t i = first; i < last; ++i) {
        const ParamSpec& p = config.params[i];
        for (std::size_t bytes : state_views(p)) need += aligned(bytes);
        need += aligned(p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0);
      }
    }
    rollback = std::min(need, budget(config.speculation_bytes));
  }

  auto rest = [](std::size_t total, std::size_t named) {
    return total > named ? total - named : 0;
  };
  Plan plan;
  plan.add("master", !streamed, per_slot[0]);
  for (std::size_t k = 0; k < slot_names.size(); ++k)
    plan.add(std::string(slot_names[k]), !streamed, per_slot[1 + k]);
  plan.add("accumulator", true, accs);
  plan.add("gradient", true, grads);
  plan.add("compute", true, computes);
  plan.add("streaming", true, streaming);
  plan.add(
      "scalars", true,
      rest(slab_bytes(dev) + ws, grads + accs + computes + streaming + (streamed ? 0 : state)));
  plan.add("scalars", false, rest(slab_bytes(host), streamed ? state : 0));
  plan.add("speculation", true, rollback);
  return plan.finish(options.checkpoint);
}

}  // namespace

CheckpointPhase parse_checkpoint_phase(std::string_view name) {
  if (name == "none") return CheckpointPhase::none;
  if (name == "save") return CheckpointPhase::save;
  if (name == "load") return CheckpointPhase::load;
  throw Error(Errc::invalid_argument, "checkpoint",
              "'" + std::string(name) + "': one of none, save, load");
}

MemoryReport plan_memory(const ManagerConfig& config, const MemoryPlanOptions& options) {
  if (options.micro_batches == 0)
    throw Error(Errc::out_of_range, "micro_batches", "a step has >= 1 micro-batches");
  if (options.checkpoint != CheckpointPhase::none && options.checkpoint != CheckpointPhase::save &&
      options.checkpoint != CheckpointPhase::load)
    throw Error(Errc::invalid_argument, "checkpoint", "not a CheckpointPhase");
  validate(config);
  return config.mode == OffloadMode::full ? plan_full(config, options)
                                          : plan_device(config, options);
}

std::uint64_t model_param_numel(const ModelParam& p, const std::string& argument) {
  std::uint64_t n = 1;
  for (std::uint64_t d : p.shape)
    if (__builtin_mul_overflow(n, d, &n))
      throw Error(Errc::out_of_range, argument + ".shape", "its element count overflows 64 bits");
  return n;
}

std::vector<ModelParam> model_of_count(std::uint64_t count, DType dtype) {
  std::vector<ModelParam> out;
  for (std::uint64_t at = 0, k = 0; at < count; at += kCountTensorElements, ++k)
    out.push_back(ModelParam{
        "params[" + std::to_string(k) + "]", {std::min(kCountTensorElements, count - at)}, dtype});
  return out;
}

ModelPlan plan_model(const ModelPlanRequest& request) {
  if (request.ranks == 0) throw Error(Errc::out_of_range, "ranks", "a model is on >= 1 ranks");
  if (request.ranks_per_node == 0 || request.ranks_per_node > request.ranks)
    throw Error(Errc::out_of_range, "ranks_per_node",
                std::to_string(request.ranks_per_node) + ": between 1 and ranks (" +
                    std::to_string(request.ranks) + ")");
  ModelPlan plan;
  ManagerConfig config = request.manager;
  config.device = nullptr;
  config.params.clear();
  config.params.reserve(request.model.size());
  constexpr std::uintptr_t kStandInBase = std::uintptr_t{1} << 12;
  std::uintptr_t stand_in = 0;
  for (std::size_t i = 0; i < request.model.size(); ++i) {
    const ModelParam& p = request.model[i];
    const std::uint64_t numel = model_param_numel(p, "model[" + std::to_string(i) + "]");
    if (numel > SIZE_MAX / 8)
      throw Error(Errc::out_of_range, "model[" + std::to_string(i) + "].shape",
                  "too many elements to address");
    const std::uint64_t shard = (numel + request.ranks - 1) / request.ranks;  // rank 0's
    ParamSpec spec;
    spec.name = p.name;
    spec.numel = static_cast<std::size_t>(shard);
    spec.grad_dtype = spec.compute_dtype = p.dtype;
    if (request.trainer_buffers) {
      spec.gradient_buffer = false;
      // The model's storage, at stand-in addresses (the planner never reads them: only
      // that a destination is set, aligned and apart from the others).
      if (spec.numel != 0) {
        spec.compute_into = {reinterpret_cast<void*>(kStandInBase + stand_in), spec.numel, p.dtype};
        stand_in += (spec.numel * dtype_size(p.dtype) + 255) / 256 * 256;
      }
    }
    config.params.push_back(std::move(spec));
    if (__builtin_add_overflow(plan.model_params, numel, &plan.model_params))
      throw Error(Errc::out_of_range, "model", "its element count overflows 64 bits");
    plan.params_per_rank += shard;
  }
  plan.tensors = request.model.size();
  plan.rank = plan_memory(config, request.options);
  if (__builtin_mul_overflow(std::uint64_t{plan.rank.host_peak}, request.ranks_per_node,
                             &plan.node_host_peak))
    throw Error(Errc::out_of_range, "ranks_per_node", "the node's bytes overflow 64 bits");
  if (request.host_memory) plan.fits_host = plan.node_host_peak <= *request.host_memory;
  if (request.gpu_memory) plan.fits_gpu = plan.rank.device_peak <= *request.gpu_memory;
  return plan;
}

}  // namespace stepcore
