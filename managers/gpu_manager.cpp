// The device-resident gradient managers: mode "none" (gradients, accumulators, masters and
// the optimizer's state slots in device memory) and mode "optimizer" (the same, with the optimizer
// state in host memory streamed through a ring of device slots chunk by chunk). Everything goes
// through device::Device; docs/managers.md is the contract.
//
// Design: memory is allocated once (one device block of 256-byte aligned views,
// one norm workspace, one pinned host block holding the flag words and, in mode
// optimizer, each chunk's masters|slot 0|slot 1.. laid out contiguously so a chunk moves
// in one copy). The optimizer step goes through managers/device_step.hpp, the one place
// that meets the device's optimizer calls.
// A step never waits on the host except in clip_grad_norm, which must return the norm.
// Without it, the found-inf flag travels to a pinned word behind the step's work. The
// per-step scalars live in device memory (step counters, lr and weight decay per
// weight-decay group, the bias table): the kernels read them when they run, and a
// skipped step leaves the counters as they were, so nothing is rolled back on the host.
//
// Speculation (overlapped steps): a chunk admitted by the rollback budget (device memory,
// carved afresh each step) is stepped out of place as if the coefficient were 1 and the
// step finite: it reads its state where it lives (device memory, or the ring slot its
// host block was uploaded to) and writes the new state, its step counters and compute
// weights into the rollback space; nothing the step started from is written. The
// decision (which needs the norm on the host: clip_grad_norm, or step()'s one wait)
// commits it (the rollback space copied over the state — downloaded to the host block in
// mode optimizer — and the compute weights) or drops it: the state is still the step's
// old one, which the step then updates with the coefficient (or leaves, when skipped).
//
// Ordering with the trainer: gradient_ready(i, written) makes the compute queue wait for
// `written` before reading the gradient; gradient_released(i) is the compute-queue event
// after that read. Every host wait goes through wait_for(), which with a device-memory
// communicator (NCCL) first waits on the communicator with its timeout, so a dead peer
// raises Errc::timeout instead of hanging an event wait.
#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "managers/common.hpp"
#include "managers/device_step.hpp"
#include "managers/factories.hpp"
#include "managers/manager_impl.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {
namespace {

using device::Event;
using device::Queue;

constexpr std::size_t kRingSlots = 3;  // upload k+1, step k, download k-1 at once
// Returns `bytes` rounded up to the views' alignment (each rollback array starts aligned).
constexpr std::size_t align_up(std::size_t bytes) {
  return (bytes + kSlabViewAlignment - 1) / kSlabViewAlignment * kSlabViewAlignment;
}
// max_norm of the finalizations that only need the norm and found-inf flag (no clipping:
// the update then reads the constant 1, whatever clip this writes).
constexpr float kNoClipMaxNorm = 1.0f;

// The step's norm, clip, found-inf flag and reduced layout record: written on the device,
// copied to the host in one piece.
struct Summary {
  comm::LayoutCheck check;
  NormResult result;
  float clip;
  std::int32_t found_inf;
};

// Device scalars of a step.
struct StepScalars {
  NormPartial partial;  // counted accumulators (reduced over ranks)
  NormPartial exact;    // the exact fallback (reduced over ranks)
  NormPartial scratch;  // eager scaling of the non-counted accumulators (discarded)
  Summary summary;
  float scale;        // the step's gradient scale, read by the step's kernels
  float one;          // constant 1.0f
  std::int32_t zero;  // constant 0 (allocate() zero-fills; never written): "finite"
};

// Pinned host words the device copies to and from.
struct HostWords {
  Summary summary;
  float scale;
  float one;
  comm::LayoutCheck check;
};

class GpuGradientManager final : public ManagerImpl {
 public:
  explicit GpuGradientManager(ManagerConfig config);
  ~GpuGradientManager() override;

