// OffloadGradientManager (mode "full"): gradients copied device-to-host into pinned
// staging as backward hands them over, accumulated, normed, clipped and stepped in f32 on
// the CPU engine by one worker thread, compute weights uploaded host-to-device.
// docs/managers.md is the contract; every result equals the GPU modes' bits.
//
// Speculation (overlapped steps): a chunk whose final gradients are in is stepped out of
// place, reading its live state and writing the new state into its spare (rollback
// space from ManagerConfig::speculation_bytes, a chunk's spare kept once given), compute
// weights into the pinned upload buffers, nothing uploaded to the model's weights (with
// ManagerConfig::speculation_device_bytes, they are uploaded into device staging at once,
// and a commit copies them device-to-device). The decision then commits
// (the spare becomes the live state: a pointer swap, then the uploads) or rolls back (the
// live state was never written: it is stepped again in place with the coefficient, or
// left alone when the step is skipped). No formula is ever inverted.
//
// Threads: the caller's thread (the trainer's) runs the hooks, enqueues the copies and
// the norm collectives; the worker runs tasks from two FIFO lanes: `main` (accumulate,
// the chunks' norm partials) first, `late` (speculative steps, the step's updates and
// uploads) when main is empty — so a late task runs after every main task posted before
// it, and the decision waits only for what the norm needs, not for speculative steps
// it may cancel (a rollback or skip cancels the step's speculative tasks not yet run).
// All Device calls are serialised by dev_mu_; waits on events happen outside it
// (Event::wait), then synchronize(event) collects errors under it. The worker never
// joins a collective, so it cannot hang on a peer. An error of asynchronous work makes
// the manager failed: every later hook raises that same error (sticky), close() returns it.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/global_norm.hpp"
#include "core/validate.hpp"
#include "managers/common.hpp"
#include "managers/factories.hpp"
#include "managers/manager_impl.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/host_slab.hpp"
#include "stepcore/numa.hpp"

namespace stepcore::detail {
namespace {

using device::Device;
using device::Event;
using device::Queue;

// Returns `ep` if it holds a stepcore::Error, else an Errc::internal Error with its text.
std::exception_ptr as_error(std::exception_ptr ep) noexcept {
  try {
    std::rethrow_exception(ep);
  } catch (const Error&) {
    return ep;
  } catch (const std::exception& e) {
    return std::make_exception_ptr(Error(Errc::internal, "offload worker", e.what()));
  } catch (...) {
    return std::make_exception_ptr(Error(Errc::internal, "offload worker", "unknown exception"));
  }
}

class OffloadGradientManager final : public ManagerImpl {
 public:
  explicit OffloadGradientManager(ManagerConfig config);
  ~OffloadGradientManager() override { (void)do_close(); }

 protected:
  void do_import_parameter(std::size_t i, Arrays<const float> arrays, float step) override;
  void do_begin_step() override;
  void do_begin_backward() override;
  TensorView do_gradient(std::size_t i) override;
  void do_gradient_ready(std::size_t i, bool first_in_step, ConstTensorView grad,
                         const Event& written) override;
  Event do_gradient_released(std::size_t i) const override { return released_[i]; }
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
  std::exception_ptr do_async_failure() const noexcept override {
    const std::lock_guard lock(err_mu_);
    return error_;
  }

 private:
  // The optimizer state arrays of a parameter, in slot order: master, then the
  // optimizer's state slots. Saving, restoring and committing go over this list, never
  // over the arrays by name.
  static constexpr std::size_t kMaxSlots = 1 + kMaxOptimizerSlots;
  static constexpr std::size_t kStateViews = 1 + kMaxSlots;  // acc and the slots
  using Slots = std::array<TensorView, kMaxSlots>;

  // Per-parameter views into the slabs.
  struct Param {
    TensorView grad;     // device, grad_dtype
    TensorView compute;  // device, compute_dtype (empty without compute weights)
    TensorView staging;  // pinned host, grad_dtype
    TensorView out;      // pinned host, compute_dtype (empty without compute weights)
    TensorView staged;   // device staging of speculated compute weights (empty: none)
    TensorView acc;      // host f32
    Slots state;         // host f32, the live state (slots() of them used)
    Slots spare;         // host f32 in the rollback space (empty until its chunk has one)
    const TensorView& master() const { return state[0]; }
  };
  std::size_t slots() const noexcept { return 1 + state_slots(); }

  // Carves the slabs into the per-parameter views and places the state pages.
  void carve(const SlabLayout& dl, const SlabLayout& pl, const SlabLayout& sl);

