// Memory planning: the bytes a gradient manager will hold, by kind, computed from its
// configuration alone (no allocation, any model size), and the model descriptions a
// planner starts from: parameter shapes, a Hugging Face decoder config.json, FSDP shards.
// stepcore-plan and stepcore.plan_memory are built on these (docs/managers.md,
// "Planning memory").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stepcore/dtype.hpp"
#include "stepcore/managers.hpp"

namespace stepcore {

/// The checkpoint operation a plan's peak includes (its bounded buffers: docs/checkpoint.md).
enum class CheckpointPhase : std::uint8_t { none, save, load };

/// Returns the phase named exactly "none", "save" or "load"; anything else throws
/// Errc::invalid_argument naming "checkpoint".
CheckpointPhase parse_checkpoint_phase(std::string_view name);

/// The steps a plan describes: what the manager has allocated once they have run.
struct MemoryPlanOptions {
  /// Micro-batches per step (>= 1; 0 is Errc::out_of_range naming "micro_batches"). In
  /// mode full, 2 or more allocate the f32 accumulators.
  std::size_t micro_batches = 2;
  /// Overlapped steps (begin_step(scale, true)): the rollback space is reserved (when
  /// ManagerConfig::speculation is not never and speculation_bytes is not 0).
  bool overlap = false;
  /// A checkpoint save or load after the steps: its buffers count at the peak.
  CheckpointPhase checkpoint = CheckpointPhase::none;
};

/// Returns what make_gradient_manager(config) allocates, by kind, once steps as `options`
/// describes have run (then the checkpoint operation, if any): the same kinds in the same
/// order as GradientManager::memory(), `bytes` held in the steady state and `peak` the
/// most held at once. config.device may be null: the host device is planned (its norm
/// workspace). The configuration is validated as make_gradient_manager validates it
/// (sizes, groups, hyper-parameters, the ring), except what needs a device or a
/// communicator; nothing is allocated, and the time is linear in the parameters.
MemoryReport plan_memory(const ManagerConfig& config, const MemoryPlanOptions& options);

/// One parameter of a whole (unsharded) model.
struct ModelParam {
  std::string name;
  std::vector<std::uint64_t> shape;  ///< its dimensions; numel is their product
  DType dtype = DType::bf16;         ///< its gradients' and compute weights' dtype
};

/// Returns the product of `p.shape` (1 for no dimensions); Errc::out_of_range naming
/// "<argument>.shape" when it overflows 64 bits.
std::uint64_t model_param_numel(const ModelParam& p, const std::string& argument);

/// A decoder-only transformer's configuration as a Hugging Face config.json gives it
/// (Llama, Mistral, Qwen2, Qwen3 style).
struct DecoderConfig {
  std::string model_type;  ///< "llama", "mistral", "qwen2", "qwen3", ... ("" when absent)
  std::uint64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0;
  std::uint64_t num_hidden_layers = 0, num_attention_heads = 0;
  std::uint64_t num_key_value_heads = 0;  ///< absent: num_attention_heads
  std::uint64_t head_dim = 0;             ///< absent: hidden_size / num_attention_heads
  bool tie_word_embeddings = false;       ///< absent: false (no lm_head when true)
  bool attention_bias = false;            ///< q, k, v, o biases (qwen2: q, k, v always)
  bool mlp_bias = false;                  ///< gate, up, down biases
  DType dtype = DType::bf16;              ///< torch_dtype: bfloat16, float16, float32
};

/// Parses the text of a config.json. The JSON must be well formed (RFC 8259, nesting at
/// most 64 deep) and the fields present, integers where sizes are expected and booleans
/// where flags are; anything else throws Errc::corrupt_file (malformed JSON) or
/// Errc::invalid_argument (a missing or bad field) naming `name` (the file) and saying
/// what and where (num_hidden_layers at most 65536). Unknown fields are ignored.
DecoderConfig parse_decoder_config(std::string_view json, const std::string& name);
/// Reads and parses the file at `path` (parse_decoder_config naming it); Errc::io_error
/// naming `path` when it cannot be read, or is over 16 MiB.
DecoderConfig read_decoder_config(const std::string& path);
/// Returns every parameter of the decoder, with Hugging Face's names and shapes, in the
/// module's order (embed_tokens, each layer's attention and MLP and norms, norm, lm_head).
std::vector<ModelParam> decoder_params(const DecoderConfig& config);

/// A model on ranks, and the manager each rank builds: what stepcore-plan prints.
struct ModelPlanRequest {
  std::vector<ModelParam> model;
  /// Ranks the parameters are sharded over (FSDP: each rank holds ceil(numel / ranks)
  /// elements of every parameter, the last ranks less; the plan is rank 0's, the
  /// largest). >= 1, else Errc::out_of_range naming "ranks".
  std::uint64_t ranks = 1;
  /// Ranks on one node (>= 1 and <= ranks, else Errc::out_of_range naming "ranks_per_node").
  std::uint64_t ranks_per_node = 1;
  /// The manager: mode, optimizer, groups, chunks, speculation, ring (params and device
  /// are set from the model: each ModelParam's shard, gradients and compute weights in
  /// its dtype, the host device planned).
  ManagerConfig manager;
  /// The trainer's buffers (as stepcore.torch does): backward's gradients are the
  /// model's own (ParamSpec::gradient_buffer false) and step() writes the compute weights
  /// into the model's storage (compute_into): no device gradient or compute buffers.
  bool trainer_buffers = false;
  MemoryPlanOptions options;
  /// Bytes of host memory per node and device memory per GPU to check against (absent:
  /// not checked).
  std::optional<std::uint64_t> host_memory, gpu_memory;
};

/// A ModelPlanRequest's answer.
struct ModelPlan {
  MemoryReport rank;                  ///< plan_memory of rank 0's manager
  std::uint64_t model_params = 0;     ///< elements of the whole model
  std::uint64_t params_per_rank = 0;  ///< elements of rank 0's shards
  std::uint64_t tensors = 0;          ///< parameters of the model
  std::uint64_t node_host_peak = 0;   ///< rank.host_peak * ranks_per_node
  std::optional<bool> fits_host;      ///< node_host_peak <= host_memory (when given)
  std::optional<bool> fits_gpu;       ///< rank.device_peak <= gpu_memory (when given)
};

/// Plans rank 0 of `request` (errors as plan_memory's, and "model[i].shape" for a bad
/// shape).
ModelPlan plan_model(const ModelPlanRequest& request);

/// Returns a model of `count` parameters for planning without shapes: tensors of
/// kCountTensorElements elements each (the last less), named "params[k]", in `dtype`.
std::vector<ModelParam> model_of_count(std::uint64_t count, DType dtype = DType::bf16);
inline constexpr std::uint64_t kCountTensorElements = std::uint64_t{1} << 24;

}  // namespace stepcore
