// GpuGradientManager (managers/gpu_manager.hpp): construction (the bias tables, the
// memory plan of both slabs, their allocation, the device constants), where each state
// array lives, the state's import and export, and close.
#include "managers/gpu_manager.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/q8.hpp"  // kQ8ImageWords
#include "managers/common.hpp"
#include "managers/device_step.hpp"
#include "managers/factories.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"

namespace stepcore::detail {

using device::Queue;

GpuGradientManager::GpuGradientManager(ManagerConfig config)
    : ManagerImpl(std::move(config)), dev_(*this->config().device) {
  const ManagerConfig& cfg = this->config();
  if (cfg.mode != OffloadMode::none && cfg.mode != OffloadMode::optimizer)
    throw Error(Errc::invalid_argument, "mode", "the device manager implements none and optimizer");
  // SignSGD takes the sign of the raw accumulator (the read is not applied); scaling it in
  // place could flush a tiny value to zero, so SignSGD always reads lazily.
  eager_ = !cfg.lazy_gpu_scale && shape().reads_scaled;
  // The caller's compute destinations, which the step's kernels write: memory of this
  // device, checked once here rather than refused by the first step's launch.
  for (std::size_t i = 0; i < cfg.params.size(); ++i)
    if (const TensorView& d = cfg.params[i].compute_into; d.numel != 0)
      dev_.check_memory(d.data, d.bytes(), "params[" + std::to_string(i) + "].compute_into");
  params_.resize(cfg.params.size());
  accumulated_.assign(cfg.params.size(), 0);
  accumulate_plans_.resize(cfg.params.size());
  // The bias tables first: they may refuse a beta too close to 1, before any memory.
  const BiasTables bias = make_bias_tables();
  const MemoryPlan plan = plan_memory(bias);
  try {
    allocate_memory(plan);
    account_memory(plan);
    set_up_step(plan, bias);
  } catch (...) {
    free_memory();
    throw;
  }
}

GpuGradientManager::BiasTables GpuGradientManager::make_bias_tables() const {
  BiasTables bias;
  const std::size_t ngroups = groups().size();
  bias.of.assign(ngroups, 0);
  const std::string opt_prefix = "optimizer." + std::string(shape().name) + ".";
  for (std::size_t g = 0; g < ngroups; ++g) {
    std::vector<double> table;
    with_group_names(config().groups.empty() ? opt_prefix : "groups[" + std::to_string(g) + "].",
                     opt_prefix, has_betas(config().optimizer),
                     [&] { table = device_step_table(group_config(g)); });
    if (table.empty()) continue;
    std::size_t t = 0;
    while (t < bias.tables.size() && bias.tables[t] != table) ++t;
    if (t == bias.tables.size()) bias.tables.push_back(std::move(table));
    bias.of[g] = t;
  }
  return bias;
}

GpuGradientManager::MemoryPlan GpuGradientManager::plan_memory(const BiasTables& bias) {
  const ManagerConfig& cfg = config();
  const std::size_t n = cfg.params.size();
  const std::size_t nchunks = chunks().size();
  const std::size_t ngroups = groups().size();
  MemoryPlan plan;
  plan.param.resize(n);
  std::vector<MemoryPlan::Views>& view = plan.param;

  // Device views: per parameter grad, acc, compute (and master, m, v in mode none); the
  // scalars; mode optimizer: the ring of slots, each as large as the largest chunk block.
  SlabViews dev_views;
  for (std::size_t i = 0; i < n; ++i) {
    const ParamSpec& p = cfg.params[i];
    view[i].grad = dev_views.add(p.gradient_buffer ? p.numel * dtype_size(p.grad_dtype) : 0);
    view[i].acc = dev_views.add(p.numel * 4);
    const bool own_compute =
        p.has_compute_weights && p.compute_into.data == nullptr && p.compute_into.numel == 0;
    view[i].compute = dev_views.add(own_compute ? p.numel * dtype_size(p.compute_dtype) : 0);
    params_[i].q8 = q8_param(i);
    if (!streamed())
      for (std::size_t s = 0; s < slots(); ++s) {
        view[i].state[s] = dev_views.add(array_bytes(i, s));
        if (s != 0) view[i].absmax[s - 1] = dev_views.add(absmax_bytes(i));
      }
  }
  plan.scalars = dev_views.add(sizeof(StepScalars));
  plan.codebooks = dev_views.add(cfg.q8_state ? kQ8ImageWords * sizeof(std::uint32_t) : 0);
  plan.steps = dev_views.add(sizeof(float) * n);
  plan.hyper = dev_views.add(sizeof(StepHyper) * ngroups);
  for (const auto& table : bias.tables)
    plan.bias.push_back(dev_views.add(sizeof(double) * table.size()));
  plan.bias_of = bias.of;

  // Host views: the words and flags, then (mode optimizer) each chunk's block: its
  // parameters' masters, then their first state slot, and so on (a slab of its own, moved
  // in one copy).
  SlabViews host_views;
  plan.words = host_views.add(sizeof(HostWords));
  plan.host_hyper = host_views.add(sizeof(StepHyper) * ngroups);
  plan.chunk_host.assign(nchunks, 0);
  std::size_t slot_bytes = 0;
  if (streamed()) {
    chunk_bytes_.assign(nchunks, 0);
    for (std::size_t k = 0; k < nchunks; ++k) {
      const Chunk& c = chunks()[k];
      SlabViews block;
      for (std::size_t s = 0; s < slots(); ++s)
        for (std::size_t i = c.first; i < c.last; ++i) {
          view[i].state[s] = block.add(array_bytes(i, s));
          if (s != 0) view[i].absmax[s - 1] = block.add(absmax_bytes(i));
        }
      const SlabLayout bl = block.layout();
      for (std::size_t i = c.first; i < c.last; ++i)
        for (std::size_t s = 0; s < slots(); ++s) {
          params_[i].off[s] = bl.offsets[view[i].state[s]];
          if (s != 0) params_[i].max_off[s - 1] = bl.offsets[view[i].absmax[s - 1]];
        }
      chunk_bytes_[k] = bl.total_bytes;
      plan.chunk_host[k] = host_views.add(bl.total_bytes);
      slot_bytes = std::max(slot_bytes, bl.total_bytes);
    }
  }
  const std::size_t nslots = streamed() ? std::min(kRingSlots, nchunks) : 0;
  plan.slots.resize(nslots);
  for (std::size_t j = 0; j < nslots; ++j) plan.slots[j] = dev_views.add(slot_bytes);
  plan.device = dev_views.layout();
  plan.host = host_views.layout();
  return plan;
}

void GpuGradientManager::allocate_memory(const MemoryPlan& plan) {
  const ManagerConfig& cfg = config();
  const std::size_t n = cfg.params.size();
  const std::size_t nchunks = chunks().size();
  dmem_ = static_cast<std::byte*>(dev_.allocate(slab_allocation_bytes(plan.device)));
  hmem_ =
      static_cast<std::byte*>(dev_.allocate_host(slab_allocation_bytes(plan.host), cfg.numa_node));
  auto dev_at = [&](std::size_t v) { return dmem_ + plan.device.offsets[v]; };
  auto host_at = [&](std::size_t v) { return hmem_ + plan.host.offsets[v]; };
  d_ = reinterpret_cast<StepScalars*>(dev_at(plan.scalars));
  d_steps_ = reinterpret_cast<float*>(dev_at(plan.steps));
  d_hyper_ = reinterpret_cast<StepHyper*>(dev_at(plan.hyper));
  h_hyper_ = reinterpret_cast<StepHyper*>(host_at(plan.host_hyper));
  for (std::size_t g = 0; g < groups().size(); ++g)
    d_bias_.push_back(plan.bias.empty()
                          ? nullptr
                          : reinterpret_cast<const double*>(dev_at(plan.bias[plan.bias_of[g]])));
  h_ = reinterpret_cast<HostWords*>(host_at(plan.words));
  if (cfg.q8_state) d_codebooks_ = reinterpret_cast<const std::uint32_t*>(dev_at(plan.codebooks));
  for (std::size_t k = 0; k < nchunks && streamed(); ++k)
    chunk_host_.push_back(host_at(plan.chunk_host[k]));
  for (std::size_t v : plan.slots) slots_.push_back(dev_at(v));

  for (std::size_t i = 0; i < n; ++i) {
    const ParamSpec& p = cfg.params[i];
    const MemoryPlan::Views& view = plan.param[i];
    Param& q = params_[i];
    if (p.gradient_buffer) q.grad = {dev_at(view.grad), p.numel, p.grad_dtype};
    q.acc = {dev_at(view.acc), p.numel, DType::f32};
    if (p.compute_into.data != nullptr || p.compute_into.numel != 0)
      q.compute = p.compute_into;  // the caller's storage (validated by the base)
    else if (p.has_compute_weights)
      q.compute = {dev_at(view.compute), p.numel, p.compute_dtype};
    if (streamed()) {
      std::byte* block = chunk_host_[chunk_of(i)];
      for (std::size_t s = 0; s < slots(); ++s) {
        q.state[s] = reinterpret_cast<float*>(block + q.off[s]);
        if (s != 0 && q.q8) q.absmax[s - 1] = reinterpret_cast<float*>(block + q.max_off[s - 1]);
      }
    } else {
      for (std::size_t s = 0; s < slots(); ++s) {
        q.state[s] = reinterpret_cast<float*>(dev_at(view.state[s]));
        if (s != 0 && q.q8) q.absmax[s - 1] = reinterpret_cast<float*>(dev_at(view.absmax[s - 1]));
      }
    }
    (p.counts_toward_norm ? counted_ : uncounted_).push_back(q.acc);
    if (p.counts_toward_norm) counted_const_.push_back(q.acc);
  }

  // One norm workspace, large enough for every set of accumulators a norm runs over.
  std::vector<TensorView> all;
  for (const Param& q : params_) all.push_back(q.acc);
  workspace_bytes_ = std::max({dev_.norm_workspace_bytes(all), dev_.norm_workspace_bytes(counted_),
                               dev_.norm_workspace_bytes(uncounted_)});
  for (std::size_t k = 0; k < nchunks; ++k) {
    std::vector<TensorView> views;
    for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i)
      views.push_back(params_[i].acc);
    workspace_bytes_ = std::max(workspace_bytes_, dev_.norm_workspace_bytes(views));
  }
  if (workspace_bytes_ != 0) workspace_ = dev_.allocate(workspace_bytes_);
}