  // ---- errors --------------------------------------------------------------------------
  void store_error(std::exception_ptr ep) noexcept;
  void raise_if_failed() const;
  // Runs f under dev_mu_; a Device error becomes the manager's (sticky) error.
  template <class F>
  decltype(auto) on_device(F&& f);
  // Waits for e (any thread), then raises the device's errors (sticky).
  void sync_event(const Event& e);

  // ---- the worker ------------------------------------------------------------------------
  enum Lane : std::size_t { main = 0, late = 1 };
  std::uint64_t post(std::function<void()> task, Lane lane = late);
  void wait_done(Lane lane, std::uint64_t seq);
  void drain(Lane lane);  // waits for the lane's posted tasks, then raises a stored error
  void drain();           // both lanes
  void worker_loop();

  // ---- numerics --------------------------------------------------------------------------
  NormResult global_norm(float scale);
  // The groups' optimizer configurations now (tasks take a copy: the caller's thread may
  // change the groups while they wait).
  using GroupConfigs = std::vector<OptimizerConfig>;
  GroupConfigs group_configs() const;
  // Steps chunk k (worker): in place, or (into_spare) reading the live state and writing
  // the spares, the step counters into spec_steps_.
  void step_chunk(std::size_t k, GradientRead read, const GroupConfigs& configs,
                  bool into_spare = false);
  // Gives chunk k a spare from the rollback space when it has none and it fits.
  bool admit(std::size_t k);
  // The global norm of an overlapped step from the chunks' partials (worker-made).
  NormResult overlapped_global_norm(float scale);
  // Posts the step's last task: waits for its uploads and stamps the end of the step.
  void post_step_end();
  // The decision keeps the speculated chunks (finite, and coefficient 1 or an optimizer
  // that does not read it).
  bool keeps_speculation() const;
  // Makes this step's speculative tasks not yet run skip (a rollback or skip).
  void cancel_speculation();
  // Uploads chunk k's compute weights (from device staging when `staged`) after `after`.
  void upload_chunk(std::size_t k, const Event& after, bool staged = false);  // on the worker
  // Uploads speculated chunk k's compute weights into its device staging.
  void stage_chunk(std::size_t k);  // on the worker
  void wait_uploads();

  Device& dev_;
  cpu::Engine engine_;
  std::vector<Param> params_;
  std::vector<float> steps_;
  std::vector<ConstTensorView> counted_acc_;                 // the global norm's tensors
  std::vector<std::vector<ConstTensorView>> chunk_counted_;  // a chunk's counted tensors

  void* dev_slab_ = nullptr;
  void* pinned_slab_ = nullptr;
  numa::HostBuffer state_;

  // Speculation: the rollback space (reserved by the first step that speculates), each
  // chunk's bytes of spares, how much is given out; per step, what each chunk did.
  numa::HostBuffer spare_space_;
  std::size_t spare_used_ = 0;
  std::vector<std::size_t> chunk_state_bytes_;
  std::vector<std::uint8_t> has_spare_, speculated_;
  // Device staging of speculated compute weights (speculation_device_bytes), given to
  // chunks as they are first admitted, like the spares.
  void* stage_space_ = nullptr;
  std::size_t stage_bytes_ = 0, stage_used_ = 0;
  std::vector<std::size_t> chunk_compute_bytes_;
  std::vector<std::uint8_t> has_stage_;
  std::vector<float> spec_steps_;                     // speculated step counters (worker)
  std::vector<NormPartial> chunk_partial_;            // fast partials of the counted acc (worker)
  std::chrono::steady_clock::time_point step_end_{};  // written by the step's last task

  // Device calls and their events (dev_mu_).
  std::mutex dev_mu_;
  Event last_d2h_;     // the latest gradient copy (caller thread only)
  Event last_upload_;  // the latest compute-weight upload (under dev_mu_)

  // The worker.
  std::mutex mu_;
  std::condition_variable task_cv_, done_cv_;
  std::deque<std::function<void()>> tasks_[2];  // per Lane
  std::uint64_t posted_[2] = {0, 0}, done_[2] = {0, 0};
  std::uint64_t generation_ = 0;             // steps begun (caller thread; tasks capture it)
  std::atomic<std::uint64_t> cancelled_{0};  // speculative tasks of this generation skip
  bool stop_ = false;
  std::vector<std::uint64_t> staging_task_;  // last task reading staging i
  std::vector<Event> released_;              // per parameter: its device buffer is staged
  std::thread worker_;

  // Errors (err_mu_).
  mutable std::mutex err_mu_;
  std::exception_ptr error_;

