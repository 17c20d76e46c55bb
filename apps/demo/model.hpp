// The synthetic model's shape: published LLM configs (Llama/Qwen2 family) as data,
// the tensor layout they imply, and each tensor's kind (init, gradient magnitude,
// weight-decay group).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace stepcore_demo {

/// The shape-relevant part of a Hugging Face decoder config (Llama/Qwen2 family:
/// RMSNorm, grouped-query attention, SwiGLU MLP).
struct ModelConfig {
  std::string_view name;
  std::int64_t vocab;         ///< vocab_size
  std::int64_t hidden;        ///< hidden_size
  std::int64_t intermediate;  ///< intermediate_size
  std::int64_t layers;        ///< num_hidden_layers
  std::int64_t heads;         ///< num_attention_heads
  std::int64_t kv_heads;      ///< num_key_value_heads
  std::int64_t head_dim;      ///< hidden / heads for these models
  bool qkv_bias;              ///< q/k/v projections have biases (Qwen2)
  bool tied_embeddings;       ///< lm_head shares embed_tokens' weight
};

/// The published configs (config.json of each model on the Hugging Face hub).
inline constexpr ModelConfig kModels[] = {
    {"qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, 64, true, true},
    {"llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, 64, false, true},
    {"llama-3.2-3b", 128256, 3072, 8192, 28, 24, 8, 128, false, true},
    {"llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, 128, false, false},
};

/// Returns the config named `name`, or nullptr.
const ModelConfig* find_model(std::string_view name);

/// What a tensor is; decides its init, gradient magnitude and weight-decay group.
enum class TensorKind : std::uint8_t {
  embedding,
  lm_head,
  attn_weight,
  attn_bias,
  mlp_weight,
  norm
};

/// Returns the printable name of a tensor kind ("attention", "norm", ...).
const char* kind_name(TensorKind k);

/// One parameter tensor: its Hugging Face name, shape (cols 1 for vectors) and kind.
struct TensorSpec {
  std::string name;
  std::int64_t rows;
  std::int64_t cols;
  TensorKind kind;

  /// Returns the number of elements.
  std::size_t numel() const { return static_cast<std::size_t>(rows * cols); }
};

/// Returns every parameter tensor of `c`, in the order a state dict lists them.
std::vector<TensorSpec> build_layout(const ModelConfig& c);

/// Returns the total number of elements of `layout`.
std::size_t total_numel(std::span<const TensorSpec> layout);

/// Returns true for tensors trainers exclude from weight decay (norms, biases).
inline bool no_decay(TensorKind k) { return k == TensorKind::norm || k == TensorKind::attn_bias; }

/// Returns the kind's relative gradient magnitude: small for embeddings (a
/// tied embedding also receives lm_head's dense gradient), large for norms.
double grad_weight(TensorKind k, bool tied);

}  // namespace stepcore_demo
