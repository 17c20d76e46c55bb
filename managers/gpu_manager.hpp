// The device-resident gradient manager: mode "none" (gradients, accumulators, masters and
// the optimizer's state slots in device memory) and mode "optimizer" (the same, with the optimizer
// state in host memory streamed through a ring of device slots chunk by chunk). Everything goes
// through device::Device; docs/managers.md is the contract. Its parts: construction, memory
// and the state's import and export (gpu_manager.cpp), the step (gpu_manager_step.cpp),
// overlapped steps' speculation (gpu_manager_speculation.cpp).
//
// Design: memory is allocated once (one device block of 256-byte aligned views,
// one norm workspace, one pinned host block holding the flag words and, in mode
// optimizer, each chunk's masters|slot 0|slot 1.. laid out contiguously so a chunk moves
// in one copy). The optimizer step goes through managers/device_step.hpp, the one place
// that meets the device's optimizer calls.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <vector>

#include "kernels/checked_plans.hpp"
#include "kernels/plan_cache.hpp"
#include "managers/manager_impl.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/device.hpp"
#include "stepcore/host_slab.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::detail {

class GpuGradientManager final : public ManagerImpl {
 public:
  explicit GpuGradientManager(ManagerConfig config);
  ~GpuGradientManager() override;

 protected:
  void do_import_parameter(std::size_t i, Arrays<const float> arrays, Q8In q8, float step) override;
  void do_import_range(std::size_t i, std::size_t offset, Arrays<const float> arrays, float step,
                       bool last) override;
  void do_import_q8_range(std::size_t i, std::size_t s, bool absmax, std::size_t offset,
                          std::span<const std::byte> bytes) override;
  bool do_imports_ranges() const noexcept override { return true; }
  void do_begin_step() override;
  void do_begin_backward(bool, bool) override {}
  TensorView do_gradient(std::size_t i) override { return params_[i].grad; }
  void do_gradient_ready(std::size_t i, bool first_in_step, ConstTensorView grad,
                         const device::Event& written) override;
  // The compute queue is in order: an event recorded now follows the accumulation of i's
  // last gradient (and whatever came after it), so no event is made per gradient.
  device::Event do_gradient_released(std::size_t i) const override {
    return accumulated_[i] ? dev_.record(device::Queue::compute) : device::Event();
  }
  void do_finish_final_backward(std::span<const std::size_t> no_gradient) override;
  void do_step_chunk(std::size_t chunk) override;
  void do_reserve_speculation() override;
  NormResult do_clip_grad_norm(float max_norm, float& clip) override;
  void do_step() override;
  StepReport do_report() override;
  ConstTensorView do_compute_weights(std::size_t i) const override;
  void do_read_parameter(std::size_t i, Arrays<float> arrays, Q8Out q8,
                         std::span<std::uint8_t> compute) override;
  void do_read_range(std::size_t i, std::size_t offset, Arrays<float> arrays) override;
  void do_read_q8_range(std::size_t i, std::size_t s, bool absmax, std::size_t offset,
                        std::span<std::byte> out) override;
  void do_step_counts(std::span<float> out) override;
  HostArrays do_host_state(std::size_t i) override;
  void do_synchronize() override;
  void do_recover() override;
  std::exception_ptr do_close() noexcept override;

 private:
  static constexpr std::size_t kRingSlots = 3;  // upload k+1, step k, download k-1 at once
  // max_norm of the finalizations that only need the norm and found-inf flag (no clipping:
  // the update then reads the constant 1, whatever clip this writes).
  static constexpr float kNoClipMaxNorm = 1.0f;
  // Returns `bytes` rounded up to the views' alignment (each rollback array starts aligned).
  static constexpr std::size_t align_up(std::size_t bytes) {
    return (bytes + kSlabViewAlignment - 1) / kSlabViewAlignment * kSlabViewAlignment;
  }

  // The step's norm, clip, found-inf flag and reduced layout record: written on the
  // device, copied to the host in one piece.
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