void GpuGradientManager::account_memory(const MemoryPlan& plan) {
  const ManagerConfig& cfg = config();
  std::size_t grads = 0, accs = 0, computes = 0;
  std::vector<std::size_t> per_slot(slots(), 0);  // the master, then each slot (8-bit: codes
                                                  // and maxima)
  for (std::size_t i = 0; i < cfg.params.size(); ++i) {
    const ParamSpec& p = cfg.params[i];
    if (p.gradient_buffer) grads += aligned_bytes(p.numel * dtype_size(p.grad_dtype));
    accs += aligned_bytes(p.numel * sizeof(float));
    if (p.has_compute_weights && p.compute_into.data == nullptr && p.compute_into.numel == 0)
      computes += aligned_bytes(p.numel * dtype_size(p.compute_dtype));
    for (std::size_t s = 0; s < slots(); ++s)
      per_slot[s] +=
          aligned_bytes(array_bytes(i, s)) + (s != 0 ? aligned_bytes(absmax_bytes(i)) : 0);
  }
  std::size_t state = 0;
  for (std::size_t b : per_slot) state += b;
  std::size_t streaming = 0;
  for (std::size_t k = 0; k < plan.slots.size(); ++k)
    streaming += aligned_bytes(*std::max_element(chunk_bytes_.begin(), chunk_bytes_.end()));
  const bool on_device = !streamed();
  MemoryLedger& book = ledger();
  for (std::size_t s = 0; s < slots(); ++s)
    book.set(s == 0 ? std::string_view("master") : shape().slot_names[s - 1], on_device,
             per_slot[s]);
  book.set("accumulator", true, accs);
  book.set("gradient", true, grads);
  book.set("compute", true, computes);
  book.set("streaming", true, streaming);
  // The rest of each slab (scalars, counters, hyper-parameters, bias tables, flags) and
  // the norm workspace.
  auto rest = [](std::size_t total, std::size_t named) {
    return total > named ? total - named : 0;
  };
  const std::size_t dev_total = slab_allocation_bytes(plan.device) + workspace_bytes_;
  book.set("scalars", true,
           rest(dev_total, grads + accs + computes + streaming + (on_device ? state : 0)));
  book.set("scalars", false, rest(slab_allocation_bytes(plan.host), on_device ? 0 : state));
  book.set("speculation", true, 0);
}

