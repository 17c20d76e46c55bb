// The gradient managers a trainer drives after (and during) backward, with one
// interface whatever the offload mode:
//
//   begin_step(scale, overlap) -> per micro-batch: begin_backward(final), backward writing
//   gradient(i) + gradient_ready(i) per parameter, finish_backward() -> optionally
//   clip_grad_norm(max_norm) -> step() -> ... -> close()
//
// Modes: "none" (GpuGradientManager: gradients, masters and moments in device memory),
// "optimizer" (gradients on the device, AdamW/SignSGD state in host memory streamed
// through the device in chunks for the step), "full" (OffloadGradientManager: gradients
// copied to pinned host staging as they finish, accumulated, clipped and stepped on the
// CPU engine, compute weights uploaded). All three give identical bits: norms, clip
// coefficients, parameters, moments and compute weights (docs/numerics.md, section
// "Gradient managers").
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stepcore/comm.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/determinism.hpp"  // the levels named in "Determinism:" lines
#include "stepcore/device.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore {

namespace detail {
class ManagerImpl;  // the mode's implementation: its state and hooks (internal)
}  // namespace detail

/// Where gradients and optimizer state live.
enum class OffloadMode : std::uint8_t { none, optimizer, full };

/// Returns the mode named exactly "none", "optimizer" or "full". Anything else (the
/// removed "fsdp" mode, "cpu", "Full", "") throws Errc::invalid_argument naming
/// "offload_mode" with the accepted names.
OffloadMode parse_offload_mode(std::string_view name);
/// Returns "none", "optimizer" or "full".
std::string_view offload_mode_name(OffloadMode mode) noexcept;

/// One parameter (this rank's shard of it) in parameter order.
struct ParamSpec {
  std::string name;
  std::size_t numel = 0;
  DType grad_dtype = DType::bf16;     ///< dtype backward writes the gradient in
  DType compute_dtype = DType::bf16;  ///< dtype of the compute weights each step writes
  bool has_compute_weights = true;    ///< false: no compute copy (the master is used)
  /// false on ranks whose copy must not count towards the norm (a non-zero HSDP or
  /// tensor-parallel replica): the norm takes one copy of every logical element.
  bool counts_toward_norm = true;
  /// true: the optimizer uses weight decay 0 for this parameter (norms, biases), else
  /// the configured one.
  bool no_weight_decay = false;
};

/// The optimizers stepcore implements.
enum class OptimizerKind : std::uint8_t { adamw, sign_sgd };

/// Returns the optimizer named exactly "adamw" or "sign_sgd". Anything else ("AdamW",
/// "muon", "") throws Errc::invalid_argument naming "optimizer" with the accepted names.
OptimizerKind parse_optimizer(std::string_view name);
/// Returns "adamw" or "sign_sgd".
std::string_view optimizer_name(OptimizerKind kind) noexcept;

/// The optimizer and the configuration of each (only the one `kind` names is used).
struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::adamw;
  AdamWConfig adamw;
  SignSgdConfig sign_sgd;
};

/// Everything a manager is built from.
struct ManagerConfig {
  OffloadMode mode = OffloadMode::optimizer;
  OptimizerSpec optimizer;
  std::vector<ParamSpec> params;
  /// Optimizer-in-backward and streaming chunks: consecutive parameters, never split, up
  /// to this many elements (a larger parameter is a chunk of its own).
  std::size_t chunk_elements = std::size_t{16} << 20;
  /// The device the gradients come from (not owned; must outlive the manager).
  device::Device* device = nullptr;
  /// The ranks the norm is global over (not owned; null: this rank alone). Its memory
  /// space must match the device: host for the host device or the full-offload manager,
  /// device (NCCL on the compute stream) for a CUDA device with modes none/optimizer.
  comm::Communicator* comm = nullptr;
  /// comm::NormLayout::fingerprint() of the global layout (or any value all ranks share):
  /// checked with every norm reduction; ranks that disagree all get an error.
  std::uint64_t layout_fingerprint = 0;
  /// Full offload: the CPU engine (ISA, threads, core binding: numa::place).
  cpu::EngineConfig engine;
  /// Full offload / optimizer mode: NUMA node of host state and staging (-1: unbound).
  int numa_node = -1;
  /// GPU manager: leave scale and clip lazy (applied on the optimizer's read) instead of
  /// scaling the accumulators in place. Same bits either way.
  bool lazy_gpu_scale = false;
};

/// What the last step did. Known after step() (full offload) or, for the device
/// managers, once the step's work has been waited for (report() waits).
struct StepReport {
  bool stepped = false;            ///< the optimizer updated the parameters
  bool skipped = false;            ///< non-finite gradients: no parameter changed (no overlap)
  std::size_t chunks_skipped = 0;  ///< with overlap: chunks left alone for non-finite values
  NormResult norm;                 ///< the global norm of the scaled gradients (no overlap)
  float clip_coefficient = 1.0f;
};