 protected:
  void do_import_parameter(std::size_t i, Arrays<const float> arrays, float step) override;
  void do_begin_step() override;
  void do_begin_backward() override {}
  TensorView do_gradient(std::size_t i) override { return params_[i].grad; }
  void do_gradient_ready(std::size_t i, bool first_in_step, ConstTensorView grad,
                         const Event& written) override;
  // The compute queue is in order: an event recorded now follows the accumulation of i's
  // last gradient (and whatever came after it), so no event is made per gradient.
  Event do_gradient_released(std::size_t i) const override {
    return accumulated_[i] ? dev_.record(Queue::compute) : Event();
  }
  void do_finish_final_backward(std::span<const std::size_t> no_gradient) override;
  void do_step_chunk(std::size_t chunk) override;
  void do_reserve_speculation() override;
  NormResult do_clip_grad_norm(float max_norm, float& clip) override;
  void do_step() override;
  StepReport do_report() override;
  ConstTensorView do_compute_weights(std::size_t i) const override;
  void do_read_parameter(std::size_t i, Arrays<float> arrays,
                         std::span<std::uint8_t> compute) override;
  void do_step_counts(std::span<float> out) override;
  HostArrays do_host_state(std::size_t i) override;
  void do_synchronize() override;
  void do_recover() override;
  std::exception_ptr do_close() noexcept override;

 private:
  static constexpr std::size_t kMaxSlots = 1 + kMaxOptimizerSlots;
  // One parameter's buffers. state: the master, then the optimizer's state slots, in
  // device memory (mode none) or the host block of its chunk (mode optimizer); off:
  // their offsets in that block.
  struct Param {
    TensorView grad, acc, compute;
    float* state[kMaxSlots] = {};
    std::size_t off[kMaxSlots] = {};
    float* master() const { return state[0]; }
  };

  // The groups' device step tables (device_step_table: AdamW's bias corrections): one
  // per distinct table (tables), and each group's index into them (of).
  struct BiasTables {
    std::vector<std::vector<double>> tables;
    std::vector<std::size_t> of;
  };
  // Where everything the manager holds lives: view indices into the device slab (device)
  // and the pinned host slab (host), and the two layouts. Sizes only, no memory.
  struct MemoryPlan {
    struct Views {  // one parameter's device views (the state slots only in mode none)
      std::size_t grad = 0, acc = 0, compute = 0, state[kMaxSlots] = {};
    };
    std::vector<Views> param;
    std::size_t scalars = 0, steps = 0, hyper = 0;  // device: StepScalars, counters, hyper
    std::vector<std::size_t> bias;                  // device: one per distinct bias table
    std::vector<std::size_t> bias_of;               // per group: its index into bias
    std::vector<std::size_t> slots;                 // device: mode optimizer's ring
    std::size_t words = 0, host_hyper = 0;          // host: HostWords, the hyper staging
    std::vector<std::size_t> chunk_host;            // host: mode optimizer's chunk blocks
    SlabLayout device, host;
  };

  bool streamed() const noexcept { return mode() == OffloadMode::optimizer; }
  // The constructor's parts, in order. make_bias_tables refuses a beta too close to 1
  // (before any memory); plan_memory lays out both slabs and (mode optimizer) each
  // chunk's host block, recording the parameters' offsets in them and chunk_bytes_;
  // allocate_memory allocates the slabs and the norm workspace and points every view
  // (and the kernels' lists of accumulators) into them; set_up_step starts the step
  // bookkeeping (ring, speculation) and uploads the device constants (layout record,
  // bias tables, hyper-parameters), then waits for the uploads.
  BiasTables make_bias_tables() const;
  MemoryPlan plan_memory(const BiasTables& bias);
  void allocate_memory(const MemoryPlan& plan);
  void set_up_step(const MemoryPlan& plan, const BiasTables& bias);
  void free_memory() noexcept;
  void ensure_scale();
  void ensure_hyper();
  void ensure_global_partial();
  void enqueue_finalize(float max_norm);
  void reduce(NormPartial* d_partial);
  void update_params(std::size_t first, std::size_t last, std::byte* slot, const float* d_scale,
                     const float* d_clip, const std::int32_t* d_found_inf, bool to_staging = false);
  void update_chunk(std::size_t k, const float* d_scale, const float* d_clip,
                    const std::int32_t* d_found_inf, bool speculate = false);
  // The number of state arrays per parameter (the master and the optimizer's slots): the
  // speculation's outputs and commit copies go over this list, not over names.
  std::size_t slots() const noexcept { return 1 + state_slots(); }
  bool counts() const noexcept { return shape().counts_steps; }
  // Returns parameter i's state array s where it lives between steps (device memory in
  // mode none, its place in the chunk's host block in mode optimizer), or in `slot`.
  float* state_at(std::size_t i, std::size_t s, std::byte* slot) const;
  std::size_t rollback_bytes(std::size_t k) const;
  // Carves chunk k's rollback space (each parameter's state arrays, the counters, the
  // compute staging); false when the budget has no room left in this step.
  bool admit(std::size_t k);
  void commit(std::size_t k);
  void decide_overlapped(const float* d_clip);
  NormResult learn_summary(float& clip);
  void update_all(const float* d_scale, const float* d_clip, const std::int32_t* d_found_inf);
  void finish_enqueue(bool copy_summary);
  void settle();
  void wait_for(const Event& e);
  void wait_all();
  void wait_idle();

