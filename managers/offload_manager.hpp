// OffloadGradientManager (mode "full"): gradients copied device-to-host through a pinned
// ring as backward hands them over, accumulated, normed, clipped and stepped in f32 on
// the CPU engine by one worker thread, compute weights uploaded host-to-device through a
// second ring. docs/managers.md is the contract; every result equals the GPU modes' bits.
// Its parts: construction and the state's import and export (offload_manager.cpp), the
// worker and the sticky error (offload_manager_worker.cpp), the rings and the piecewise
// step (offload_manager_ring.cpp), the step (offload_manager_step.cpp), overlapped
// steps' speculation (offload_manager_speculation.cpp).
//
// Memory: host state is the masters and slots, the f32 accumulators only once a step
// accumulates (allocated by the first step of two or more micro-batches), and the rings
// (ManagerConfig::ring_slots × ring_slot_elements each): nothing else grows with the
// model. A step of one micro-batch while no accumulator exists holds its gradients on the
// device: each arrives through the staging ring for the norm's partial and is read again
// by the step through the fetch ring (a "holding" step), so its buffer is released by
// step(), not at arrival. Where the device is host_accessible() nothing is copied: the
// arrival's partial and the step read the gradient in place, and the step writes the
// compute weights in place.
//
// Threads: the caller's thread (the trainer's) runs the hooks, enqueues the copies and
// the norm collectives; the worker runs tasks from two FIFO lanes: `main` (accumulate,
// the chunks' norm partials) first, `late` (speculative steps, the step's updates and
// uploads) when main is empty — so a late task runs after every main task posted before
// it, and the decision waits only for what the norm needs, not for speculative steps
// it may cancel (a rollback or skip cancels the step's speculative tasks not yet run).
// All Device calls are serialised by dev_mu_; waits on events happen outside it
// (Event::wait_for), then synchronize(event) collects errors under it. The worker never
// joins a collective, so it cannot hang on a peer; every wait for the device's work is
// bounded by Device::wait_timeout() (a gradient copy stuck behind a trainer's event that
// never completes, as when an FSDP peer died mid reduce-scatter): past it the wait fails
// with Errc::timeout naming what it waited for. An error of asynchronous work makes the
// manager failed: every later hook raises that same error (sticky), close() returns it,
// load_checkpoint recovers from it once the device's queues drain within the bound.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "managers/manager_impl.hpp"
#include "managers/offload_layout.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/host_slab.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/numa.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::detail {

class OffloadGradientManager final : public ManagerImpl {
 public:
  explicit OffloadGradientManager(ManagerConfig config);
  ~OffloadGradientManager() override { (void)do_close(); }

