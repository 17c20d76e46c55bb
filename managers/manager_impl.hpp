// The internal base of every gradient manager, behind the public GradientManager (which
// holds it and runs the call sequence over its state, gradient_manager.cpp): the
// configuration, the chunks, the sequence's state, and the hooks the modes implement
// (gpu_manager.cpp: none and optimizer; offload_manager.cpp: full).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "managers/memory_ledger.hpp"
#include "managers/offload_layout.hpp"
#include "managers/optimizer.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore {

namespace detail {
/// Where the trainer's call sequence stands (GradientManager checks every call against it).
enum class CallPhase : std::uint8_t { idle, step, backward, after_final, closed };
}  // namespace detail

/// What every mode shares: the configuration, the chunks, and the state of the call
/// sequence, which the public GradientManager (a friend) validates each call against
/// before it runs the mode's hook; the modes derive and implement the hooks.
class ManagerImpl {
 public:
  virtual ~ManagerImpl();
  ManagerImpl(const ManagerImpl&) = delete;
  ManagerImpl& operator=(const ManagerImpl&) = delete;

 protected:
  /// Validates the optimizer, the groups (each one's resolved configuration), the
  /// parameters' groups and destinations and chunk_elements, and forms the chunks.
  explicit ManagerImpl(ManagerConfig config);

  /// A parameter's optimizer state arrays in host memory, in slot order: [0] the master,
  /// [1 + s] state slot s (state_slots() of them).
  template <class T>
  using Arrays = std::span<const std::span<T>>;
  /// One 8-bit state slot of a parameter in host memory (docs/numerics.md 8f): numel codes
  /// and q8_blocks(numel) block maxima.
  template <class B, class F>
  struct Q8Array {
    std::span<B> codes;
    std::span<F> absmax;
  };
  /// A parameter's 8-bit slots, in slot order: state_slots() entries for a q8_param, else
  /// none (the slots are the f32 Arrays).
  using Q8In = std::span<const Q8Array<const std::uint8_t, const float>>;
  using Q8Out = std::span<const Q8Array<std::uint8_t, float>>;
  /// Host views of a parameter's resident state (empty where it is device memory); a
  /// q8_param's slots in q8, its a[1 + s] empty.
  struct HostArrays {
    std::span<const float> a[1 + kMaxOptimizerSlots];
    Q8Array<const std::uint8_t, const float> q8[kMaxOptimizerSlots];
  };

  /// The chunks: [first, last) parameter index ranges (see ManagerConfig).
  struct Chunk {
    std::size_t first = 0, last = 0, elements = 0;
  };