void GpuGradientManager::set_up_step(const MemoryPlan& plan, const BiasTables& bias) {
  const ManagerConfig& cfg = config();
  // The ring's slots start free; no chunk is speculated yet.
  slot_free_.resize(plan.slots.size());
  speculated_.assign(chunks().size(), 0);
  spec_.resize(cfg.params.size());

  // Constants: 1.0f and this rank's layout record (reduced in place with max, so a
  // consistent layout leaves it unchanged and it is written once).
  h_->one = 1.0f;
  h_->check = comm::make_layout_check(cfg.layout_fingerprint);
  dev_.copy(Queue::compute, &d_->one, &h_->one, sizeof(float));
  dev_.copy(Queue::compute, &d_->summary.check, &h_->check, sizeof(comm::LayoutCheck));
  // The groups' hyper-parameters (ensure_hyper keeps them current) and the bias
  // tables, read by every step's kernels.
  for (std::size_t t = 0; t < bias.tables.size(); ++t)
    dev_.copy(Queue::compute, dmem_ + plan.device.offsets[plan.bias[t]], bias.tables[t].data(),
              sizeof(double) * bias.tables[t].size());
  hyper_uploaded_ = hyper_version() + 1;  // differs: the first ensure_hyper uploads
  ensure_hyper();
  // The 8-bit codebooks the step's kernels read (q8_state).
  std::vector<std::uint32_t> codebooks;
  if (d_codebooks_ != nullptr) {
    codebooks = gpu::q8_codebooks();
    dev_.copy(Queue::compute, const_cast<std::uint32_t*>(d_codebooks_), codebooks.data(),
              codebooks.size() * sizeof(std::uint32_t));
  }
  dev_.synchronize();  // the sources are this frame's memory
}