  device::Device& dev_;
  bool eager_ = true;  // acc <- R(acc * s) in place at the final finish_backward
  std::vector<Param> params_;
  std::vector<std::uint8_t> accumulated_;  // per parameter: a gradient was read at least once

  // Views for the kernels.
  std::vector<TensorView> counted_, uncounted_;
  std::vector<ConstTensorView> counted_const_;

  // Memory: one device allocation, one workspace, one pinned host allocation.
  std::byte* dmem_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  std::byte* hmem_ = nullptr;
  StepScalars* d_ = nullptr;
  float* d_steps_ = nullptr;           // step counters, one per parameter (unused without)
  StepHyper* d_hyper_ = nullptr;       // per group: lr and weight decay as the kernels read them
  StepHyper* h_hyper_ = nullptr;       // their pinned staging (rewritten only between steps)
  std::uint64_t hyper_uploaded_ = 0;   // hyper_version() of d_hyper_'s values
  std::vector<const double*> d_bias_;  // per group: its device step table (or null)
  HostWords* h_ = nullptr;

  // Mode optimizer: per-chunk host blocks and the ring of device slots.
  std::vector<std::byte*> chunk_host_;
  std::vector<std::size_t> chunk_bytes_;
  std::vector<std::byte*> slots_;
  std::vector<Event> slot_free_;
  std::size_t ring_next_ = 0;

  // Speculation: the rollback space (device memory, reserved by the first step that
  // speculates, carved afresh each step); per chunk whether it was speculated this step,
  // and per parameter where its speculated state, counter and compute weights go.
  struct Spec {
    std::array<float*, kMaxSlots> state{};
    float* step = nullptr;
    void* compute = nullptr;
  };
  std::byte* spare_ = nullptr;
  std::size_t spare_bytes_ = 0, spare_used_ = 0;
  std::vector<std::uint8_t> speculated_;
  std::vector<Spec> spec_;