  // The step (caller thread).
  bool norm_known_ = false;
  NormResult norm_;
  float clip_ = 1.0f;
  StepReport report_;
  bool closed_ = false;
};

OffloadGradientManager::OffloadGradientManager(ManagerConfig config)
    : ManagerImpl(std::move(config)), dev_(*this->config().device), engine_(this->config().engine) {
  const ManagerConfig& cfg = this->config();
  // Layouts: device (gradients, compute weights), pinned (staging, upload buffers) and
  // host state (acc, master, state slots), each one slab of 256-byte aligned views: per
  // parameter i views 2i, 2i + 1 of the device and pinned slabs, kStateViews * i + v of
  // the state (v = 0 acc, 1 master, 2 + s slot s).
  SlabViews dev_views, pin_views, state_views;
  for (const ParamSpec& p : cfg.params) {
    const std::size_t gb = p.numel * dtype_size(p.grad_dtype);
    const std::size_t cb = p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0;
    const std::size_t fb = p.numel * sizeof(float);
    // Device: the gradient and compute buffers the caller does not provide.
    dev_views.add(p.gradient_buffer ? gb : 0);
    dev_views.add(p.compute_into.data == nullptr && p.compute_into.numel == 0 ? cb : 0);
    pin_views.add(gb);
    pin_views.add(cb);
    for (std::size_t v = 0; v < kStateViews; ++v) state_views.add(v < 1 + slots() ? fb : 0);
  }
  const SlabLayout dl = dev_views.layout(), pl = pin_views.layout(), sl = state_views.layout();
  state_ = numa::HostBuffer(std::max<std::size_t>(sl.total_bytes, 1), cfg.numa_node);
  dev_slab_ = dev_.allocate(slab_allocation_bytes(dl));
  try {
    pinned_slab_ = dev_.allocate_host(slab_allocation_bytes(pl), cfg.numa_node);
    carve(dl, pl, sl);
  } catch (...) {
    if (pinned_slab_ != nullptr) dev_.deallocate_host(pinned_slab_);
    dev_.deallocate(dev_slab_);
    throw;
  }
  worker_ = std::thread([this] { worker_loop(); });  // last: nothing below can throw
}

void OffloadGradientManager::carve(const SlabLayout& dl, const SlabLayout& pl,
                                   const SlabLayout& sl) {
  const ManagerConfig& cfg = config();
  const std::size_t n = cfg.params.size();
  auto at = [](void* base, std::size_t off) { return static_cast<char*>(base) + off; };
  auto f32_at = [&](std::size_t off, std::size_t numel) {
    return f32_view(reinterpret_cast<float*>(at(state_.data(), off)), numel);
  };
  params_.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const ParamSpec& p = cfg.params[i];
    const std::size_t cn = p.has_compute_weights ? p.numel : 0;
    Param& v = params_[i];
    if (p.gradient_buffer) v.grad = {at(dev_slab_, dl.offsets[2 * i]), p.numel, p.grad_dtype};
    if (p.compute_into.data != nullptr || p.compute_into.numel != 0)
      v.compute = p.compute_into;  // the caller's storage (validated by the base)
    else
      v.compute = {cn ? at(dev_slab_, dl.offsets[2 * i + 1]) : nullptr, cn, p.compute_dtype};
    v.staging = {at(pinned_slab_, pl.offsets[2 * i]), p.numel, p.grad_dtype};
    v.out = {cn ? at(pinned_slab_, pl.offsets[2 * i + 1]) : nullptr, cn, p.compute_dtype};
    v.acc = f32_at(sl.offsets[kStateViews * i], p.numel);
    for (std::size_t s = 0; s < slots(); ++s)
      v.state[s] = f32_at(sl.offsets[kStateViews * i + 1 + s], p.numel);
    if (p.counts_toward_norm) counted_acc_.push_back(v.acc);
  }
  steps_.assign(n, 0.0f);
  spec_steps_.assign(n, 0.0f);
  staging_task_.assign(n, 0);
  released_.resize(n);
  const std::size_t nchunks = chunks().size();
  has_spare_.assign(nchunks, 0);
  has_stage_.assign(nchunks, 0);
  chunk_compute_bytes_.assign(nchunks, 0);
  speculated_.assign(nchunks, 0);
  chunk_partial_.assign(nchunks, NormPartial{});
  chunk_state_bytes_.assign(nchunks, 0);
  // Place the state pages: each chunk's buffers touched in the partition its step uses.
  chunk_counted_.resize(nchunks);
  auto aligned = [](std::size_t bytes) {
    return (bytes + kSlabViewAlignment - 1) / kSlabViewAlignment * kSlabViewAlignment;
  };
  for (std::size_t k = 0; k < nchunks; ++k) {
    // One list per array (acc, then each slot), as the step partitions its tensors.
    std::vector<std::vector<TensorView>> touch(1 + slots());
    for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i) {
      touch[0].push_back(params_[i].acc);
      for (std::size_t s = 0; s < slots(); ++s) {
        touch[1 + s].push_back(params_[i].state[s]);
        chunk_state_bytes_[k] += aligned(params_[i].state[s].bytes());
      }
      chunk_compute_bytes_[k] += aligned(params_[i].out.bytes());
      if (cfg.params[i].counts_toward_norm) chunk_counted_[k].push_back(params_[i].acc);
    }
    for (const auto& list : touch) engine_.first_touch(list);
  }
}