/// The interface the trainer drives; see the file comment for the call sequence.
/// Every call validates its arguments and the sequence first (Errc::invalid_argument
/// naming the call, e.g. "clip_grad_norm", nothing changed). Errors of the manager's
/// asynchronous work (a failed copy, a worker exception, a collective that timed out)
/// are raised by its next call, and by every call after it: the step they interrupted
/// cannot be trusted, so the manager stays failed (close() still releases everything).
/// Determinism: bitwise: every mode, with or without overlap, on any device, thread count and
/// rank count, gives the same bits as the scalar reference applied to the same
/// gradient stream (docs/numerics.md, "Gradient managers").
class GradientManager final {
 public:
  ~GradientManager();
  GradientManager(const GradientManager&) = delete;
  GradientManager& operator=(const GradientManager&) = delete;

  /// Returns the mode this manager implements.
  OffloadMode mode() const noexcept;
  /// Returns the configuration it was built with.
  const ManagerConfig& config() const noexcept;

  /// Sets parameter i's fp32 master weights (host memory, numel floats) and its
  /// compute weights to their rounding; moments start at zero, the step counter at 0.
  /// Only between steps.
  void load_parameter(std::size_t i, std::span<const float> master);

  /// Starts a step whose gradients are multiplied by `gradient_scale` (finite, > 0;
  /// e.g. 1 / loss tokens). `overlap_optimizer`: run each chunk's optimizer step during
  /// the final backward, as soon as its gradients are complete (clipping is then
  /// impossible: clip_grad_norm throws).
  void begin_step(float gradient_scale, bool overlap_optimizer);
  /// Starts a micro-batch's backward; `final_backward` marks the step's last one.
  void begin_backward(bool final_backward);
  /// Returns parameter i's gradient buffer for this micro-batch (device memory,
  /// grad_dtype): backward writes it, then calls gradient_ready(i).
  TensorView gradient(std::size_t i);
  /// The post-accumulate-grad hook: parameter i's gradient of this micro-batch is
  /// complete (at most once per micro-batch) once `written` is. The manager's reads of
  /// it are ordered after `written` on the device, with no host synchronisation: pass
  /// the event of the write (Device::record_on(trainer stream), or record(queue) of the
  /// device queue that wrote it); an empty event means it was written in order on the
  /// device's compute queue (the trainer's stream, when the device was made on it).
  void gradient_ready(std::size_t i, const device::Event& written = {});
  /// Returns the event after which parameter i's buffer may be rewritten (the
  /// manager's reads of its last gradient are done): the trainer's stream waits for it
  /// (Device::wait_on) before the next backward writes the buffer. Empty before the
  /// parameter's first gradient_ready.
  device::Event gradient_released(std::size_t i) const;
  /// Ends the micro-batch's backward. Parameters that received no gradient in the whole
  /// step get a zero gradient.
  void finish_backward();
  /// Computes the global norm of the scaled gradients over every rank (before
  /// clipping) and sets the clip coefficient min(1, max_norm / (norm + 1e-6)) (torch's
  /// formula, docs/numerics.md) for step(). Between the final finish_backward and
  /// step(), at most once, not with overlap; max_norm finite and >= 0. Returns the norm
  /// (NaN/Inf when gradients were not finite: step() then skips the update).
  float clip_grad_norm(float max_norm);
  /// Runs the optimizer (with overlap: completes the chunks not yet stepped). The
  /// device managers enqueue without waiting; the report is ready after report().
  void step();
  /// Returns the report of the last step (waits for the step's work when needed).
  StepReport report();
  /// Returns the step's effective gradient scale: scale × clip coefficient (1 before
  /// clip_grad_norm). Valid from begin_step to the next begin_step.
  float effective_gradient_scale() const noexcept;

  /// Returns parameter i's compute weights (device memory), valid after the step's work
  /// (report() or synchronize()).
  ConstTensorView compute_weights(std::size_t i) const;
  /// Copies parameter i's master weights, moments and compute weights to host memory
  /// (each span may be empty to skip it; exp_avg_sq is empty for SignSGD). Waits for
  /// outstanding work. Only between steps.
  void read_parameter(std::size_t i, std::span<float> master, std::span<float> exp_avg,
                      std::span<float> exp_avg_sq, std::span<std::uint8_t> compute);
  /// Waits for all outstanding work and re-raises its errors.
  void synchronize();
  /// Waits for outstanding work and joins the worker; raises the first error of that
  /// work (once). Idempotent; never deadlocks on a failed copy. Later calls (except
  /// close()) throw.
  void close();

 private:
  /// make_gradient_manager builds the mode's implementation and hands it over; every
  /// call validates the sequence and arguments, then runs the implementation's hook.
  explicit GradientManager(std::unique_ptr<detail::ManagerImpl> impl) noexcept;
  friend std::unique_ptr<GradientManager> make_gradient_manager(ManagerConfig config);

  std::unique_ptr<detail::ManagerImpl> impl_;  ///< the mode's manager (managers/manager_impl.hpp)
};

/// Returns the manager for config.mode — the trainer's one entry point: GpuGradientManager
/// for "none", the streamed-state manager for "optimizer", OffloadGradientManager for
/// "full". Validates everything first: an OptimizerKind outside its values is refused
/// (Errc::not_supported; in full offload with the message that full offload accepts only
/// AdamW and SignSGD), a missing device, a communicator in the wrong memory space or (a device
/// communicator) on another stream than the device's compute stream, bad sizes.
std::unique_ptr<GradientManager> make_gradient_manager(ManagerConfig config);

}  // namespace stepcore
