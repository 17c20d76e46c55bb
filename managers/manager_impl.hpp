// The internal base of every gradient manager, behind the public GradientManager (which
// holds it and runs the call sequence over its state, gradient_manager.cpp): the
// configuration, the chunks, the sequence's state, and the hooks the modes implement
// (gpu_manager.cpp: none and optimizer; offload_manager.cpp: full).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <vector>

#include "stepcore/device.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::detail {

/// Where the trainer's call sequence stands (GradientManager checks every call against it).
enum class CallPhase : std::uint8_t { idle, step, backward, after_final, closed };

/// What every mode shares: the configuration, the chunks, and the state of the call
/// sequence, which the public GradientManager (a friend) validates each call against
/// before it runs the mode's hook; the modes derive and implement the hooks.
class ManagerImpl {
 public:
  virtual ~ManagerImpl();
  ManagerImpl(const ManagerImpl&) = delete;
  ManagerImpl& operator=(const ManagerImpl&) = delete;

 protected:
  /// Validates the optimizer kind and chunk_elements, and forms the chunks.
  explicit ManagerImpl(ManagerConfig config);

  /// The chunks: [first, last) parameter index ranges (see ManagerConfig).
  struct Chunk {
    std::size_t first = 0, last = 0, elements = 0;
  };

  // ---- the modes' hooks (called after GradientManager validated the call) ----------
  virtual void do_load_parameter(std::size_t i, std::span<const float> master) = 0;
  virtual void do_begin_step() = 0;
  virtual void do_begin_backward() = 0;
  virtual TensorView do_gradient(std::size_t i) = 0;
  /// `first_in_step`: the parameter's first gradient of the step (copy, not add); the
  /// reads wait for `written` on the device.
  virtual void do_gradient_ready(std::size_t i, bool first_in_step,
                                 const device::Event& written) = 0;
  /// The event after which parameter i's gradient buffer may be rewritten.
  virtual device::Event do_gradient_released(std::size_t i) const = 0;
  /// Called by finish_backward of the final micro-batch with the parameters that got no
  /// gradient in the step (they must read as zero).
  virtual void do_finish_final_backward(std::span<const std::size_t> no_gradient) = 0;
  /// With overlap, called once per chunk when all its parameters' final gradients are in.
  virtual void do_step_chunk(std::size_t chunk) = 0;
  virtual NormResult do_clip_grad_norm(float max_norm, float& clip) = 0;
  virtual void do_step() = 0;
  virtual StepReport do_report() = 0;
  virtual ConstTensorView do_compute_weights(std::size_t i) const = 0;
  virtual void do_read_parameter(std::size_t i, std::span<float> master, std::span<float> exp_avg,
                                 std::span<float> exp_avg_sq, std::span<std::uint8_t> compute) = 0;
  virtual void do_synchronize() = 0;
  /// Waits for outstanding work and stops workers; returns the first error of that
  /// work (rethrown by close()), never throws itself.
  virtual std::exception_ptr do_close() noexcept = 0;

  OffloadMode mode() const noexcept { return config_.mode; }
  const ManagerConfig& config() const noexcept { return config_; }
  const std::vector<Chunk>& chunks() const noexcept { return chunks_; }
  std::size_t chunk_of(std::size_t param) const noexcept { return chunk_of_[param]; }
  float gradient_scale() const noexcept { return scale_; }
  bool overlap() const noexcept { return overlap_; }
  bool is_adamw() const noexcept { return config_.optimizer.kind == OptimizerKind::adamw; }

 private:
  friend class ::stepcore::GradientManager;  // runs the call sequence over this state

  /// Throws Errc::invalid_argument naming `call` unless `ok`; raises a stored failure.
  void expect(bool ok, const char* call, const char* what) const;
  /// Runs a hook; a runtime error (failed asynchronous work) poisons the manager.
  template <class F>
  decltype(auto) guarded(F&& f);

  ManagerConfig config_;
  std::vector<Chunk> chunks_;
  std::vector<std::size_t> chunk_of_;
  std::vector<std::uint8_t> ready_in_micro_;  // gradient_ready seen in this micro-batch
  std::vector<std::uint8_t> got_in_step_;     // any gradient this step
  std::vector<std::size_t> chunk_pending_;    // final-backward parameters still missing
  CallPhase phase_ = CallPhase::idle;
  bool final_ = false, saw_final_ = false, overlap_ = false, clipped_ = false, stepped_ = false;
  float scale_ = 1.0f, clip_ = 1.0f;
  std::exception_ptr failure_;  ///< the runtime error every later call raises again
};

}  // namespace stepcore::detail