// ---- errors -------------------------------------------------------------------------------

void OffloadGradientManager::store_error(std::exception_ptr ep) noexcept {
  const std::lock_guard lock(err_mu_);
  if (!error_) error_ = as_error(ep);
}

void OffloadGradientManager::raise_if_failed() const {
  std::exception_ptr ep;
  {
    const std::lock_guard lock(err_mu_);
    ep = error_;
  }
  if (ep) std::rethrow_exception(ep);
}

template <class F>
decltype(auto) OffloadGradientManager::on_device(F&& f) {
  const std::lock_guard lock(dev_mu_);
  try {
    return std::forward<F>(f)();
  } catch (...) {
    store_error(std::current_exception());
    raise_if_failed();
    throw;  // unreachable: an error was stored
  }
}

void OffloadGradientManager::sync_event(const Event& e) {
  // Wait without the lock (the other thread keeps enqueueing), then let the device raise
  // its errors under the lock, so that no two threads ever collect them at once.
  if (!e.empty()) {
    try {
      e.wait();
    } catch (...) {
      store_error(std::current_exception());
      raise_if_failed();
    }
  }
  on_device([&] { dev_.synchronize(e); });
}

// ---- the worker ---------------------------------------------------------------------------

std::uint64_t OffloadGradientManager::post(std::function<void()> task, Lane lane) {
  std::uint64_t seq;
  {
    const std::lock_guard lock(mu_);
    tasks_[lane].push_back(std::move(task));
    seq = ++posted_[lane];
  }
  task_cv_.notify_one();
  return seq;
}

void OffloadGradientManager::wait_done(Lane lane, std::uint64_t seq) {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return done_[lane] >= seq; });
}

void OffloadGradientManager::drain(Lane lane) {
  std::uint64_t seq;
  {
    const std::lock_guard lock(mu_);
    seq = posted_[lane];
  }
  wait_done(lane, seq);
  raise_if_failed();
}

void OffloadGradientManager::drain() {
  drain(main);
  drain(late);
}

void OffloadGradientManager::worker_loop() {
  for (;;) {
    std::function<void()> task;
    Lane lane;
    {
      std::unique_lock lock(mu_);
      task_cv_.wait(lock, [&] { return stop_ || !tasks_[main].empty() || !tasks_[late].empty(); });
      lane = !tasks_[main].empty() ? main : late;
      if (tasks_[lane].empty()) return;  // stop_ and drained
      task = std::move(tasks_[lane].front());
      tasks_[lane].pop_front();
    }
    bool failed;
    {
      const std::lock_guard lock(err_mu_);
      failed = error_ != nullptr;
    }
    if (!failed) {  // after a failure the state is suspect: later tasks are skipped
      try {
        task();
      } catch (...) {
        store_error(std::current_exception());
      }
    }
    {
      const std::lock_guard lock(mu_);
      ++done_[lane];
    }
    done_cv_.notify_all();
  }
}

// ---- numerics -----------------------------------------------------------------------------

NormResult OffloadGradientManager::global_norm(float scale) {
  const GradientRead read{scale, 1.0f};
  if (config().comm == nullptr) {
    drain();
    return engine_.norm(counted_acc_, read);
  }
  // comm's protocol: fast partials reduced with the layout check, the exact pass when
  // the result cannot be certified. A rank whose drain or partial fails still joins
  // every reduction (its peers learn of it) and then raises its own error.
  return comm::detail::global_norm(
      *config().comm, config().layout_fingerprint, counted_acc_,
      [&](std::span<const ConstTensorView> tensors, cpu::NormMode mode) {
        drain();
        return engine_.norm_partial(tensors, read, mode);
      });
}

OffloadGradientManager::GroupConfigs OffloadGradientManager::group_configs() const {
  GroupConfigs c;
  for (std::size_t g = 0; g < groups().size(); ++g) c.push_back(group_config(g));
  return c;
}