  // ---- the modes' hooks (called after GradientManager validated the call) ----------
  /// Sets parameter i's state (validated; `arrays` has 1 + state_slots() entries, `q8`
  /// the 8-bit slots of a q8_param): an empty slot means its initial value (load_parameter).
  virtual void do_import_parameter(std::size_t i, Arrays<const float> arrays, Q8In q8,
                                   float step) = 0;
  /// Sets elements [offset, offset + n) of parameter i's state (validated), n the size of
  /// the non-empty entries of `arrays` (1 + state_slots() entries; an empty one leaves its
  /// array as it is): a range of the master sets the same range of the compute weights
  /// (the master rounded); with `last` (the parameter's final range; every element of
  /// every array was set once, in any order) the step counter becomes `step`. The mode
  /// is done with `arrays` when it returns. What a checkpoint load imports through, a
  /// bounded range at a time, when do_imports_ranges(); the default throws Errc::internal.
  virtual void do_import_range(std::size_t i, std::size_t offset, Arrays<const float> arrays,
                               float step, bool last);
  /// Sets a range of parameter i's 8-bit slot s from `bytes` (validated): its codes from
  /// element `offset`, or (`absmax`) its block maxima from block `offset`. What a checkpoint
  /// load imports 8-bit state through (do_import_range then sets the step counter); the
  /// default throws Errc::internal (modes without 8-bit state).
  virtual void do_import_q8_range(std::size_t i, std::size_t s, bool absmax, std::size_t offset,
                                  std::span<const std::byte> bytes);
  /// Returns true when the mode implements do_import_range (a load otherwise imports
  /// each parameter whole, through do_import_parameter).
  virtual bool do_imports_ranges() const noexcept { return false; }
  virtual void do_begin_step() = 0;
  /// `final_backward`: the step's last micro-batch; `first_backward`: its first.
  virtual void do_begin_backward(bool final_backward, bool first_backward) = 0;
  virtual TensorView do_gradient(std::size_t i) = 0;
  /// `first_in_step`: the parameter's first gradient of the step (copy, not add); `grad`
  /// the buffer to read (the manager's or the caller's, validated); the reads wait for
  /// `written` on the device.
  virtual void do_gradient_ready(std::size_t i, bool first_in_step, ConstTensorView grad,
                                 const device::Event& written) = 0;
  /// The event after which parameter i's gradient buffer may be rewritten.
  virtual device::Event do_gradient_released(std::size_t i) const = 0;
  /// The step reads its final micro-batch's gradients again from their buffers
  /// (GradientManager::gradients_read_by_step).
  virtual bool do_reads_gradients_at_step() const noexcept { return false; }
  /// Called by finish_backward of the final micro-batch with the parameters that got no
  /// gradient in the step (they must read as zero).
  virtual void do_finish_final_backward(std::span<const std::size_t> no_gradient) = 0;
  /// With overlap, called once per chunk when all its parameters' final gradients are in:
  /// the mode speculates it (speculating() and the budget admits it) or lets it wait.
  virtual void do_step_chunk(std::size_t chunk) = 0;
  /// Reserves the rollback space of ManagerConfig::speculation_bytes (once; later calls
  /// return at once), before a step that speculates. Throws Errc::out_of_range naming
  /// "speculation_bytes" when it cannot, with nothing changed.
  virtual void do_reserve_speculation() = 0;
  virtual NormResult do_clip_grad_norm(float max_norm, float& clip) = 0;
  virtual void do_step() = 0;
  virtual StepReport do_report() = 0;
  virtual ConstTensorView do_compute_weights(std::size_t i) const = 0;
  /// Copies parameter i's arrays (1 + state_slots() entries, each empty to skip it; a
  /// q8_param's slots into `q8`, each entry's spans empty to skip it).
  virtual void do_read_parameter(std::size_t i, Arrays<float> arrays, Q8Out q8,
                                 std::span<std::uint8_t> compute) = 0;
  /// Copies elements [offset, offset + n) of parameter i's arrays into `arrays` (1 +
  /// state_slots() entries, each empty to skip it, else n floats), for state that
  /// do_host_state does not show (device memory); the default throws Errc::internal.
  virtual void do_read_range(std::size_t i, std::size_t offset, Arrays<float> arrays);
  /// Copies a range of parameter i's 8-bit slot s into `out`: its codes from element
  /// `offset`, or (`absmax`) its block maxima from block `offset`, for state that
  /// do_host_state does not show (device memory); the default throws Errc::internal.
  virtual void do_read_q8_range(std::size_t i, std::size_t s, bool absmax, std::size_t offset,
                                std::span<std::byte> out);
  /// Writes every parameter's step counter to out (out.size() == number of parameters).
  virtual void do_step_counts(std::span<float> out) = 0;
  /// Views of host-resident state (empty where it is device memory).
  virtual HostArrays do_host_state(std::size_t i) = 0;
  virtual void do_synchronize() = 0;
  /// After a failure (load_checkpoint of a failed manager): waits for the work the
  /// failed step left queued, drops its errors and the step's state, so that state can
  /// be imported again. Throws when the device cannot continue (the manager stays failed).
  virtual void do_recover() = 0;
  /// How many draining passes do_recover makes at most before its raising one: a pass
  /// stops at the first error it collects, and one queued failure reaches at most two
  /// collectors on each copy queue's path (the device's next caller, the events after
  /// the lost work), so four passes see every error of the failed step.
  static constexpr int kRecoverPasses = 4;
  /// Waits for outstanding work and stops workers; returns the first error of that
  /// work (rethrown by close()), never throws itself.
  virtual std::exception_ptr do_close() noexcept = 0;
  /// The error the mode stored from its own asynchronous work (e.g. full offload's
  /// worker), whatever its code, or null: guarded() makes it the manager's failure, so
  /// that every later call raises it even when its code is not a runtime one (an engine
  /// refusal inside a worker task).
  virtual std::exception_ptr do_async_failure() const noexcept { return nullptr; }