 protected:
  void do_import_parameter(std::size_t i, Arrays<const float> arrays, Q8In q8, float step) override;
  void do_import_range(std::size_t i, std::size_t offset, Arrays<const float> arrays, float step,
                       bool last) override;
  void do_import_q8_range(std::size_t i, std::size_t s, bool absmax, std::size_t offset,
                          std::span<const std::byte> bytes) override;
  bool do_imports_ranges() const noexcept override { return true; }
  void do_begin_step() override;
  void do_begin_backward(bool final_backward, bool first_backward) override;
  TensorView do_gradient(std::size_t i) override;
  void do_gradient_ready(std::size_t i, bool first_in_step, ConstTensorView grad,
                         const device::Event& written) override;
  device::Event do_gradient_released(std::size_t i) const override;
  bool do_reads_gradients_at_step() const noexcept override { return holding_; }
  void do_finish_final_backward(std::span<const std::size_t> no_gradient) override;
  void do_step_chunk(std::size_t chunk) override;
  void do_reserve_speculation() override;
  NormResult do_clip_grad_norm(float max_norm, float& clip) override;
  void do_step() override;
  StepReport do_report() override;
  ConstTensorView do_compute_weights(std::size_t i) const override;
  void do_read_parameter(std::size_t i, Arrays<float> arrays, Q8Out q8,
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
  // A parameter's views in the host state slab: kMaxSlots arrays (the master, the slots or
  // 8-bit slots' codes), then kMaxOptimizerSlots 8-bit slots' block maxima.
  static constexpr std::size_t kStateViews = kMaxSlots + kMaxOptimizerSlots;
  using Slots = std::array<TensorView, kMaxSlots>;

  // Per-parameter views into the slabs.
  struct Param {
    TensorView grad;     // device, grad_dtype
    TensorView compute;  // device, compute_dtype (empty without compute weights)
    TensorView staged;   // device staging of speculated compute weights (empty: none)
    TensorView acc;      // host f32 (empty until a step accumulates)
    Slots state;         // host f32, the live state (slots() of them used; a q8 one's
                         // state slots empty)
    Slots spare;         // host f32 in the rollback space (empty until its chunk has one)
    // A q8 parameter's 8-bit state slots (ManagerConfig::q8_state), live and spare, in slot
    // order; both empty for f32 slots.
    std::array<Q8Slot, kMaxOptimizerSlots> q8{}, q8_spare{};
    TensorView out;        // pinned, compute_dtype: a speculated step's compute weights
                           // (rollback space; empty until its chunk has one)
    ConstTensorView held;  // a holding step's gradient on the device (empty: zero)
    const TensorView& master() const { return state[0]; }
  };
  std::size_t slots() const noexcept { return 1 + state_slots(); }
  // The host bytes of parameter i's state array s (0: the master): f32 values, or an 8-bit
  // slot's codes and block maxima, each view aligned as in the slab.
  std::size_t array_bytes(std::size_t i, std::size_t s) const;
  // The groups' optimizer configurations now (tasks take a copy: the caller's thread may
  // change the groups while they wait).
  using GroupConfigs = std::vector<OptimizerConfig>;

  // Carves the slabs into the per-parameter views and places the state pages.
  void carve(const SlabLayout& dl, const SlabLayout& sl);
  // Allocates the accumulators (the first step that accumulates) and has the worker
  // point the views at them and place their pages (place_accumulators).
  void allocate_accumulators();
  void place_accumulators(const SlabLayout& layout, numa::HostBuffer space);

  // What a bounded wait waits for, named by its timeout error.
  struct Awaited {
    enum Kind : std::uint8_t {
      gradient_copy,  // parameter `index`'s gradient into staging (after `written`)
      upload,         // parameter `index`'s compute weights to the device (import)
      chunk_upload,   // chunk `index`'s compute weights to the device (a step)
      read_back,      // parameter `index`'s compute weights from the device
      queues,         // everything queued on the copy queues (`index` unused)
    } kind;
    std::size_t index;
  };

  // ---- the rings (offload_manager_ring.cpp) -----------------------------------------------
  // A pinned ring: ring_.slots slots of ring_.slot_elements elements of `elem_bytes` each.
  struct Ring {
    char* base = nullptr;
    std::size_t elem_bytes = 0, slot_elements = 0;
    char* at(std::size_t slot, std::size_t element) const {
      return base + (slot * slot_elements + element) * elem_bytes;
    }
  };
  // One piece of a parameter placed in a ring slot.
  struct Piece {
    std::size_t param, offset, count, slot, at;
  };
  // Where a ring is filled next, and what frees each slot.
  struct Cursor {
    std::size_t slot = 0, used = 0;
  };
  // Returns the pieces of `members`, packed into batches of one slot each (batch b's
  // pieces have slot == b), a slot of batch_elements elements when non-zero (a batch that
  // goes through no ring) instead of the ring's.
  std::vector<std::vector<Piece>> batches(std::span<const std::size_t> members,
                                          std::size_t batch_elements = 0) const;
  // Merges into `partial` the fast norm partial of the held gradient `src` read with
  // `scale` (held_read: as an accumulator holding it would be read). Worker only.
  void add_held_partial(NormPartial& partial, const ConstTensorView& src, float scale);
  // The read of a held gradient: its products rounded in f32, as the read of its exact
  // widening into an accumulator (an accumulating step's) rounds them.
  static GradientRead held_read(float scale, float clip);
  // A holding step's arrival of parameter i's gradient on a host-accessible device: its
  // norm partial posted (one task, one engine call), read in place after backward's
  // writes and `written`.
  void hold_in_place(std::size_t i, const ConstTensorView& grad, const device::Event& written);
  // Copies piece `pc` of `grad` (device) into the staging ring and posts its use.
  void stage_piece(std::size_t i, bool first_in_step, const ConstTensorView& grad, const Piece& pc,
                   bool wait_written, const device::Event& written);
  // The step's part of chunk k (worker, or the caller's thread while the worker is idle):
  // its parameters stepped batch by batch, each batch's gradients from the accumulators
  // or read again from the device (a holding step), the compute weights written to the
  // upload ring and uploaded to `target` after `after`.
  enum class Target : std::uint8_t {
    live,         // in place; compute weights to the model's
    spare,        // into the spares; compute weights into the pinned rollback space
    spare_staged  // into the spares; compute weights to the device staging
  };
  // A speculative step (`generation` non-zero) stops at the next batch once that
  // generation's speculation is cancelled: it wrote only spares, which nothing reads then.
  void run_chunk(std::size_t k, GradientRead read, const GroupConfigs& configs, Target target,
                 const device::Event& after, std::uint64_t generation = 0);
  // Uploads the rounding of elements [offset, offset + count) of parameter i's master
  // through the upload ring (no wait: between steps).
  void upload_rounded_range(std::size_t i, std::size_t offset, std::size_t count);
  // Returns the next upload slot, once its previous upload is done.
  std::size_t next_upload_slot();
  // Copies piece `pc` of parameter i's held gradient into fetch slot `slot` (recorded in
  // fetched_[slot]); nothing on a host-accessible device (read in place); an empty held
  // gradient is zeros written there.
  void fetch_piece(const Piece& pc, std::size_t slot);
  // Piece `pc` of its held gradient where the step reads it (once fetched_[slot] is done):
  // in place, or in fetch slot `slot`.
  ConstTensorView held_piece(const Piece& pc, std::size_t slot) const;
  // A holding step's norm partial over the counted gradients read again (mode `mode`).
  NormPartial held_norm_partial(NormMode mode, float scale);
  // The step's local norm partial (the decision's) in `mode`.
  NormPartial local_partial(NormMode mode, float scale);

  // ---- errors --------------------------------------------------------------------------
  void store_error(std::exception_ptr ep) noexcept;
  void raise_if_failed() const;
  // Runs f under dev_mu_; a Device error becomes the manager's (sticky) error.
  template <class F>
  decltype(auto) on_device(F&& f);
  // The Errc::timeout error of a wait for `what` that passed the device's wait bound.
  Error timeout_error(Awaited what) const;
  // Waits for e (any thread) up to the device's wait_timeout(), then raises the device's
  // errors; past the bound, the timeout error of `what`. Either is sticky.
  void sync_event(const device::Event& e, Awaited what);
  // Waits up to `bound` for the work queued so far on the copy queues (an event recorded
  // on each now), then raises its errors; returns false at the bound (the work may still
  // run: nothing it uses may be freed). Not sticky: the caller decides.
  bool wait_copy_queues(std::chrono::milliseconds bound);
  // The stored error is a timed-out wait (the device's queues were found stuck).
  bool failed_by_timeout() const noexcept;

  // ---- the worker ------------------------------------------------------------------------
  enum Lane : std::size_t { main = 0, late = 1 };
  std::uint64_t post(std::function<void()> task, Lane lane = late);
  void wait_done(Lane lane, std::uint64_t seq) const;
  void drain(Lane lane);  // waits for the lane's posted tasks, then raises a stored error
  void drain();           // both lanes
  void worker_loop();

  // ---- numerics --------------------------------------------------------------------------
  // The decision's global norm: over the accumulators, or merged from the chunks'
  // partials (overlapped or holding steps), over every rank.
  NormResult global_norm(float scale);
  GroupConfigs group_configs() const;

  // Gives chunk k a spare from the rollback space when it has none and it fits.
  bool admit(std::size_t k);
  // Posts the step's last task: waits for its uploads and stamps the end of the step.
  void post_step_end();
  // The decision keeps the speculated chunks (finite, and coefficient 1 or an optimizer
  // that does not read it).
  bool keeps_speculation() const;
  // Makes this step's speculative tasks not yet run skip (a rollback or skip).
  void cancel_speculation();
  // Copies chunk k's speculated compute weights to the model's after `after`: device to
  // device from its staging, or uploaded from its pinned rollback space.
  void commit_compute(std::size_t k, const device::Event& after);  // on the worker
  void wait_uploads();

  device::Device& dev_;
  cpu::Engine engine_;
  std::vector<Param> params_;
  std::vector<float> steps_;
  std::vector<ConstTensorView> counted_acc_;                 // the global norm's tensors
  std::vector<std::vector<ConstTensorView>> chunk_counted_;  // a chunk's counted tensors

  void* dev_slab_ = nullptr;
  void* pinned_slab_ = nullptr;
  numa::HostBuffer state_;      // masters and slots
  numa::HostBuffer acc_space_;  // accumulators (empty until a step accumulates)
  std::size_t acc_bytes_ = 0;   // their bytes (aligned views)

  // The rings: staging (gradients in, the caller's thread fills, the worker empties),
  // upload (compute weights out) and fetch (a holding step's gradients read again).
  RingGeometry ring_;
  Ring staging_ring_, upload_ring_, fetch_ring_;
  Cursor staging_at_;                        // caller's thread
  std::vector<std::uint64_t> staging_task_;  // per slot: the last main task reading it
  std::size_t upload_next_ = 0;              // the next upload slot
  std::vector<device::Event> upload_done_;   // per slot: its last upload
  std::vector<device::Event> fetched_;       // per fetch slot: its copies
  double staging_wait_ = 0.0;                // seconds waited for a staging slot (caller)
  bool holding_ = false;                     // this step holds its gradients on the device
  bool step_posted_ = false;                 // this step's step() ran
  std::uint64_t step_end_task_ = 0;          // its last task (late lane)

  // Speculation: the rollback space (reserved by the first step that speculates), each
  // chunk's bytes of spares, how much is given out; per step, what each chunk did.
  numa::HostBuffer spare_space_;
  std::size_t spare_used_ = 0, spare_cap_ = 0;  // state spares: used, the budget's share
  // The rollback space's pinned part: speculated compute weights, uploaded by a commit.
  void* out_space_ = nullptr;
  std::size_t out_used_ = 0, out_cap_ = 0;
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
  device::Event last_d2h_;          // the latest gradient copy (caller thread only)
  std::size_t last_d2h_param_ = 0;  // its parameter
  device::Event last_upload_;       // the latest compute-weight upload (under dev_mu_)
  Awaited last_upload_what_{Awaited::upload, 0};  // what it uploads (under dev_mu_)

  // The worker.
  mutable std::mutex mu_;
  mutable std::condition_variable task_cv_, done_cv_;
  std::deque<std::function<void()>> tasks_[2];  // per Lane
  std::uint64_t posted_[2] = {0, 0}, done_[2] = {0, 0};
  std::uint64_t generation_ = 0;             // steps begun (caller thread; tasks capture it)
  std::atomic<std::uint64_t> cancelled_{0};  // speculative tasks of this generation skip
  bool stop_ = false;
  std::vector<device::Event> released_;  // per parameter: its device buffer is staged
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

template <class F>
inline decltype(auto) OffloadGradientManager::on_device(F&& f) {
  const std::lock_guard lock(dev_mu_);
  try {
    return std::forward<F>(f)();
  } catch (...) {
    store_error(std::current_exception());
    raise_if_failed();
    throw;  // unreachable: an error was stored
  }
}

}  // namespace stepcore::detail