void OffloadGradientManager::step_chunk(std::size_t k, GradientRead read,
                                        const GroupConfigs& configs, bool into_spare) {
  const Chunk& c = chunks()[k];
  const std::vector<ParamSpec>& specs = config().params;
  const bool counts = shape().counts_steps;
  // An optimizer that does not read the scale and clip (SignSGD) reads them as 1, so
  // that a zero clip coefficient (max_norm = 0) is not refused.
  const GradientRead r = shape().reads_scaled ? read : GradientRead{};
  // One call per parameter group; out of place, the live state is the source and the
  // spare the destination.
  for_each_group(specs, groups().size(), c.first, c.last,
                 [&](std::size_t group, std::span<const std::size_t> members) {
                   std::vector<OptimizerTensor> t;
                   for (std::size_t i : members) {
                     const Param& p = params_[i];
                     OptimizerTensor o{into_spare ? p.spare[0] : p.state[0]};
                     for (std::size_t k = 0; k < state_slots() && k < kMaxOptimizerSlots; ++k) {
                       o.state[k] = into_spare ? p.spare[1 + k] : p.state[1 + k];
                       if (into_spare) o.state_src[k] = p.state[1 + k];
                     }
                     if (into_spare) o.param_src = p.state[0];
                     if (counts) o.step = into_spare ? &(spec_steps_[i] = steps_[i]) : &steps_[i];
                     o.grad = p.acc;
                     o.compute_param = p.out;
                     t.push_back(o);
                   }
                   with_unit(configs[group], [&](auto, const auto& cfg) {
                     engine_.step(std::span<const OptimizerTensor>(t), cfg, r);
                   });
                 });
}

void OffloadGradientManager::upload_chunk(std::size_t k, const Event& after, bool staged) {
  const Chunk& c = chunks()[k];
  on_device([&] {
    dev_.wait(Queue::h2d, after);  // backward's use of the old weights comes first
    for (std::size_t i = c.first; i < c.last; ++i) {
      const Param& p = params_[i];
      if (p.out.numel != 0)
        dev_.copy(Queue::h2d, p.compute.data, staged ? p.staged.data : p.out.data, p.out.bytes());
    }
    last_upload_ = dev_.record(Queue::h2d);
  });
}

void OffloadGradientManager::stage_chunk(std::size_t k) {
  // The h2d queue is FIFO: this follows the previous commit's reads of the staging, and
  // the commit's copy out of it follows this. A re-step that rewrites the upload buffers
  // waits for it (wait_uploads).
  const Chunk& c = chunks()[k];
  on_device([&] {
    for (std::size_t i = c.first; i < c.last; ++i) {
      const Param& p = params_[i];
      if (p.out.numel != 0) dev_.copy(Queue::h2d, p.staged.data, p.out.data, p.out.bytes());
    }
    last_upload_ = dev_.record(Queue::h2d);
  });
}

void OffloadGradientManager::wait_uploads() {
  Event e;
  {
    const std::lock_guard lock(dev_mu_);
    e = last_upload_;
  }
  sync_event(e);
}

// ---- the hooks ----------------------------------------------------------------------------

void OffloadGradientManager::do_import_parameter(std::size_t i, Arrays<const float> arrays,
                                                 float step) {
  drain();
  wait_uploads();
  Param& p = params_[i];
  for (std::size_t s = 0; s < slots(); ++s) {
    const TensorView& dst = p.state[s];
    if (dst.numel == 0) continue;
    if (!arrays[s].empty()) {
      std::memcpy(dst.data, arrays[s].data(), dst.bytes());
    } else {  // a slot's initial value (the master is never empty here)
      float* d = static_cast<float*>(dst.data);
      std::fill(d, d + dst.numel, initial_slot_value(s - 1));
    }
  }
  steps_[i] = step;
  if (p.out.numel == 0) return;
  round_into(arrays[0], p.out);
  const Event e = on_device([&] {
    dev_.copy(Queue::h2d, p.compute.data, p.out.data, p.out.bytes());
    return last_upload_ = dev_.record(Queue::h2d);
  });
  sync_event(e);
}

void OffloadGradientManager::do_begin_step() {
  drain();  // the previous step's tasks, and their errors
  ++generation_;
  wait_uploads();
  norm_known_ = false;
  norm_ = NormResult{};
  clip_ = 1.0f;
  report_ = StepReport{};
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
  std::fill(chunk_partial_.begin(), chunk_partial_.end(), NormPartial{});
}

void OffloadGradientManager::do_begin_backward() {
  raise_if_failed();
  // Backward rewrites the gradient buffers: the previous micro-batch's copies must be done.
  sync_event(last_d2h_);
}

