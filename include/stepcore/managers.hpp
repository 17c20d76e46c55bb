// The gradient managers a trainer drives after (and during) backward, with one
// interface whatever the offload mode:
//
//   begin_step(scale, overlap) -> per micro-batch: begin_backward(final), backward writing
//   gradient(i) + gradient_ready(i) per parameter, finish_backward() -> optionally
//   clip_grad_norm(max_norm) -> step() -> ... -> close()
//
// Modes: "none" (GpuGradientManager: gradients, masters and optimizer state in device
// memory), "optimizer" (gradients on the device, the optimizer state in host memory
// streamed through the device in chunks for the step), "full" (OffloadGradientManager:
// gradients copied to pinned host staging as they finish, accumulated, clipped and
// stepped on the CPU engine, compute weights uploaded). The optimizer is any the library
// has (an OptimizerConfig); its state is the f32 master and the optimizer's named state
// slots. Every mode that steps an optimizer gives the same bits: norms, clip
// coefficients, parameters, state and compute weights (docs/numerics.md, section
// "Gradient managers").
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "stepcore/comm.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/determinism.hpp"  // the levels named in "Determinism:" lines
#include "stepcore/device.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore {

class ManagerImpl;  // the mode's implementation: its state and hooks (opaque, internal)

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
  std::string name;  ///< unique: checkpoints key the parameter's state by it
  std::size_t numel = 0;
  DType grad_dtype = DType::bf16;     ///< dtype backward writes the gradient in
  DType compute_dtype = DType::bf16;  ///< dtype of the compute weights each step writes
  bool has_compute_weights = true;    ///< false: no compute copy (the master is used)
  /// false on ranks whose copy must not count towards the norm (a non-zero HSDP or
  /// tensor-parallel replica): the norm takes one copy of every logical element.
  bool counts_toward_norm = true;
  /// Index into ManagerConfig::groups of the group whose hyper-parameters it uses.
  std::size_t group = 0;
  /// false: the manager allocates no gradient buffer for it (gradient(i) throws); the
  /// caller hands over its own with gradient_ready(i, grad, written) every time.
  bool gradient_buffer = true;
  /// Where step() writes the compute weights: the model's own parameter storage (device
  /// memory, compute_dtype, numel elements; no two destinations overlap). Empty: a
  /// buffer of the manager's. Needs has_compute_weights. Same bits either way.
  TensorView compute_into;
};

/// A parameter group (PyTorch's param_groups): the hyper-parameters its parameters share.
/// lr and weight_decay are the schedule's: set_hyperparameters changes them between
/// steps; betas and eps are fixed.
struct ParamGroup {
  std::string name;  ///< non-empty and unique (checkpoints and errors name it)
  double lr = 1e-3;
  double weight_decay = 0.0;
  double beta1 = 0.9;    ///< optimizers with betas (AdamW, Adam) only
  double beta2 = 0.999;  ///< optimizers with betas only
  double eps = 1e-8;     ///< optimizers with betas only (Adagrad's eps is its config's)
};

/// Which chunks an overlapped step (begin_step(scale, true)) steps before the step's
/// decision (the global norm and non-finite flag) instead of waiting for it
/// (docs/managers.md, "With overlap"). Every policy gives the same bits.
enum class Speculation : std::uint8_t {
  always,     ///< every chunk the budget admits, in every overlapped step
  never,      ///< none: every chunk waits for the decision
  automatic,  ///< "auto": as always after a step that committed (or none yet), else never
};

/// Returns the policy named exactly "always", "never" or "auto"; anything else throws
/// Errc::invalid_argument naming "speculation" with the accepted names.
Speculation parse_speculation(std::string_view name);
/// Returns "always", "never" or "auto".
std::string_view speculation_name(Speculation policy) noexcept;

/// Returns the default configuration of the optimizer named exactly `name`: one of the
/// names of optimizer_table() (stepcore/optim.hpp: "adamw", "lion", ...). Anything else
/// ("AdamW", "muon", "") throws Errc::invalid_argument naming "optimizer" with the
/// accepted names.
OptimizerConfig parse_optimizer(std::string_view name);
/// Returns the name of the optimizer `config` configures ("adamw", ...).
std::string_view optimizer_name(const OptimizerConfig& config) noexcept;

/// The suffix of an optimizer's 8-bit name ("adamw8bit"): the optimizer with block-wise
/// 8-bit state (ManagerConfig::q8_state), for each optimizer whose optimizer_table() entry
/// has q8.
inline constexpr std::string_view kQ8NameSuffix = "8bit";