  static constexpr std::size_t kMaxSlots = 1 + kMaxOptimizerSlots;
  // One parameter's buffers. state: the master, then the optimizer's state slots, in
  // device memory (mode none) or the host block of its chunk (mode optimizer); off:
  // their offsets in that block. An 8-bit parameter (q8_param) keeps in state[1 + s] its
  // slot s's codes (bytes), and its block maxima in absmax[s] (offset max_off[s]).
  struct Param {
    TensorView grad, acc, compute;
    float* state[kMaxSlots] = {};
    std::size_t off[kMaxSlots] = {};
    float* absmax[kMaxOptimizerSlots] = {};
    std::size_t max_off[kMaxOptimizerSlots] = {};
    bool q8 = false;
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
      std::size_t grad = 0, acc = 0, compute = 0, state[kMaxSlots] = {},
                  absmax[kMaxOptimizerSlots] = {};
    };
    std::vector<Views> param;
    std::size_t scalars = 0, steps = 0, hyper = 0;  // device: StepScalars, counters, hyper
    std::vector<std::size_t> bias;                  // device: one per distinct bias table
    std::vector<std::size_t> bias_of;               // per group: its index into bias
    std::size_t codebooks = 0;                      // device: gpu::q8_codebooks()
    std::vector<std::size_t> slots;                 // device: mode optimizer's ring
    std::size_t words = 0, host_hyper = 0;          // host: HostWords, the hyper staging
    std::vector<std::size_t> chunk_host;            // host: mode optimizer's chunk blocks
    SlabLayout device, host;
  };

  bool streamed() const noexcept { return mode() == OffloadMode::optimizer; }
  // Copies host bytes to where a state array lives (device memory in mode none, the host
  // block in mode optimizer; `src` null: zeros), or from there to host memory (enqueued
  // on the compute queue in mode none: the caller waits).
  void put_bytes(void* dst, const void* src, std::size_t bytes);
  void get_bytes(void* dst, const void* src, std::size_t bytes);
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
  // Records what allocate_memory allocated in the ledger, by kind (memory()).
  void account_memory(const MemoryPlan& plan);
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
  // Parameter i's 8-bit slot k for the step: where it lives (or in `slot`), or (speculating)
  // its copy in the rollback space, the copy enqueued first.
  Q8Slot q8_slot(std::size_t i, std::size_t k, std::byte* slot, bool to_staging);
  // The number of state arrays per parameter (the master and the optimizer's slots): the
  // speculation's outputs and commit copies go over this list, not over names.
  std::size_t slots() const noexcept { return 1 + state_slots(); }
  bool counts() const noexcept { return shape().counts_steps; }
  // Returns parameter i's state array s where it lives between steps (device memory in
  // mode none, its place in the chunk's host block in mode optimizer), or in `slot`
  // (an 8-bit slot's codes, as bytes).
  float* state_at(std::size_t i, std::size_t s, std::byte* slot) const;
  // The block maxima of parameter i's 8-bit slot s, where they live or in `slot`.
  float* absmax_at(std::size_t i, std::size_t s, std::byte* slot) const;
  // The bytes of parameter i's state array s (the master, an f32 slot, or an 8-bit slot's
  // codes), and of each of its 8-bit slots' maxima (0 for f32 slots).
  std::size_t array_bytes(std::size_t i, std::size_t s) const;
  std::size_t absmax_bytes(std::size_t i) const;
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
  void wait_for(const device::Event& e);
  void wait_all();
  void wait_idle();

  device::Device& dev_;
  bool eager_ = true;  // acc <- R(acc * s) in place at the final finish_backward
  std::vector<Param> params_;
  std::vector<std::uint8_t> accumulated_;  // per parameter: a gradient was read at least once
  // Per parameter, its accumulate's validated plans, one per copy flag (the step's first
  // micro-batch copies, the others add): the manager's own, so several hundred
  // parameters never evict one another from the shared cache. Validated at the first
  // accumulate of each, again only when its pointers change (a caller's gradient buffer)
  // or a device released memory since.
  std::vector<std::array<gpu::detail::OwnedPlan<gpu::detail::AccumulatePlans>, 2>>
      accumulate_plans_;

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
  const std::uint32_t* d_codebooks_ = nullptr;  // the 8-bit codebooks (q8_state; else null)
  HostWords* h_ = nullptr;

  // Mode optimizer: per-chunk host blocks and the ring of device slots.
  std::vector<std::byte*> chunk_host_;
  std::vector<std::size_t> chunk_bytes_;
  std::vector<std::byte*> slots_;
  std::vector<device::Event> slot_free_;
  std::size_t ring_next_ = 0;

  // Speculation: the rollback space (device memory, reserved by the first step that
  // speculates, carved afresh each step); per chunk whether it was speculated this step,
  // and per parameter where its speculated state, counter and compute weights go.
  struct Spec {
    std::array<float*, kMaxSlots> state{};
    std::array<float*, kMaxOptimizerSlots> absmax{};  // an 8-bit slot's maxima
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
  device::Event done_;
  StepReport report_;
  bool closed_ = false;
};

}  // namespace stepcore::detail