TensorView OffloadGradientManager::do_gradient(std::size_t i) {
  raise_if_failed();
  return params_[i].grad;
}

void OffloadGradientManager::do_gradient_ready(std::size_t i, bool first_in_step,
                                               ConstTensorView grad, const Event& written) {
  raise_if_failed();
  Param& p = params_[i];
  // Staging i is free once the worker has accumulated its previous contents.
  wait_done(main, staging_task_[i]);
  raise_if_failed();
  Event copied;
  if (grad.numel != 0) {
    copied = on_device([&] {
      dev_.wait(Queue::d2h, dev_.record(Queue::compute));  // backward's writes first
      dev_.wait(Queue::d2h, written);                      // and the trainer's event
      dev_.copy(Queue::d2h, p.staging.data, grad.data, grad.bytes());
      return last_d2h_ = dev_.record(Queue::d2h);
    });
  }
  released_[i] = copied;  // the device buffer (the manager's or the caller's) is free once staged
  staging_task_[i] = post(
      [this, &p, copied, first_in_step] {
        sync_event(copied);
        const AccumulatePair pair{p.acc, p.staging, first_in_step};
        engine_.accumulate({&pair, 1});
      },
      main);
}

void OffloadGradientManager::do_finish_final_backward(std::span<const std::size_t> no_gradient) {
  raise_if_failed();
  if (no_gradient.empty()) return;
  post(
      [this, missing = std::vector<std::size_t>(no_gradient.begin(), no_gradient.end())] {
        for (std::size_t i : missing)
          if (params_[i].acc.numel != 0)
            std::memset(params_[i].acc.data, 0, params_[i].acc.bytes());
      },
      main);
}

bool OffloadGradientManager::admit(std::size_t k) {
  if (has_spare_[k]) return true;
  const std::size_t bytes = chunk_state_bytes_[k];
  // The budget, not the mapping: HostBuffer rounds it up to a (huge) page.
  const std::size_t limit = std::min(spare_space_.bytes(), speculation_budget());
  if (bytes > limit - spare_used_) return false;
  // The chunk keeps this spare from now on (a commit swaps it with the live state).
  for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i)
    for (std::size_t s = 0; s < slots(); ++s) {
      TensorView& v = params_[i].spare[s];
      v = f32_view(reinterpret_cast<float*>(static_cast<char*>(spare_space_.data()) + spare_used_),
                   params_[i].state[s].numel);
      spare_used_ += (v.bytes() + kSlabViewAlignment - 1) / kSlabViewAlignment * kSlabViewAlignment;
    }
  has_spare_[k] = 1;
  // Device staging, when the chunk's compute weights fit what is left of it.
  if (chunk_compute_bytes_[k] != 0 && chunk_compute_bytes_[k] <= stage_bytes_ - stage_used_) {
    for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i) {
      Param& p = params_[i];
      if (p.out.numel == 0) continue;
      p.staged = {static_cast<char*>(stage_space_) + stage_used_, p.out.numel, p.out.dtype};
      stage_used_ +=
          (p.out.bytes() + kSlabViewAlignment - 1) / kSlabViewAlignment * kSlabViewAlignment;
    }
    has_stage_[k] = 1;
  }
  return true;
}

void OffloadGradientManager::do_reserve_speculation() {
  const std::int64_t device_budget = config().speculation_device_bytes;
  if (stage_space_ == nullptr && device_budget != 0) {
    std::size_t need = 0;
    for (std::size_t bytes : chunk_compute_bytes_) need += bytes;
    const std::size_t bytes = device_budget == ManagerConfig::kAllChunks
                                  ? need
                                  : std::min(need, static_cast<std::size_t>(device_budget));
    if (bytes != 0) {
      try {
        const std::lock_guard lock(dev_mu_);  // not on_device: a refusal fails nothing
        stage_space_ = dev_.allocate(bytes);
      } catch (const Error& e) {
        throw Error(
            Errc::out_of_range, "speculation_device_bytes",
            "cannot reserve " + std::to_string(bytes) + " bytes of device staging: " + e.what());
      }
      stage_bytes_ = bytes;
    }
  }
  if (spare_space_.data() != nullptr) return;
  std::size_t need = 0;
  for (std::size_t bytes : chunk_state_bytes_) need += bytes;
  const std::size_t bytes = std::min(need, speculation_budget());
  if (bytes == 0) return;
  try {
    spare_space_ = numa::HostBuffer(bytes, config().numa_node);
  } catch (const Error& e) {
    throw Error(
        Errc::out_of_range, "speculation_bytes",
        "cannot reserve " + std::to_string(bytes) + " bytes of rollback space: " + e.what());
  }
}