/// An optimizer and its state's storage, by name (parse_optimizer_choice).
struct OptimizerChoice {
  /// The optimizer's defaults; an 8-bit name's formula is "torchao" where the optimizer has
  /// that formula (the 8-bit peers' arithmetic, docs/numerics.md 8e).
  OptimizerConfig optimizer;
  bool q8_state = false;  ///< named with kQ8NameSuffix: ManagerConfig::q8_state
};
/// Returns the optimizer named exactly `name`: one of parse_optimizer's names, or the name
/// of an entry with q8 followed by kQ8NameSuffix. Anything else throws
/// Errc::invalid_argument naming "optimizer" with every accepted name.
OptimizerChoice parse_optimizer_choice(std::string_view name);

/// One hyper-parameter of an optimizer configuration, by its field name in the
/// configuration record (stepcore/optim.hpp): numbers, flags (0 or 1) and counts as a
/// double; AdamW's formula as its name ("torch", "native").
struct OptimizerField {
  std::string name;
  std::variant<double, std::string> value;
};
/// Returns the configuration of the optimizer named `name` (parse_optimizer's names):
/// its defaults with each of `fields` set. A name the optimizer does not have, a value of
/// the wrong kind (a string for a number, 0.5 for a flag, a fraction for a count, an
/// unknown formula) throws Errc::invalid_argument naming "<optimizer>.<field>" with the
/// accepted fields; the values themselves are checked where the configuration is used.
OptimizerConfig make_optimizer_config(std::string_view name,
                                      std::span<const OptimizerField> fields);
/// Returns every hyper-parameter of `config`, in its record's order.
std::vector<OptimizerField> optimizer_fields(const OptimizerConfig& config);

/// Returns the names of the state slots (the f32 arrays beside the master) the optimizer
/// `config` keeps for each parameter, in its slot order: AdamW and Adam exp_avg,
/// exp_avg_sq (and max_exp_avg_sq with amsgrad), SGD momentum_buffer (momentum != 0),
/// Adagrad sum, SignSGD none (docs/numerics.md).
std::vector<std::string_view> optimizer_slot_names(const OptimizerConfig& config);
/// Returns whether the optimizer `config` keeps a step counter per parameter.
bool optimizer_counts_steps(const OptimizerConfig& config) noexcept;

/// One named state slot of a parameter in host memory: its optimizer's name for it
/// (optimizer_slot_names) and numel floats, or, for a parameter whose slots are 8-bit
/// (GradientManager::q8_parameter), its codes and block maxima instead (docs/numerics.md
/// 8f: numel code bytes, q8_blocks(numel) f32 maxima; `values` empty).
template <class T>
struct NamedSlot {
  std::string_view name;
  std::span<T> values;
  std::span<std::conditional_t<std::is_const_v<T>, const std::uint8_t, std::uint8_t>> codes = {};
  std::span<T> absmax = {};
};
/// The number of block maxima of an 8-bit slot of `numel` elements: ceil(numel / 256).
constexpr std::size_t q8_blocks(std::size_t numel) noexcept {
  return (numel + kQ8BlockSize - 1) / kQ8BlockSize;
}
using SlotIn = NamedSlot<const float>;  ///< a slot's values to import
using SlotOut = NamedSlot<float>;       ///< where to copy a slot's values