GpuGradientManager::~GpuGradientManager() {
  if (!closed_) (void)do_close();
}

void GpuGradientManager::free_memory() noexcept {
  if (spare_ != nullptr) dev_.deallocate(spare_);
  spare_ = nullptr;
  if (workspace_ != nullptr) dev_.deallocate(workspace_);
  if (dmem_ != nullptr) dev_.deallocate(dmem_);
  if (hmem_ != nullptr) dev_.deallocate_host(hmem_);
  workspace_ = nullptr;
  dmem_ = nullptr;
  hmem_ = nullptr;
}

float* GpuGradientManager::state_at(std::size_t i, std::size_t s, std::byte* slot) const {
  const Param& q = params_[i];
  return slot != nullptr ? reinterpret_cast<float*>(slot + q.off[s]) : q.state[s];
}

float* GpuGradientManager::absmax_at(std::size_t i, std::size_t s, std::byte* slot) const {
  const Param& q = params_[i];
  return slot != nullptr ? reinterpret_cast<float*>(slot + q.max_off[s]) : q.absmax[s];
}

std::size_t GpuGradientManager::array_bytes(std::size_t i, std::size_t s) const {
  const std::size_t n = config().params[i].numel;
  return s != 0 && params_[i].q8 ? n : n * sizeof(float);
}

std::size_t GpuGradientManager::absmax_bytes(std::size_t i) const {
  return params_[i].q8 ? q8_blocks(config().params[i].numel) * sizeof(float) : 0;
}