void OffloadGradientManager::do_step_chunk(std::size_t chunk) {
  raise_if_failed();
  const float scale = gradient_scale();
  const bool speculate = speculating() && admit(chunk);
  speculated_[chunk] = speculate ? 1 : 0;
  // The chunk's part of the global norm (exact integer partials merge in any order).
  post(
      [this, chunk, scale] {
        chunk_partial_[chunk] =
            engine_.norm_partial(chunk_counted_[chunk], GradientRead{scale, 1.0f}, NormMode::fast);
      },
      main);
  // Speculating: its step as if the coefficient were 1 and the step finite, unless the
  // decision (a rollback or skip) came first.
  if (speculate)
    post([this, chunk, scale, gen = generation_, configs = group_configs()] {
      if (cancelled_.load(std::memory_order_acquire) == gen) return;
      step_chunk(chunk, GradientRead{scale, 1.0f}, configs, /*into_spare=*/true);
      if (has_stage_[chunk]) stage_chunk(chunk);
    });
}

NormResult OffloadGradientManager::overlapped_global_norm(float scale) {
  // The fast partial of the counted accumulators is the merge of the chunks' partials
  // (their digits are exact integers; the error bounds add like threads' do).
  auto local = [&](std::span<const ConstTensorView> tensors, cpu::NormMode mode) {
    if (mode != NormMode::fast) {  // rare: the engine here, so nothing else may use it
      drain();
      return engine_.norm_partial(tensors, GradientRead{scale, 1.0f}, mode);
    }
    drain(main);  // the partials (the speculative steps may still run)
    NormPartial merged{};
    for (const NormPartial& p : chunk_partial_) merge(merged, p);
    return merged;
  };
  if (config().comm == nullptr) {
    const NormResult r = finalize(local(counted_acc_, NormMode::fast));
    return r.needs_exact ? finalize(local(counted_acc_, NormMode::exact)) : r;
  }
  return comm::detail::global_norm(*config().comm, config().layout_fingerprint, counted_acc_,
                                   local);
}

void OffloadGradientManager::post_step_end() {
  post([this] {
    wait_uploads();
    step_end_ = std::chrono::steady_clock::now();
  });
}

NormResult OffloadGradientManager::do_clip_grad_norm(float max_norm, float& clip) {
  // No early raise: a failed rank still joins the reduction (global_norm reports it).
  norm_ = overlap() ? overlapped_global_norm(gradient_scale()) : global_norm(gradient_scale());
  norm_known_ = true;
  // Not finite: the step is skipped; 0 is what the device modes' finalize_and_clip sets.
  clip_ = norm_.finite ? clip_coefficient(norm_.norm, max_norm) : 0.0f;
  clip = clip_;
  if (overlap() && !keeps_speculation()) cancel_speculation();
  return norm_;
}

bool OffloadGradientManager::keeps_speculation() const {
  // Speculated chunks stay as they are when the coefficient is 1 (an optimizer that does
  // not read it, SignSGD: any coefficient) and the step is finite.
  return norm_.finite && (clip_ == 1.0f || !shape().reads_scaled);
}

void OffloadGradientManager::cancel_speculation() {
  cancelled_.store(generation_, std::memory_order_release);
}

void OffloadGradientManager::do_step() {
  if (!norm_known_) {  // found-inf needs the norm even without clipping
    norm_ = overlap() ? overlapped_global_norm(gradient_scale()) : global_norm(gradient_scale());
    norm_known_ = true;
  }
  raise_if_failed();
  report_.norm = norm_;
  report_.clip_coefficient = clip_;
  const bool keep = keeps_speculation();
  if (overlap() && !keep) cancel_speculation();  // speculative steps not yet run: skipped
  set_would_commit(keep);
  for (std::size_t k = 0; k < chunks().size(); ++k)
    if (speculated_[k]) {
      ++report_.chunks_speculated;
      ++(keep ? report_.chunks_committed : report_.chunks_rolled_back);
    }
  if (!norm_.finite) {       // found-inf: nothing changes, the step counters stay
    report_.skipped = true;  // speculated chunks wrote only their spares: nothing to undo
    post_step_end();
    return;
  }
  report_.stepped = true;
  const GradientRead read{gradient_scale(), clip_};
  const Event backward = on_device([&] { return dev_.record(Queue::compute); });
  const auto configs = std::make_shared<const GroupConfigs>(group_configs());
  for (std::size_t k = 0; k < chunks().size(); ++k) {  // chunk k's upload overlaps k+1's step
    if (speculated_[k] && keep) {
      post([this, k, backward] {
        // Commit: the spares hold the stepped state; the old live arrays become spares.
        for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i) {
          std::swap(params_[i].state, params_[i].spare);
          if (shape().counts_steps) steps_[i] = spec_steps_[i];
        }
        upload_chunk(k, backward, has_stage_[k] != 0);
      });
    } else {  // waited, or rolled back: the live state is the step's old state
      post([this, k, read, backward, configs, staged = speculated_[k] && has_stage_[k]] {
        if (staged) wait_uploads();  // its staging upload still reads the upload buffers
        step_chunk(k, read, *configs);
        upload_chunk(k, backward);
      });
    }
  }
  post_step_end();
}