  // The step in flight.
  bool scale_uploaded_ = false;
  bool partial_done_ = false;  // the global partial is enqueued (and reduced)
  bool flag_known_ = false;    // clip_grad_norm brought the flag to the host
  bool pending_ = false;       // done_ not yet waited for and its outcome not settled
  Event done_;
  StepReport report_;
  bool closed_ = false;
};

GpuGradientManager::GpuGradientManager(ManagerConfig config)
    : ManagerImpl(std::move(config)), dev_(*this->config().device) {
  const ManagerConfig& cfg = this->config();
  if (cfg.mode != OffloadMode::none && cfg.mode != OffloadMode::optimizer)
    throw Error(Errc::invalid_argument, "mode", "the device manager implements none and optimizer");
  // SignSGD takes the sign of the raw accumulator (the read is not applied); scaling it in
  // place could flush a tiny value to zero, so SignSGD always reads lazily.
  eager_ = !cfg.lazy_gpu_scale && shape().reads_scaled;
  params_.resize(cfg.params.size());
  accumulated_.assign(cfg.params.size(), 0);
  // The bias tables first: they may refuse a beta too close to 1, before any memory.
  const BiasTables bias = make_bias_tables();
  const MemoryPlan plan = plan_memory(bias);
  try {
    allocate_memory(plan);
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
    if (!streamed())
      for (std::size_t s = 0; s < slots(); ++s) view[i].state[s] = dev_views.add(p.numel * 4);
  }
  plan.scalars = dev_views.add(sizeof(StepScalars));
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
        for (std::size_t i = c.first; i < c.last; ++i)
          view[i].state[s] = block.add(cfg.params[i].numel * 4);
      const SlabLayout bl = block.layout();
      for (std::size_t i = c.first; i < c.last; ++i)
        for (std::size_t s = 0; s < slots(); ++s) params_[i].off[s] = bl.offsets[view[i].state[s]];
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
      for (std::size_t s = 0; s < slots(); ++s)
        q.state[s] = reinterpret_cast<float*>(block + q.off[s]);
    } else {
      for (std::size_t s = 0; s < slots(); ++s)
        q.state[s] = reinterpret_cast<float*>(dev_at(view.state[s]));
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

// ---- the step in flight ---------------------------------------------------------------

// Blocks until `e` is complete. With a device-memory communicator the device's work may
// sit behind a collective whose peer died: the communicator's bounded wait (its
// timeout, then abort: Errc::timeout) comes first, so no event wait hangs.
void GpuGradientManager::wait_for(const Event& e) {
  comm::Communicator* comm = config().comm;
  if (comm != nullptr && comm->memory() == comm::MemorySpace::device) comm->synchronize();
  dev_.synchronize(e);
}

// Blocks until every queue is idle, bounded like wait_for.
void GpuGradientManager::wait_all() {
  comm::Communicator* comm = config().comm;
  if (comm != nullptr && comm->memory() == comm::MemorySpace::device) comm->synchronize();
  dev_.synchronize();
}

// Learns the outcome of the last step once its work is done: found-inf flags (the device
// skipped what they mark, counters included) and the layout check. Raises the work's
// errors once.
void GpuGradientManager::settle() {
  if (!pending_) return;
  pending_ = false;
  const Event done = std::exchange(done_, Event());
  wait_for(done);
  report_.exposed_seconds = std::max(
      0.0, std::chrono::duration<double>(std::chrono::steady_clock::now() - last_gradient_time())
               .count());
  if (!flag_known_) {
    const Summary s = h_->summary;
    report_.norm = s.result;
    report_.skipped = s.found_inf != 0;
    report_.stepped = !report_.skipped;
    set_would_commit(!report_.skipped);  // no clipping: the coefficient is 1
    if (config().comm != nullptr) comm::check_reduced(s.check, config().layout_fingerprint);
  }
}

void GpuGradientManager::wait_idle() {
  settle();
  wait_all();
}

// Uploads the groups' lr and weight decay when set_hyperparameters (or a checkpoint)
// changed them since the last upload: through the pinned staging words, which no queued
// work still reads (the previous step was waited for by begin_step, and load/import wait
// for everything), on the compute queue ahead of the step's kernels. No host wait.
void GpuGradientManager::ensure_hyper() {
  if (hyper_uploaded_ == hyper_version()) return;
  for (std::size_t g = 0; g < groups().size(); ++g)
    h_hyper_[g] = {groups()[g].lr, groups()[g].weight_decay};
  dev_.copy(Queue::compute, d_hyper_, h_hyper_, sizeof(StepHyper) * groups().size());
  hyper_uploaded_ = hyper_version();
}

void GpuGradientManager::ensure_scale() {
  if (scale_uploaded_) return;
  h_->scale = gradient_scale();
  dev_.copy(Queue::compute, &d_->scale, &h_->scale, sizeof(float));
  scale_uploaded_ = true;
}

// All-reduces a partial (with the layout record) when there is a communicator. A host
// communicator reads host memory at the call, so the compute queue is drained first (the
// host device only: a CUDA device pairs with NCCL, which enqueues on the compute stream).
void GpuGradientManager::reduce(NormPartial* d_partial) {
  comm::Communicator* comm = config().comm;
  if (comm == nullptr) return;
  if (comm->memory() == comm::MemorySpace::host) dev_.synchronize(dev_.record(Queue::compute));
  comm->all_reduce_partial(d_partial, &d_->summary.check);  // device: on the compute stream
}

// The global norm partial of the counted accumulators, reduced over the ranks; eager:
// the accumulators are scaled in place in the same pass. The scale is read from device
// memory (d_->scale) when the kernels run, as every other per-step scalar.
void GpuGradientManager::ensure_global_partial() {
  if (partial_done_) return;
  ensure_scale();
  if (eager_) {
    dev_.scale_and_norm_partial(counted_, &d_->scale, &d_->partial, workspace_, workspace_bytes_);
    if (!uncounted_.empty())
      dev_.scale_and_norm_partial(uncounted_, &d_->scale, &d_->scratch, workspace_,
                                  workspace_bytes_);
  } else {
    dev_.norm_partial(counted_const_, DeviceGradientRead{&d_->scale, &d_->one}, &d_->partial,
                      workspace_, workspace_bytes_);
  }
  reduce(&d_->partial);
  partial_done_ = true;
}

// Finalizes the reduced partial into the summary (norm, clip, flag), with the exact
// fallback and its reduction (always enqueued: every rank takes part).
void GpuGradientManager::enqueue_finalize(float max_norm) {
  Summary* s = &d_->summary;
  // Eager: the accumulators hold the scaled values already.
  const DeviceGradientRead read{eager_ ? &d_->one : &d_->scale, &d_->one};
  dev_.finalize_and_clip(&d_->partial, max_norm, &s->result, &s->clip, &s->found_inf);
  dev_.exact_norm_partial_if_needed(counted_const_, read, &s->found_inf, &d_->exact, workspace_,
                                    workspace_bytes_);
  reduce(&d_->exact);
  dev_.finalize_exact_and_clip(&d_->exact, max_norm, &s->result, &s->clip, &s->found_inf);
}

// The optimizer over parameters [first, last): state in device memory, or in `slot` (a
// ring slot holding their chunk's block). Gradients are the accumulators, outputs the
// device compute weights.
void GpuGradientManager::update_params(std::size_t first, std::size_t last, std::byte* slot,
                                       const float* d_scale, const float* d_clip,
                                       const std::int32_t* d_found_inf, bool to_staging) {
  const ManagerConfig& cfg = config();
  auto f32 = [](float* p, std::size_t n) { return TensorView{p, n, DType::f32}; };
  // Speculating, the state is read where it is and written to the rollback space.
  auto dst = [&](std::size_t i, std::size_t s) {
    return f32(to_staging ? spec_[i].state[s] : state_at(i, s, slot), params_[i].acc.numel);
  };
  auto src = [&](std::size_t i, std::size_t s) {
    return to_staging ? ConstTensorView(f32(state_at(i, s, slot), params_[i].acc.numel))
                      : ConstTensorView{};
  };
  // The compute weights, or (speculating) their staging.
  auto compute = [&](std::size_t i) {
    const TensorView& c = params_[i].compute;
    return to_staging && c.numel != 0 ? TensorView{spec_[i].compute, c.numel, c.dtype} : c;
  };
  // One call per parameter group; each group's lr and weight decay come from d_hyper_
  // when the kernels run.
  for_each_group(cfg.params, groups().size(), first, last,
                 [&](std::size_t group, std::span<const std::size_t> members) {
                   std::vector<OptimizerTensor> t;
                   for (std::size_t i : members) {
                     OptimizerTensor o{dst(i, 0)};
                     o.param_src = src(i, 0);
                     for (std::size_t k = 0; k < state_slots() && k < kMaxOptimizerSlots; ++k) {
                       o.state[k] = dst(i, 1 + k);
                       o.state_src[k] = src(i, 1 + k);
                     }
                     if (counts()) o.step = to_staging ? spec_[i].step : d_steps_ + i;
                     o.grad = params_[i].acc;
                     o.compute_param = compute(i);
                     t.push_back(o);
                   }
                   device_optimizer_step(dev_, t, group_config(group),
                                         DeviceStepArgs{d_scale, d_clip, d_found_inf,
                                                        d_hyper_ + group, d_bias_[group]});
                 });
}

// Steps chunk k: in place (mode none) or through the next ring slot (mode optimizer):
// upload on h2d once the slot is free, step on compute, download on d2h. `speculate`:
// out of place into the chunk's rollback space (its counters copied there first), and
// in mode optimizer nothing is downloaded (the host block keeps the old state).
void GpuGradientManager::update_chunk(std::size_t k, const float* d_scale, const float* d_clip,
                                      const std::int32_t* d_found_inf, bool speculate) {
  const Chunk& c = chunks()[k];
  if (speculate && counts() && c.last > c.first)
    dev_.copy(Queue::compute, spec_[c.first].step, d_steps_ + c.first,
              sizeof(float) * (c.last - c.first));
  if (!streamed()) {
    update_params(c.first, c.last, nullptr, d_scale, d_clip, d_found_inf, speculate);
    return;
  }
  const std::size_t j = ring_next_++ % slots_.size();
  dev_.wait(Queue::h2d, slot_free_[j]);
  dev_.copy(Queue::h2d, slots_[j], chunk_host_[k], chunk_bytes_[k]);
  dev_.wait(Queue::compute, dev_.record(Queue::h2d));
  update_params(c.first, c.last, slots_[j], d_scale, d_clip, d_found_inf, speculate);
  if (speculate) {
    slot_free_[j] = dev_.record(Queue::compute);
    return;
  }
  dev_.wait(Queue::d2h, dev_.record(Queue::compute));
  dev_.copy(Queue::d2h, chunk_host_[k], slots_[j], chunk_bytes_[k]);
  slot_free_[j] = dev_.record(Queue::d2h);
}

// Steps every parameter: one multi-tensor update (mode none) or chunk by chunk through
// the ring (mode optimizer).
void GpuGradientManager::update_all(const float* d_scale, const float* d_clip,
                                    const std::int32_t* d_found_inf) {
  if (!streamed()) {
    update_params(0, params_.size(), nullptr, d_scale, d_clip, d_found_inf);
    return;
  }
  for (std::size_t k = 0; k < chunks().size(); ++k) update_chunk(k, d_scale, d_clip, d_found_inf);
}

// ---- speculation ------------------------------------------------------------------------

float* GpuGradientManager::state_at(std::size_t i, std::size_t s, std::byte* slot) const {
  const Param& q = params_[i];
  return slot != nullptr ? reinterpret_cast<float*>(slot + q.off[s]) : q.state[s];
}

std::size_t GpuGradientManager::rollback_bytes(std::size_t k) const {
  const Chunk& c = chunks()[k];
  std::size_t bytes = counts() ? align_up(sizeof(float) * (c.last - c.first)) : 0;
  for (std::size_t i = c.first; i < c.last; ++i)
    bytes += slots() * align_up(sizeof(float) * params_[i].acc.numel) +
             align_up(params_[i].compute.bytes());
  return bytes;
}

void GpuGradientManager::do_reserve_speculation() {
  if (spare_ != nullptr) return;
  std::size_t need = 0;
  for (std::size_t k = 0; k < chunks().size(); ++k) need += rollback_bytes(k);
  const std::size_t bytes = std::min(need, speculation_budget());
  if (bytes == 0) return;
  try {
    spare_ = static_cast<std::byte*>(dev_.allocate(bytes));
  } catch (const Error& e) {
    throw Error(
        Errc::out_of_range, "speculation_bytes",
        "cannot reserve " + std::to_string(bytes) + " bytes of rollback space: " + e.what());
  }
  spare_bytes_ = bytes;
}

bool GpuGradientManager::admit(std::size_t k) {
  const std::size_t bytes = rollback_bytes(k);
  if (spare_ == nullptr || bytes > spare_bytes_ - spare_used_) return false;
  const Chunk& c = chunks()[k];
  std::byte* at = spare_ + spare_used_;
  auto take = [&at](std::size_t n) {
    std::byte* p = at;
    at += align_up(n);
    return p;
  };
  for (std::size_t i = c.first; i < c.last; ++i) {
    for (std::size_t s = 0; s < slots(); ++s)
      spec_[i].state[s] = reinterpret_cast<float*>(take(sizeof(float) * params_[i].acc.numel));
    spec_[i].compute = take(params_[i].compute.bytes());
  }
  if (counts() && c.last > c.first) {  // the chunk's counters, consecutive
    float* steps = reinterpret_cast<float*>(take(sizeof(float) * (c.last - c.first)));
    for (std::size_t i = c.first; i < c.last; ++i) spec_[i].step = steps + (i - c.first);
  }
  speculated_[k] = 1;
  spare_used_ += bytes;
  return true;
}

// Commits chunk k: its speculated state, counters and compute weights copied from the
// rollback space to where they live (mode optimizer: the state downloaded to its host
// block on d2h, after the step's compute work).
void GpuGradientManager::commit(std::size_t k) {
  const Chunk& c = chunks()[k];
  if (streamed()) dev_.wait(Queue::d2h, dev_.record(Queue::compute));
  const Queue state_queue = streamed() ? Queue::d2h : Queue::compute;
  for (std::size_t i = c.first; i < c.last; ++i) {
    const Param& q = params_[i];
    const std::size_t bytes = sizeof(float) * q.acc.numel;
    for (std::size_t s = 0; s < slots() && bytes != 0; ++s)
      dev_.copy(state_queue, state_at(i, s, streamed() ? chunk_host_[k] : nullptr),
                spec_[i].state[s], bytes);
    if (q.compute.numel != 0)
      dev_.copy(Queue::compute, q.compute.data, spec_[i].compute, q.compute.bytes());
  }
  if (counts() && c.last > c.first)
    dev_.copy(Queue::compute, d_steps_ + c.first, spec_[c.first].step,
              sizeof(float) * (c.last - c.first));
}

// The decision of an overlapped step, the summary on the host (flag_known_): commit the
// speculated chunks, or drop them and step every chunk with the coefficient; a skipped
// step drops them and steps nothing.
void GpuGradientManager::decide_overlapped(const float* d_clip) {
  const bool finite = !report_.skipped;
  const bool keep = finite && (report_.clip_coefficient == 1.0f || !shape().reads_scaled);
  set_would_commit(keep);
  for (std::size_t k = 0; k < chunks().size(); ++k) {
    if (!speculated_[k]) continue;
    ++report_.chunks_speculated;
    ++(keep ? report_.chunks_committed : report_.chunks_rolled_back);
    if (keep) commit(k);  // rolled back: its state was never written, nothing to restore
  }
  if (streamed()) dev_.wait(Queue::h2d, dev_.record(Queue::d2h));  // committed blocks first
  if (!finite) return;
  const float* d_scale = eager_ ? &d_->one : &d_->scale;
  for (std::size_t k = 0; k < chunks().size(); ++k)
    if (!speculated_[k] || !keep) update_chunk(k, d_scale, d_clip, &d_->summary.found_inf);
}

// Ends the step's enqueueing: the summary follows all of the step's work to pinned host
// words; done_ marks the end of everything.
void GpuGradientManager::finish_enqueue(bool copy_summary) {
  dev_.wait(Queue::d2h, dev_.record(Queue::compute));
  if (copy_summary) dev_.copy(Queue::d2h, &h_->summary, &d_->summary, sizeof(Summary));
  done_ = dev_.record(Queue::d2h);
  pending_ = true;
}

// ---- hooks ----------------------------------------------------------------------------

void GpuGradientManager::do_import_parameter(std::size_t i, Arrays<const float> arrays,
                                             float step) {
  wait_idle();
  const ParamSpec& p = config().params[i];
  Param& q = params_[i];
  const std::size_t bytes = p.numel * 4;
  // Initial values other than +0, as host arrays (alive until the copies are waited for).
  std::vector<std::vector<float>> initial;
  // One array: the caller's values, or (empty: load_parameter) the slot's initial value.
  auto put = [&](float* dst, std::span<const float> src, float init) {
    if (bytes == 0) return;
    if (src.empty() && std::bit_cast<std::uint32_t>(init) != 0) {
      initial.emplace_back(p.numel, init);
      src = initial.back();
    }
    if (streamed()) {
      if (src.empty())
        std::memset(dst, 0, bytes);
      else
        std::memcpy(dst, src.data(), bytes);
    } else if (src.empty()) {
      dev_.zero(Queue::compute, dst, bytes);
    } else {
      dev_.copy(Queue::compute, dst, src.data(), bytes);
    }
  };
  for (std::size_t s = 0; s < slots(); ++s)
    put(q.state[s], arrays[s], s == 0 ? 0.0f : initial_slot_value(s - 1));
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

void GpuGradientManager::do_begin_step() {
  settle();  // the previous step's outcome; raises its errors
  report_ = StepReport{};
  scale_uploaded_ = partial_done_ = flag_known_ = false;
  ring_next_ = 0;
  spare_used_ = 0;
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
}

void GpuGradientManager::do_gradient_ready(std::size_t i, bool first_in_step, ConstTensorView grad,
                                           const Event& written) {
  const Param& q = params_[i];
  dev_.wait(Queue::compute, written);  // the trainer's write, before the read
  const AccumulatePair pair{q.acc, grad, first_in_step};
  dev_.accumulate(std::span(&pair, 1));
  accumulated_[i] = 1;
}

void GpuGradientManager::do_finish_final_backward(std::span<const std::size_t> no_gradient) {
  for (std::size_t i : no_gradient)
    dev_.zero(Queue::compute, params_[i].acc.data, params_[i].acc.bytes());
  if (overlap()) {
    ensure_scale();
    return;
  }
  if (eager_) ensure_global_partial();  // lazy: at clip_grad_norm or step
}

// Optimizer in backward: chunk k, admitted by the budget, is stepped into its rollback
// space as if the coefficient were 1 and the step finite (reading R(acc * s)); otherwise
// it waits for the decision.
void GpuGradientManager::do_step_chunk(std::size_t k) {
  if (!speculating() || !admit(k)) return;
  ensure_scale();
  ensure_hyper();
  update_chunk(k, &d_->scale, &d_->one, &d_->zero, /*speculate=*/true);
}

NormResult GpuGradientManager::do_clip_grad_norm(float max_norm, float& clip) {
  ensure_global_partial();
  enqueue_finalize(max_norm);
  return learn_summary(clip);
}

// The host synchronisation of the step: the finalized summary to the host (the norm,
// coefficient and found-inf flag), into the report.
NormResult GpuGradientManager::learn_summary(float& clip) {
  dev_.wait(Queue::d2h, dev_.record(Queue::compute));
  dev_.copy(Queue::d2h, &h_->summary, &d_->summary, sizeof(Summary));
  wait_for(dev_.record(Queue::d2h));
  const Summary s = h_->summary;
  if (config().comm != nullptr) comm::check_reduced(s.check, config().layout_fingerprint);
  flag_known_ = true;
  clip = s.clip;  // 0 when the norm is not finite (the step is then skipped)
  report_.norm = s.result;
  report_.clip_coefficient = clip;
  report_.skipped = s.found_inf != 0;
  report_.stepped = !report_.skipped;
  return s.result;
}

void GpuGradientManager::do_step() {
  ensure_hyper();
  const float* d_scale = eager_ ? &d_->one : &d_->scale;
  if (!eager_) ensure_scale();
  const bool any_speculated =
      std::find(speculated_.begin(), speculated_.end(), std::uint8_t{1}) != speculated_.end();
  if (overlap() && any_speculated) {
    // The decision needs the host (commit or drop): without clip_grad_norm, the
    // step's one host synchronisation is here; the coefficient stays 1.
    const float* d_clip = &d_->summary.clip;
    if (!flag_known_) {
      ensure_global_partial();
      enqueue_finalize(kNoClipMaxNorm);
      float clip = 1.0f;
      (void)learn_summary(clip);
      report_.clip_coefficient = 1.0f;
      d_clip = &d_->one;
    }
    decide_overlapped(d_clip);
    finish_enqueue(false);
    return;
  }
  if (flag_known_) {
    if (!report_.skipped) {  // known finite: the device flag is 0, the clip is set
      set_would_commit(report_.clip_coefficient == 1.0f || !shape().reads_scaled);
      update_all(d_scale, &d_->summary.clip, &d_->summary.found_inf);
    } else {
      set_would_commit(false);
    }
    finish_enqueue(false);
    return;
  }
  // No clip: the norm is still needed for found-inf; c = 1.
  ensure_global_partial();
  enqueue_finalize(kNoClipMaxNorm);
  update_all(d_scale, &d_->one, &d_->summary.found_inf);
  finish_enqueue(true);
}

StepReport GpuGradientManager::do_report() {
  settle();
  return report_;
}

ConstTensorView GpuGradientManager::do_compute_weights(std::size_t i) const {
  const Param& q = params_[i];
  if (config().params[i].has_compute_weights) return q.compute;
  // No compute copy: the master is used (device memory in mode none only).
  if (!streamed()) return ConstTensorView(q.master(), q.acc.numel, DType::f32);
  return {};
}

void GpuGradientManager::do_read_parameter(std::size_t i, Arrays<float> arrays,
                                           std::span<std::uint8_t> compute) {
  wait_idle();
  const Param& q = params_[i];
  for (std::size_t s = 0; s < slots(); ++s) {
    if (arrays[s].empty()) continue;
    if (streamed())
      std::memcpy(arrays[s].data(), q.state[s], arrays[s].size_bytes());
    else
      dev_.copy(Queue::compute, arrays[s].data(), q.state[s], arrays[s].size_bytes());
  }
  if (!compute.empty()) dev_.copy(Queue::compute, compute.data(), q.compute.data, compute.size());
  wait_all();
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
  for (std::size_t s = 0; s < slots(); ++s) h.a[s] = {q.state[s], n};
  return h;
}

void GpuGradientManager::do_synchronize() { wait_idle(); }

void GpuGradientManager::do_recover() {
  pending_ = false;
  done_ = Event();
  try {
    wait_all();  // the failed step's queued work; its errors are the stored one's
  } catch (const Error&) {
  }
  wait_all();  // a device (or communicator) that fails again cannot continue
  report_ = StepReport{};
  scale_uploaded_ = partial_done_ = flag_known_ = false;
  spare_used_ = 0;
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
}

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

}  // namespace

std::unique_ptr<ManagerImpl> make_gpu_gradient_manager(ManagerConfig config) {
  return std::make_unique<GpuGradientManager>(std::move(config));
}

}  // namespace stepcore::detail