// Copies `bytes` bytes from host memory to where a state array lives (the device in mode
// none, the host block in mode optimizer), or back; `src` null: zeros.
void GpuGradientManager::put_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (streamed()) {
    if (src == nullptr)
      std::memset(dst, 0, bytes);
    else
      std::memcpy(dst, src, bytes);
  } else if (src == nullptr) {
    dev_.zero(Queue::compute, dst, bytes);
  } else {
    dev_.copy(Queue::compute, dst, src, bytes);
  }
}

void GpuGradientManager::get_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (streamed())
    std::memcpy(dst, src, bytes);
  else
    dev_.copy(Queue::compute, dst, src, bytes);
}

void GpuGradientManager::do_import_parameter(std::size_t i, Arrays<const float> arrays, Q8In q8,
                                             float step) {
  wait_idle();
  const ParamSpec& p = config().params[i];
  Param& q = params_[i];
  const std::size_t bytes = p.numel * 4;
  // Initial values other than +0, as host arrays (alive until the copies are waited for).
  std::vector<std::vector<float>> initial;
  std::vector<std::vector<std::uint8_t>> zero_codes;
  // One array: the caller's values, or (empty: load_parameter) the slot's initial value.
  auto put = [&](float* dst, std::span<const float> src, float init) {
    if (bytes == 0) return;
    if (src.empty() && std::bit_cast<std::uint32_t>(init) != 0) {
      initial.emplace_back(p.numel, init);
      src = initial.back();
    }
    put_bytes(dst, src.empty() ? nullptr : src.data(), bytes);
  };
  for (std::size_t s = 0; s < slots(); ++s) {
    if (s == 0 || !q.q8) {
      put(q.state[s], arrays[s], s == 0 ? 0.0f : initial_slot_value(s - 1));
      continue;
    }
    // An 8-bit slot: the caller's codes and maxima, or 0 (the zero code, maxima 0).
    const std::size_t k = s - 1;
    if (!q8.empty() && !q8[k].codes.empty()) {
      put_bytes(q.state[s], q8[k].codes.data(), p.numel);
      put_bytes(q.absmax[k], q8[k].absmax.data(), q8[k].absmax.size_bytes());
    } else {
      zero_codes.emplace_back(p.numel,
                              q8_zero_code(slot_non_negative(shape().name, shape().slot_names[k])));
      put_bytes(q.state[s], zero_codes.back().data(), p.numel);
      put_bytes(q.absmax[k], nullptr, absmax_bytes(i));
    }
  }
  if (counts()) dev_.copy(Queue::compute, d_steps_ + i, &step, sizeof(float));
  const std::span<const float> master = arrays[0];
  std::vector<std::uint8_t> rounded;
  if (p.has_compute_weights) {
    rounded.resize(q.compute.bytes());
    round_into(master, TensorView{rounded.data(), p.numel, p.compute_dtype});
    dev_.copy(Queue::compute, q.compute.data, rounded.data(), rounded.size());
  }
  wait_all();  // the sources are the caller's and this frame's memory
}

void GpuGradientManager::do_import_range(std::size_t i, std::size_t offset,
                                         Arrays<const float> arrays, float step, bool last) {
  wait_idle();
  const ParamSpec& p = config().params[i];
  const Param& q = params_[i];
  for (std::size_t s = 0; s < slots(); ++s)
    if (!arrays[s].empty())
      put_bytes(q.state[s] + offset, arrays[s].data(), arrays[s].size_bytes());
  if (last && counts()) dev_.copy(Queue::compute, d_steps_ + i, &step, sizeof(float));
  // The compute weights' range: the master's range rounded (at most one range's bytes).
  const std::span<const float> master = arrays[0];
  std::vector<std::uint8_t> rounded;
  if (p.has_compute_weights && !master.empty()) {
    const std::size_t width = dtype_size(p.compute_dtype);
    rounded.resize(master.size() * width);
    round_into(master, TensorView{rounded.data(), master.size(), p.compute_dtype});
    dev_.copy(Queue::compute, static_cast<std::byte*>(q.compute.data) + offset * width,
              rounded.data(), rounded.size());
  }
  wait_all();  // the sources are the caller's and this frame's memory
}