/// Everything a manager is built from.
struct ManagerConfig {
  OffloadMode mode = OffloadMode::optimizer;
  /// The optimizer: the alternative held selects it. lr and weight decay (and the betas
  /// and eps of the optimizers with betas: AdamW, Adam) are the groups'; a configuration
  /// without groups has the single group "default" made of them. Its other fields
  /// (AdamW's formula, momentum, ...) apply to every group. Every mode steps every
  /// optimizer (optimizer_table() in stepcore/optim.hpp lists them).
  OptimizerConfig optimizer = AdamWConfig{};
  /// The parameter groups (ParamSpec::group indexes them). Empty: one group, "default",
  /// with the optimizer's lr, weight decay, betas and eps.
  std::vector<ParamGroup> groups;
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
  /// Overlapped steps: when a chunk is stepped before the step's decision.
  Speculation speculation = Speculation::automatic;
  /// Overlapped steps: the most bytes of rollback space (host memory in full offload,
  /// device memory in modes none and optimizer), reserved at the first overlapped step
  /// that speculates; a chunk that does not fit waits for the decision. 0: no chunk
  /// speculates. kAllChunks: as much as every chunk needs. docs/managers.md gives each
  /// mode's bytes per chunk. Any other negative value is refused at construction
  /// (Errc::out_of_range naming "speculation_bytes").
  std::int64_t speculation_bytes = kAllChunks;
  static constexpr std::int64_t kAllChunks = -1;
  /// Full offload: the most bytes of device memory in which speculated compute weights
  /// are staged, uploaded as each chunk is speculated, so that a commit is a
  /// device-to-device copy instead of an upload (off the critical path where copies are
  /// DMA: a GPU). Reserved with the rollback space; a speculated chunk that does not fit
  /// uploads after the commit. 0 (default): none. kAllChunks: every chunk's compute
  /// weights. Other negatives: Errc::out_of_range; nonzero in another mode (whose
  /// rollback space is already on the device): Errc::invalid_argument; both name
  /// "speculation_device_bytes". Same bits either way.
  std::int64_t speculation_device_bytes = 0;
  /// Full offload: the slots of each pinned ring: the one gradients arrive through (as
  /// backward hands them over), the one compute weights leave through, and the one the
  /// step reads back gradients held on the device through (a step of one micro-batch). On a
  /// Device::host_accessible() device a step of one micro-batch reads its gradients in
  /// place (neither the staging nor the fetch ring), and a chunk stepped in place writes the
  /// model's compute weights where they are (not through the upload ring).
  /// Each slot holds ring_slot_elements elements; a larger parameter moves in pieces,
  /// smaller ones share a slot. Backward's copies wait for a free slot when the CPU
  /// falls behind (StepReport::staging_wait_seconds). kDefaultRing: min(4, the slots the
  /// model can fill). 0 or other negatives: Errc::out_of_range; more slots than the model
  /// can fill: Errc::invalid_argument; both name "ring_slots". Same bits with any ring.
  std::int64_t ring_slots = kDefaultRing;
  static constexpr std::int64_t kDefaultRing = -1;
  /// Full offload: elements per ring slot (rounded up to a multiple of 64, at most the
  /// largest parameter's). 0: Errc::out_of_range naming "ring_slot_elements".
  /// docs/managers.md ("Memory") gives the rings' bytes.
  std::size_t ring_slot_elements = std::size_t{1} << 19;
  /// Block-wise 8-bit optimizer state (docs/numerics.md 8f; docs/managers.md, "8-bit
  /// state"): every parameter of at least min_8bit_size elements (this rank's shard, a
  /// tensor of its own) keeps its state slots as codes and block maxima (q8_parameter),
  /// starting from the zero code and maximum 0 (the value 0); the others keep f32 slots.
  /// Every mode; only an optimizer whose optimizer_table() entry has q8 (AdamW, Adam): else
  /// Errc::not_supported naming "q8_state". The full-offload rings' slots then hold a
  /// multiple of kQ8BlockSize elements, so that no block is split.
  bool q8_state = false;
  std::size_t min_8bit_size = 4096;  ///< the smallest parameter with 8-bit slots
};

/// One kind of memory a manager holds (GradientManager::memory()).
struct MemoryUse {
  /// "master", each state slot by its name ("exp_avg", ...), "accumulator", "gradient"
  /// (device gradient buffers), "compute" (device compute weights the manager owns),
  /// "staging", "upload" and "fetch" (full offload's pinned rings),
  /// "speculation" (rollback space), "speculation_device" (staged compute weights),
  /// "streaming" (mode optimizer's device slots), "scalars" (the step's scalars, norm
  /// workspace and flags), "checkpoint" (the buffers of a save or load in progress).
  std::string kind;
  bool device = false;    ///< device memory; else host memory (pinned or pageable)
  std::size_t bytes = 0;  ///< held now
  std::size_t peak = 0;   ///< the most this kind held at once since construction
};

/// Every byte a manager allocated, by kind: now and at its peak. Host bytes are the ones
/// the manager asked for (the system rounds each allocation up to whole pages).
struct MemoryReport {
  std::vector<MemoryUse> kinds;                  ///< every kind the mode has, in a fixed order
  std::size_t host_bytes = 0, device_bytes = 0;  ///< held now
  std::size_t host_peak = 0, device_peak = 0;    ///< the most held at once (all kinds)
  /// Returns the kind named `name` (an empty record with that name when there is none).
  MemoryUse kind(std::string_view name) const {
    for (const MemoryUse& k : kinds)
      if (k.kind == name) return k;
    return MemoryUse{std::string(name)};
  }
};