StepReport OffloadGradientManager::do_report() {
  drain();
  wait_uploads();
  StepReport r = report_;
  if (r.stepped || r.skipped)
    r.exposed_seconds =
        std::max(0.0, std::chrono::duration<double>(step_end_ - last_gradient_time()).count());
  return r;
}

ConstTensorView OffloadGradientManager::do_compute_weights(std::size_t i) const {
  raise_if_failed();
  return params_[i].compute;
}

void OffloadGradientManager::do_read_parameter(std::size_t i, Arrays<float> arrays,
                                               std::span<std::uint8_t> compute) {
  drain();
  wait_uploads();
  const Param& p = params_[i];
  for (std::size_t s = 0; s < slots(); ++s)
    if (!arrays[s].empty()) std::memcpy(arrays[s].data(), p.state[s].data, arrays[s].size_bytes());
  if (compute.empty()) return;
  // What the device holds, through the (idle) pinned upload buffer.
  const Event e = on_device([&] {
    dev_.copy(Queue::d2h, p.out.data, p.compute.data, p.out.bytes());
    return dev_.record(Queue::d2h);
  });
  sync_event(e);
  std::memcpy(compute.data(), p.out.data, compute.size());
}

void OffloadGradientManager::do_step_counts(std::span<float> out) {
  drain();
  std::copy(steps_.begin(), steps_.end(), out.begin());
}

ManagerImpl::HostArrays OffloadGradientManager::do_host_state(std::size_t i) {
  drain();
  wait_uploads();
  const Param& p = params_[i];
  HostArrays h;
  for (std::size_t s = 0; s < slots(); ++s)
    h.a[s] = {static_cast<const float*>(p.state[s].data), p.state[s].numel};
  return h;
}

void OffloadGradientManager::do_synchronize() {
  drain();
  wait_uploads();
  sync_event(last_d2h_);
}

void OffloadGradientManager::do_recover() {
  std::uint64_t seq;
  {
    const std::lock_guard lock(mu_);
    seq = posted_[main];
  }
  wait_done(main, seq);  // the worker skipped the failed step's remaining tasks
  {
    const std::lock_guard lock(mu_);
    seq = posted_[late];
  }
  wait_done(late, seq);
  {
    const std::lock_guard lock(dev_mu_);
    try {
      dev_.synchronize();  // the queued work; its errors are the stored one's
    } catch (const Error&) {
    }
    dev_.synchronize();  // a device that fails again cannot continue
  }
  {
    const std::lock_guard lock(err_mu_);
    error_ = nullptr;
  }
  norm_known_ = false;
  norm_ = NormResult{};
  clip_ = 1.0f;
  report_ = StepReport{};
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
}

std::exception_ptr OffloadGradientManager::do_close() noexcept {
  if (closed_) return nullptr;
  closed_ = true;
  {
    const std::lock_guard lock(mu_);
    stop_ = true;
  }
  task_cv_.notify_all();
  if (worker_.joinable()) worker_.join();  // runs the queued tasks (skipped after a failure)
  try {
    dev_.synchronize();
  } catch (...) {
    store_error(std::current_exception());
  }
  if (pinned_slab_ != nullptr) dev_.deallocate_host(pinned_slab_);
  if (dev_slab_ != nullptr) dev_.deallocate(dev_slab_);
  if (stage_space_ != nullptr) dev_.deallocate(stage_space_);
  pinned_slab_ = dev_slab_ = stage_space_ = nullptr;
  state_ = numa::HostBuffer{};
  spare_space_ = numa::HostBuffer{};
  const std::lock_guard lock(err_mu_);
  return error_;
}

}  // namespace

std::unique_ptr<ManagerImpl> make_offload_gradient_manager(ManagerConfig config) {
  return std::make_unique<OffloadGradientManager>(std::move(config));
}

}  // namespace stepcore::detail