ConstTensorView GpuGradientManager::do_compute_weights(std::size_t i) const {
  const Param& q = params_[i];
  if (config().params[i].has_compute_weights) return q.compute;
  // No compute copy: the master is used (device memory in mode none only).
  if (!streamed()) return ConstTensorView(q.master(), q.acc.numel, DType::f32);
  return {};
}

void GpuGradientManager::do_read_parameter(std::size_t i, Arrays<float> arrays, Q8Out q8,
                                           std::span<std::uint8_t> compute) {
  wait_idle();
  const Param& q = params_[i];
  for (std::size_t s = 0; s < slots(); ++s)
    if (!arrays[s].empty()) get_bytes(arrays[s].data(), q.state[s], arrays[s].size_bytes());
  for (std::size_t k = 0; k < q8.size(); ++k) {
    if (!q8[k].codes.empty()) get_bytes(q8[k].codes.data(), q.state[1 + k], q8[k].codes.size());
    if (!q8[k].absmax.empty())
      get_bytes(q8[k].absmax.data(), q.absmax[k], q8[k].absmax.size_bytes());
  }
  if (!compute.empty()) dev_.copy(Queue::compute, compute.data(), q.compute.data, compute.size());
  wait_all();
}

void GpuGradientManager::do_read_range(std::size_t i, std::size_t offset, Arrays<float> arrays) {
  wait_idle();
  const Param& q = params_[i];
  for (std::size_t s = 0; s < slots(); ++s)
    if (!arrays[s].empty())
      get_bytes(arrays[s].data(), q.state[s] + offset, arrays[s].size_bytes());
  wait_all();
}

void GpuGradientManager::do_read_q8_range(std::size_t i, std::size_t s, bool absmax,
                                          std::size_t offset, std::span<std::byte> out) {
  wait_idle();
  const Param& q = params_[i];
  if (absmax)
    get_bytes(out.data(), q.absmax[s] + offset, out.size());
  else
    get_bytes(out.data(), reinterpret_cast<const std::byte*>(q.state[1 + s]) + offset, out.size());
  wait_all();
}

void GpuGradientManager::do_import_q8_range(std::size_t i, std::size_t s, bool absmax,
                                            std::size_t offset, std::span<const std::byte> bytes) {
  wait_idle();
  const Param& q = params_[i];
  if (absmax)
    put_bytes(q.absmax[s] + offset, bytes.data(), bytes.size());
  else
    put_bytes(reinterpret_cast<std::byte*>(q.state[1 + s]) + offset, bytes.data(), bytes.size());
  wait_all();  // the source is the caller's
}

void GpuGradientManager::do_step_counts(std::span<float> out) {
  wait_idle();
  if (counts() && !out.empty()) dev_.copy(Queue::compute, out.data(), d_steps_, out.size_bytes());
  if (!counts()) std::fill(out.begin(), out.end(), 0.0f);
  wait_all();
}

ManagerImpl::HostArrays GpuGradientManager::do_host_state(std::size_t i) {
  wait_idle();
  if (!streamed()) return {};  // device memory
  const Param& q = params_[i];
  const std::size_t n = config().params[i].numel;
  HostArrays h;
  for (std::size_t s = 0; s < slots(); ++s) {
    if (s == 0 || !q.q8) {
      h.a[s] = {q.state[s], n};
      continue;
    }
    h.q8[s - 1] = {{reinterpret_cast<const std::uint8_t*>(q.state[s]), n},
                   {q.absmax[s - 1], q8_blocks(n)}};
  }
  return h;
}

void GpuGradientManager::do_synchronize() { wait_idle(); }

std::exception_ptr GpuGradientManager::do_close() noexcept {
  if (closed_) return nullptr;
  closed_ = true;
  std::exception_ptr error;
  try {
    settle();
  } catch (...) {
    error = std::current_exception();
  }
  try {
    wait_all();
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  free_memory();
  return error;
}

std::unique_ptr<ManagerImpl> make_gpu_gradient_manager(ManagerConfig config) {
  return std::make_unique<GpuGradientManager>(std::move(config));
}

}  // namespace stepcore::detail