/// What the last step did. Known after step() (full offload) or, for the device
/// managers, once the step's work has been waited for (report() waits).
struct StepReport {
  bool stepped = false;  ///< the optimizer updated the parameters
  bool skipped = false;  ///< non-finite gradients on some rank: no parameter changed
  NormResult norm;       ///< the global norm of the scaled gradients
  float clip_coefficient = 1.0f;
  /// Overlapped steps: chunks stepped before the decision (speculated), and of those the
  /// ones kept as they were (committed: coefficient 1, finite) and the ones restored to
  /// their saved bits (rolled back: stepped again with the coefficient, or left alone
  /// when the step was skipped). committed + rolled_back == speculated.
  std::size_t chunks_speculated = 0, chunks_committed = 0, chunks_rolled_back = 0;
  /// Seconds from the step's final finish_backward (its last gradient) to the end of the
  /// step's work: the optimizer time backward did not hide. Full offload: measured when
  /// the worker finished the step and its uploads; modes none and optimizer: when the
  /// host learnt the device's work was done (report()), an upper bound.
  double exposed_seconds = 0.0;
  /// Full offload: seconds the caller's thread waited in gradient_ready for a free slot of
  /// the staging ring during the step (the CPU behind backward); 0 in the other modes.
  double staging_wait_seconds = 0.0;
};