  /// The bytes the manager holds by kind (GradientManager::memory()): the modes set
  /// them where they allocate; a save or load holds its buffers while it runs.
  detail::MemoryLedger& ledger() const noexcept { return ledger_; }

  OffloadMode mode() const noexcept { return config_.mode; }
  const ManagerConfig& config() const noexcept { return config_; }
  const std::vector<Chunk>& chunks() const noexcept { return chunks_; }
  std::size_t chunk_of(std::size_t param) const noexcept { return chunk_of_[param]; }
  float gradient_scale() const noexcept { return scale_; }
  bool overlap() const noexcept { return overlap_; }
  /// This step speculates: overlap, a non-zero budget, and the policy allows it now.
  bool speculating() const noexcept { return speculating_; }
  /// The rollback budget in bytes (SIZE_MAX for ManagerConfig::kAllChunks).
  std::size_t speculation_budget() const noexcept;
  /// Records whether the step just decided would have kept speculated chunks as they
  /// were (finite, coefficient 1): Speculation::automatic speculates in the next step
  /// only then. The modes call it once they know (the host has the decision).
  void set_would_commit(bool would_commit) noexcept { would_commit_ = would_commit; }
  /// When the step's final finish_backward was called (its last gradient).
  std::chrono::steady_clock::time_point last_gradient_time() const noexcept {
    return last_gradient_;
  }
  /// The optimizer's state: slot names, step counter, read (fixed by the configuration).
  const detail::OptimizerShape& shape() const noexcept { return shape_; }
  /// The number of state slots beside the master.
  std::size_t state_slots() const noexcept { return shape_.slot_names.size(); }
  /// Parameter i's state slots are 8-bit (ManagerConfig::q8_state, min_8bit_size).
  bool q8_param(std::size_t i) const noexcept {
    return state_slots() != 0 && detail::q8_slots(config_, config_.params[i].numel);
  }
  /// The value state slot s starts from (load_parameter).
  float initial_slot_value(std::size_t s) const noexcept { return initial_[s]; }
  /// The groups' current hyper-parameters (set_hyperparameters changes lr and weight decay
  /// between the calls of the caller's thread; the modes read them there).
  const std::vector<ParamGroup>& groups() const noexcept { return groups_; }
  /// Changes whenever a group's lr or weight decay changes (the device managers upload
  /// the groups' values when it differs from what they uploaded last).
  std::uint64_t hyper_version() const noexcept { return hyper_version_; }
  /// Group g's optimizer configuration: the optimizer's with the group's current
  /// hyper-parameters.
  OptimizerConfig group_config(std::size_t g) const;

 private:
  friend class ::stepcore::GradientManager;  // runs the call sequence over this state

  /// Throws Errc::invalid_argument naming `call` unless `ok`; raises a stored failure.
  void expect(bool ok, const char* call, const char* what) const;
  /// Throws Errc::out_of_range naming "i" unless i names a parameter.
  void expect_param(std::size_t i) const;
  /// Runs a hook; a runtime error (failed asynchronous work) poisons the manager.
  template <class F>
  decltype(auto) guarded(F&& f);