/// The interface the trainer drives; see the file comment for the call sequence.
/// Every call validates its arguments and the sequence first (Errc::invalid_argument
/// naming the call, e.g. "clip_grad_norm", nothing changed). Errors of the manager's
/// asynchronous work (a failed copy, a worker exception, a collective that timed out)
/// are raised by its next call, and by every call after it: the step they interrupted
/// cannot be trusted, so the manager stays failed (close() still releases everything)
/// until load_checkpoint restores a saved state.
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

  /// Returns the names of the optimizer's state slots (optimizer_slot_names of the
  /// configuration): what import_parameter, read_parameter and host_state name.
  const std::vector<std::string_view>& state_slot_names() const noexcept;
  /// Returns whether parameter i's state slots are 8-bit (ManagerConfig::q8_state and
  /// numel >= min_8bit_size): its NamedSlots carry codes and absmax, not values.
  /// Errc::out_of_range naming "i" for no such parameter.
  bool q8_parameter(std::size_t i) const;

  /// Sets parameter i's fp32 master weights (host memory, numel floats) and its
  /// compute weights to their rounding; the state slots start at their initial values
  /// (zero; Adagrad's sum at f32(initial_accumulator_value)), the step counter at 0.
  /// Only between steps.
  void load_parameter(std::size_t i, std::span<const float> master);
  /// Sets parameter i's whole optimizer state from host memory: master (numel finite
  /// floats), every state slot by name (each of state_slot_names() exactly once, numel
  /// finite floats; exp_avg_sq, max_exp_avg_sq and sum >= 0) and the step counter (an
  /// integer in [0, 2^24] for an optimizer that counts steps, else 0), and its compute
  /// weights to the master's rounding: what a resumed run continues from, the same bits
  /// as the run that exported it. A missing, repeated or unknown slot name throws
  /// Errc::invalid_argument naming "state" with the slot names. A q8_parameter's slots
  /// give codes (numel bytes, any) and absmax (q8_blocks(numel) finite floats >= 0)
  /// instead of values: else Errc naming "<slot>.codes" or "<slot>.absmax"
  /// (docs/managers.md, "8-bit state"). Only between steps.
  void import_parameter(std::size_t i, std::span<const float> master, std::span<const SlotIn> state,
                        float step);
  /// The same for an optimizer whose slots are exp_avg and exp_avg_sq (AdamW and Adam
  /// without amsgrad) or none (both spans empty: SignSGD).
  void import_parameter(std::size_t i, std::span<const float> master,
                        std::span<const float> exp_avg, std::span<const float> exp_avg_sq,
                        float step);

  /// The number of parameter groups (ManagerConfig::groups, or 1: "default").
  std::size_t group_count() const noexcept;
  /// Returns the index of the group named `name`; Errc::invalid_argument naming "group".
  std::size_t group_index(std::string_view name) const;
  /// Returns group g's current hyper-parameters (lr and weight decay as last set).
  const ParamGroup& group(std::size_t g) const;
  /// Sets group g's lr and weight decay (a schedule's values) for the optimizer work
  /// enqueued after this call, validated like the configuration (Errc naming
  /// "hyper.lr" / "hyper.weight_decay", nothing changed). Any time except during an
  /// overlapped step's final backward and until its step() (chunks already stepped
  /// with the old values). The device managers upload them with the next step's work,
  /// without a host synchronisation (docs/managers.md, "Schedules").
  void set_hyperparameters(std::size_t g, const StepHyper& hyper);

  /// Starts a step whose gradients are multiplied by `gradient_scale` (finite, > 0;
  /// e.g. 1 / loss tokens). `overlap_optimizer`: step each chunk during the final
  /// backward, as soon as its gradients are complete, as if the clip coefficient were 1
  /// and the step finite (ManagerConfig::speculation and speculation_bytes say which
  /// chunks); the step's decision (clip_grad_norm or step()) commits those chunks or
  /// restores their saved bits and steps them again: the same bits as without overlap.
  void begin_step(float gradient_scale, bool overlap_optimizer);
  /// Starts a micro-batch's backward; `final_backward` marks the step's last one.
  void begin_backward(bool final_backward);
  /// Returns parameter i's gradient buffer for this micro-batch (device memory,
  /// grad_dtype): backward writes it, then calls gradient_ready(i). Errc::invalid_argument
  /// when the parameter has no buffer (ParamSpec::gradient_buffer = false).
  TensorView gradient(std::size_t i);
  /// The post-accumulate-grad hook: parameter i's gradient of this micro-batch is
  /// complete (at most once per micro-batch) once `written` is. The manager's reads of
  /// it are ordered after `written` on the device, with no host synchronisation: pass
  /// the event of the write (Device::record_on(trainer stream), or record(queue) of the
  /// device queue that wrote it); an empty event means it was written in order on the
  /// device's compute queue (the trainer's stream, when the device was made on it).
  void gradient_ready(std::size_t i, const device::Event& written = {});
  /// The same hook for a gradient in the caller's buffer (FSDP's reduced shard): `grad`
  /// (device memory: on the host device, memory from its allocate(), or any host memory
  /// when it was made with HostDeviceMemory::any_host_memory) holds numel elements of
  /// grad_dtype, aligned to the element size. The manager reads it after `written`,
  /// never writes it, and keeps no reference to it once gradient_released(i) is
  /// complete: from then on the caller may rewrite or free it.
  void gradient_ready(std::size_t i, ConstTensorView grad, const device::Event& written = {});
  /// Returns the event after which parameter i's buffer may be rewritten (the
  /// manager's reads of its last gradient are done): the trainer's stream waits for it
  /// (Device::wait_on) before the next backward writes the buffer. Empty before the
  /// parameter's first gradient_ready. A gradient step() reads again
  /// (gradients_read_by_step()) is released by step(): called before it, this throws
  /// Errc::invalid_argument naming "gradient_released"; after it, it waits for the
  /// step's reads.
  device::Event gradient_released(std::size_t i) const;
  /// Returns true during a step whose final micro-batch's gradients step() reads again
  /// from their buffers (mode full, a step of one micro-batch while no accumulator is
  /// allocated: the gradients are not kept in host memory): the trainer keeps each
  /// buffer until step() has run.
  bool gradients_read_by_step() const noexcept;
  /// Ends the micro-batch's backward. Parameters that received no gradient in the whole
  /// step get a zero gradient.
  void finish_backward();
  /// Computes the global norm of the scaled gradients over every rank (before
  /// clipping) and sets the clip coefficient min(1, max_norm / (norm + 1e-6)) (torch's
  /// formula, docs/numerics.md) for step(). Between the final finish_backward and
  /// step(), at most once (with or without overlap); max_norm finite and >= 0. Returns
  /// the norm (NaN/Inf when gradients were not finite: step() then skips the update).
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
  /// Copies parameter i's master weights, the named state slots in `state` (any of
  /// state_slot_names(), each at most once; an unknown name throws Errc::invalid_argument
  /// naming "state") and compute weights to host memory (each span may be empty to skip
  /// it; a q8_parameter's slots fill codes and absmax, values must be empty). Waits for
  /// outstanding work. Only between steps.
  void read_parameter(std::size_t i, std::span<float> master, std::span<const SlotOut> state,
                      std::span<std::uint8_t> compute);
  /// The same with the slots exp_avg and exp_avg_sq by position (each empty to skip it;
  /// both empty for an optimizer without them).
  void read_parameter(std::size_t i, std::span<float> master, std::span<float> exp_avg,
                      std::span<float> exp_avg_sq, std::span<std::uint8_t> compute);
  /// Returns parameter i's step counter (0 for an optimizer without one). Waits for
  /// outstanding work. Only between steps.
  float step_count(std::size_t i);

  /// Parameter i's optimizer state where it lives in host memory.
  struct HostState {
    std::span<const float> master;
    /// In state_slot_names() order (a q8_parameter's: codes and absmax, values empty).
    std::vector<NamedSlot<const float>> slots;
    /// Returns the f32 values of the slot named `name`, or an empty span when there is
    /// none (or it is 8-bit).
    std::span<const float> slot(std::string_view name) const noexcept {
      for (const auto& s : slots)
        if (s.name == name) return s.values;
      return {};
    }
  };
  /// Returns views of parameter i's state where it is host memory (modes optimizer and
  /// full: no copy, e.g. for a distributed checkpoint), valid until the next call that
  /// starts work or changes state (begin_step, load/import, load_checkpoint, close);
  /// empty views in mode none (device memory: read_parameter copies). Waits for
  /// outstanding work. Only between steps.
  HostState host_state(std::size_t i);

  /// Writes this rank's optimizer state (every parameter's master, state slots by name and
  /// step counter, keyed by name; the optimizer and the groups' hyper-parameters) to `path`,
  /// atomically (a temporary file, fsync, rename: a crash leaves the previous file intact), in the
  /// versioned format of docs/checkpoint.md. Each rank saves its own file. Host state is
  /// written in place, device state copied out a bounded range at a time: the save holds
  /// at most a few tens of MB beyond the manager's own memory (docs/checkpoint.md). Only
  /// between steps; Errc::io_error naming "path" when the file cannot be written.
  void save_checkpoint(const std::string& path);
  /// Reads a checkpoint written by save_checkpoint in any mode, thread count, ISA or
  /// device (format version 3; version 2 of the releases before 8-bit state, or version 1
  /// of the AdamW/SignSGD-only releases), and continues from it bit for bit. Everything is
  /// checked first (format, checksums, optimizer, its hyper-parameters and slot names,
  /// groups, rank, layout, parameter names, sizes, 8-bit or f32 state, and values):
  /// any disagreement is an Error naming it (Errc::corrupt_file for a damaged file),
  /// with nothing loaded. The file is read twice, a few pieces at a time (a bounded
  /// buffer of tens of MB, whatever the model's size): a verifying pass, then an
  /// importing pass that checks every block against the first before importing it. A
  /// file that changes between the passes is an Error naming "path" (Errc::corrupt_file,
  /// or Errc::io_error when it shrank or cannot be read) that leaves the manager failed,
  /// partly loaded, until another load_checkpoint recovers it. Restores each group's lr
  /// and weight decay. Only between steps,
  /// or at any point on a failed manager: after the file is verified, the failed step's
  /// queued work is waited for and its error dropped, and the manager continues from the
  /// file (it stays failed when its device or communicator fails again).
  void load_checkpoint(const std::string& path);

  /// Returns every byte the manager holds, by kind, now and at its peak
  /// (docs/managers.md, "Memory"; stepcore-plan predicts the same figures).
  MemoryReport memory() const;

  /// Waits for all outstanding work and re-raises its errors.
  void synchronize();
  /// Waits for outstanding work and joins the worker; raises the first error of that
  /// work (once). Idempotent; never deadlocks on a failed copy. Later calls (except
  /// close()) throw.
  void close();

 private:
  /// make_gradient_manager builds the mode's implementation and hands it over; every
  /// call validates the sequence and arguments, then runs the implementation's hook.
  explicit GradientManager(std::unique_ptr<ManagerImpl> impl) noexcept;
  /// Both gradient_ready overloads, once the buffer is known and validated.
  void ready(std::size_t i, ConstTensorView grad, const device::Event& written);
  friend std::unique_ptr<GradientManager> make_gradient_manager(ManagerConfig config);

  std::unique_ptr<ManagerImpl> impl_;  ///< the mode's manager (managers/manager_impl.hpp)
};

/// Returns the manager for config.mode — the trainer's one entry point: GpuGradientManager
/// for "none", the streamed-state manager for "optimizer", OffloadGradientManager for
/// "full". Validates everything first: an optimizer the mode cannot step (Errc::not_supported
/// naming "optimizer", saying which mode can), its hyper-parameters, a missing device, a
/// communicator in the wrong memory space or (a device communicator) on another stream than
/// the device's compute stream, bad sizes.
std::unique_ptr<GradientManager> make_gradient_manager(ManagerConfig config);

}  // namespace stepcore