  ManagerConfig config_;
  detail::OptimizerShape shape_;
  std::vector<float> initial_;  // per state slot: its initial value
  std::vector<ParamGroup> groups_;
  std::uint64_t hyper_version_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<std::size_t> chunk_of_;
  std::vector<std::uint8_t> ready_in_micro_;  // gradient_ready seen in this micro-batch
  std::vector<std::uint8_t> got_in_step_;     // any gradient this step
  std::vector<std::size_t> chunk_pending_;    // final-backward parameters still missing
  detail::CallPhase phase_ = detail::CallPhase::idle;
  bool final_ = false, saw_final_ = false, overlap_ = false, clipped_ = false, stepped_ = false;
  bool speculating_ = false, would_commit_ = true;
  std::chrono::steady_clock::time_point last_gradient_{};
  float scale_ = 1.0f, clip_ = 1.0f;
  std::exception_ptr failure_;     ///< the runtime error every later call raises again
  bool backward_in_step_ = false;  ///< a micro-batch's backward began in this step
  mutable detail::MemoryLedger ledger_;
};

namespace detail {

/// The base, for the managers' code in detail (managers.hpp declares it opaque in stepcore).
using ::stepcore::ManagerImpl;

/// Returns true for the codes of work that already started (error.hpp: "runtime").
inline bool is_runtime(Errc c) {
  return c == Errc::cuda_error || c == Errc::nccl_error || c == Errc::mpi_error ||
         c == Errc::timeout || c == Errc::internal;
}

}  // namespace detail

template <class F>
decltype(auto) ManagerImpl::guarded(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    // A failure of asynchronous work leaves the step half done: every later call
    // raises it again (close() still cleans up). Argument errors change nothing.
    if (detail::is_runtime(e.code()))
      failure_ = std::current_exception();
    else if (std::exception_ptr async = do_async_failure())
      failure_ = async;
    throw;
  } catch (...) {
    failure_ = std::current_exception();
    throw;
  }
}

namespace detail {

/// Throws unless `values` has `want` elements, all finite (and >= 0 when `non_negative`):
/// Errc::size_mismatch / non_finite / invalid_argument naming `name`, the message prefixed
/// by `where` (e.g. "<path>: "). One branch-free pass; only a bad array is searched.
void check_state_values(std::span<const float> values, std::size_t want, const std::string& name,
                        bool non_negative, const std::string& where = "");
/// Throws what check_state_values throws for element j of value `value`, the first bad
/// one: Errc::non_finite when it is NaN or Inf, else Errc::invalid_argument (negative).
[[noreturn]] void throw_bad_state_value(const std::string& name, const std::string& where,
                                        std::size_t j, float value);
/// Throws unless `codes` (numel) and `absmax` (q8_blocks(numel)) are an 8-bit slot a manager
/// can continue from (docs/numerics.md 8f): its maxima finite and >= 0 (every code is a
/// value of the map). Errc::size_mismatch / non_finite / invalid_argument naming
/// "<name>.codes" or "<name>.absmax", the message prefixed by `where`.
void check_q8_state(std::span<const std::uint8_t> codes, std::span<const float> absmax,
                    std::size_t numel, const std::string& name, const std::string& where = "");
/// Throws what a manager's construction refuses in every mode before anything is
/// allocated (Errc naming the field): the optimizer, chunk_elements, the speculation
/// fields, the groups, the parameters' names, groups and compute destinations, the ring.
/// ManagerImpl's constructor and plan_memory both check a configuration with it.
void validate_manager_config(const ManagerConfig& config);
/// Returns true for a step counter a manager can continue from: with a counter an integer
/// in [0, 2^24] (what an f32 counter holds exactly), without one +0.
bool valid_step_count(float step, bool counts_steps) noexcept;

}  // namespace detail
}  // namespace stepcore
