// The synthetic model of stepcore-demo: published LLM tensor layouts as data,
// and deterministic counter-based synthetic gradients and initial weights.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stepcore/convert.hpp"

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
inline const ModelConfig* find_model(std::string_view name) {
  for (const ModelConfig& m : kModels)
    if (m.name == name) return &m;
  return nullptr;
}

/// What a tensor is; decides its init, gradient magnitude and weight-decay group.
enum class TensorKind : std::uint8_t {
  embedding,
  lm_head,
  attn_weight,
  attn_bias,
  mlp_weight,
  norm
};

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
inline std::vector<TensorSpec> build_layout(const ModelConfig& c) {
  std::vector<TensorSpec> t;
  const std::int64_t q = c.heads * c.head_dim;
  const std::int64_t kv = c.kv_heads * c.head_dim;
  t.push_back({"model.embed_tokens.weight", c.vocab, c.hidden, TensorKind::embedding});
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", c.hidden, 1, TensorKind::norm});
    t.push_back({p + "self_attn.q_proj.weight", q, c.hidden, TensorKind::attn_weight});
    if (c.qkv_bias) t.push_back({p + "self_attn.q_proj.bias", q, 1, TensorKind::attn_bias});
    t.push_back({p + "self_attn.k_proj.weight", kv, c.hidden, TensorKind::attn_weight});
    if (c.qkv_bias) t.push_back({p + "self_attn.k_proj.bias", kv, 1, TensorKind::attn_bias});
    t.push_back({p + "self_attn.v_proj.weight", kv, c.hidden, TensorKind::attn_weight});
    if (c.qkv_bias) t.push_back({p + "self_attn.v_proj.bias", kv, 1, TensorKind::attn_bias});
    t.push_back({p + "self_attn.o_proj.weight", c.hidden, q, TensorKind::attn_weight});
    t.push_back({p + "post_attention_layernorm.weight", c.hidden, 1, TensorKind::norm});
    t.push_back({p + "mlp.gate_proj.weight", c.intermediate, c.hidden, TensorKind::mlp_weight});
    t.push_back({p + "mlp.up_proj.weight", c.intermediate, c.hidden, TensorKind::mlp_weight});
    t.push_back({p + "mlp.down_proj.weight", c.hidden, c.intermediate, TensorKind::mlp_weight});
  }
  t.push_back({"model.norm.weight", c.hidden, 1, TensorKind::norm});
  if (!c.tied_embeddings) t.push_back({"lm_head.weight", c.vocab, c.hidden, TensorKind::lm_head});
  return t;
}

/// Returns the total number of elements of `layout`.
inline std::size_t total_numel(std::span<const TensorSpec> layout) {
  std::size_t n = 0;
  for (const TensorSpec& t : layout) n += t.numel();
  return n;
}

/// Returns true for tensors trainers exclude from weight decay (norms, biases).
inline bool no_decay(TensorKind k) { return k == TensorKind::norm || k == TensorKind::attn_bias; }

/// Returns the kind's relative gradient magnitude: small for embeddings (a
/// tied embedding also receives lm_head's dense gradient), large for norms.
inline double grad_weight(TensorKind k, bool tied) {
  switch (k) {
    case TensorKind::embedding:
      return tied ? 0.3 : 0.05;
    case TensorKind::lm_head:
      return 0.5;
    case TensorKind::attn_weight:
      return 1.0;
    case TensorKind::attn_bias:
      return 2.0;
    case TensorKind::mlp_weight:
      return 0.7;
    case TensorKind::norm:
      return 4.0;
  }
  return 1.0;
}

// ---- counter-based randomness ---------------------------------------------------

/// Returns the splitmix64 finaliser of `x`: a bijective 64-bit mix.
inline std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

/// Returns the key of one random stream, a hash of its coordinates.
inline std::uint64_t stream_key(std::uint64_t seed, std::uint64_t domain, std::uint64_t a,
                                std::uint64_t b = 0, std::uint64_t c = 0) {
  std::uint64_t k = mix64(seed + 0x9E3779B97F4A7C15ull);
  for (const std::uint64_t v : {domain, a, b, c}) k = mix64(k ^ (v + 0x9E3779B97F4A7C15ull));
  return k;
}

/// Returns a value uniform in [0, 1) for counter `i` of stream `key`.
inline double uniform(std::uint64_t key, std::uint64_t i) {
  return static_cast<double>(mix64(key + (i + 1) * 0x9E3779B97F4A7C15ull) >> 11) * 0x1.0p-53;
}

/// Returns a 32-bit hash of `x`: a two-round multiply-xorshift bijection that
/// compilers vectorise (32-bit multiplies), unlike mix64.
inline std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

/// The two 32-bit keys of one 2^32-element block of a stream.
struct BlockKeys {
  std::uint32_t k0;
  std::uint32_t k1;
};

/// Returns the keys of block `block` (counters block * 2^32 ...) of stream `key`.
inline BlockKeys block_keys(std::uint64_t key, std::uint64_t block) {
  const std::uint64_t h = mix64(key ^ mix64(block + 0x9E3779B97F4A7C15ull));
  return {static_cast<std::uint32_t>(h), static_cast<std::uint32_t>(h >> 32)};
}

/// Returns an approximately standard normal value for counter `j` of a block:
/// the Irwin-Hall sum of the four 16-bit lanes of two hashes, centred and
/// scaled to unit variance (|z| <= 3.47).
inline float gauss_in_block(BlockKeys k, std::uint32_t j) {
  const std::uint32_t x = j * 0x9E3779B9u;
  const std::uint32_t a = mix32(x + k.k0);
  const std::uint32_t b = mix32(x + k.k1);
  const std::int32_t s =
      static_cast<std::int32_t>((a & 0xFFFFu) + (a >> 16) + (b & 0xFFFFu) + (b >> 16));
  // Four uniforms on {0..65535}: mean 131070, variance 4 * (65536^2 - 1) / 12.
  constexpr float kInvStd = 1.0f / 37837.23f;
  return static_cast<float>(s - 131070) * kInvStd;
}

/// Returns the approximately standard normal value of counter `i` of stream `key`.
inline float gauss(std::uint64_t key, std::uint64_t i) {
  return gauss_in_block(block_keys(key, i >> 32), static_cast<std::uint32_t>(i));
}

/// Writes out[i] = from_f32<T>(stddev * gauss(key, i)) for begin <= i < end (out
/// points at element 0 of the stream): the same values as the per-element form, in
/// loops the compiler vectorises. Each element depends only on (key, i), so any
/// split of [0, n) into ranges, filled in any order or in parallel, gives the same
/// bits as one sequential fill.
template <class T>
void fill_gauss_range(T* out, std::size_t begin, std::size_t end, std::uint64_t key, float stddev) {
  constexpr std::uint64_t kBlock = 0x100000000ull;
  std::uint64_t i = begin;
  while (i < end) {
    const std::uint64_t block = i / kBlock;
    const std::uint64_t stop = std::min<std::uint64_t>(end, (block + 1) * kBlock);
    const BlockKeys k = block_keys(key, block);
    T* o = out + block * kBlock;
    const std::uint64_t j0 = i - block * kBlock, j1 = stop - block * kBlock;
    for (std::uint64_t j = j0; j < j1; ++j)
      o[j] = stepcore::from_f32<T>(stddev * gauss_in_block(k, static_cast<std::uint32_t>(j)));
    i = stop;
  }
}

/// Writes out[i] = from_f32<T>(stddev * gauss(key, i)) for i < n.
template <class T>
void fill_gauss(T* out, std::size_t n, std::uint64_t key, float stddev) {
  fill_gauss_range(out, 0, n, key, stddev);
}

/// Random-stream domains, so parameters and gradients never share a stream.
enum Domain : std::uint64_t { kInitDomain = 1, kGradDomain = 2, kTokenDomain = 3, kNormDomain = 4 };

/// Writes elements [begin, end) of the initial values of tensor t of kind k (out
/// points at its element 0): N(0, 0.02) (approximately) for matrices and
/// embeddings, 1 for norms, 0 for biases. Pure in (seed, t, i), like fill_gauss_range.
inline void fill_init_range(float* out, std::size_t begin, std::size_t end, std::uint64_t seed,
                            std::size_t t, TensorKind k) {
  if (k == TensorKind::norm || k == TensorKind::attn_bias) {
    std::fill(out + begin, out + end, k == TensorKind::norm ? 1.0f : 0.0f);
    return;
  }
  fill_gauss_range(out, begin, end, stream_key(seed, kInitDomain, t), 0.02f);
}

/// Writes the n initial values of tensor t of kind k.
inline void fill_init(float* out, std::size_t n, std::uint64_t seed, std::size_t t, TensorKind k) {
  fill_init_range(out, 0, n, seed, t, k);
}

// ---- the synthetic step -------------------------------------------------------

/// The loss-token counts of one step's micro-batches (SFT: known before the
/// step, from the batch's loss mask): each micro-batch of 8 sequences x 2048
/// positions has 20-55 % of its positions as response tokens.
inline std::vector<std::int64_t> micro_batch_tokens(std::uint64_t seed, std::int64_t step,
                                                    std::int64_t micro_batches) {
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(micro_batches));
  const std::uint64_t key = stream_key(seed, kTokenDomain, static_cast<std::uint64_t>(step));
  for (std::int64_t k = 0; k < micro_batches; ++k) {
    const double frac = 0.20 + 0.35 * uniform(key, static_cast<std::uint64_t>(k));
    tokens[static_cast<std::size_t>(k)] = static_cast<std::int64_t>(8 * 2048 * frac);
  }
  return tokens;
}

/// Returns the step's intended global norm (after the 1/tokens scale): a fixed
/// cycle with spikes, jittered by +-10 % per seed. Designed around max_norm 1:
/// steps 1 and 3 clip, steps 2 and 4 do not.
inline double target_norm(std::uint64_t seed, std::int64_t step) {
  static constexpr double kCycle[] = {2.2, 0.6, 1.5, 0.75, 0.45, 3.5, 0.85, 1.3};
  const double base = kCycle[static_cast<std::size_t>(step) % std::size(kCycle)];
  const double jitter =
      0.9 + 0.2 * uniform(stream_key(seed, kNormDomain, 0), static_cast<std::uint64_t>(step));
  return base * jitter;
}

/// Returns the per-tensor standard deviations sigma[t] * tokens[k] of one step's
/// micro-batch gradients, chosen so that the scaled accumulated gradient has
/// expected norm target: each micro-batch gradient is a sum over its tokens.
/// Element i of micro-batch k of tensor t is sigma[t] * tokens[k] * gauss(...).
inline std::vector<double> grad_sigmas(std::span<const TensorSpec> layout, bool tied,
                                       std::span<const std::int64_t> tokens, double target) {
  double weighted = 0.0;  // sum over tensors of numel * w^2
  for (const TensorSpec& t : layout) {
    const double w = grad_weight(t.kind, tied);
    weighted += static_cast<double>(t.numel()) * w * w;
  }
  double total = 0.0, squares = 0.0;
  for (const std::int64_t n : tokens) {
    total += static_cast<double>(n);
    squares += static_cast<double>(n) * static_cast<double>(n);
  }
  // E|sum_k sigma_t n_k z / T|^2 summed over elements = c^2 W Q / T^2 = target^2.
  const double c = target * total / std::sqrt(weighted * squares);
  std::vector<double> sigma;
  sigma.reserve(layout.size());
  for (const TensorSpec& t : layout) sigma.push_back(c * grad_weight(t.kind, tied));
  return sigma;
}

/// Returns the key of the gradient stream of tensor t in micro-batch k of `step`.
inline std::uint64_t grad_key(std::uint64_t seed, std::int64_t step, std::int64_t k,
                              std::size_t t) {
  return stream_key(seed, kGradDomain, static_cast<std::uint64_t>(step),
                    static_cast<std::uint64_t>(k), t);
}

/// Returns the synthetic gradient (before rounding to its dtype) of element i
/// of tensor t in micro-batch k of `step`, given that micro-batch's stddev: any
/// element can be regenerated from (seed, step, micro-batch, tensor, element).
inline float grad_value(std::uint64_t seed, std::int64_t step, std::int64_t k, std::size_t t,
                        std::size_t i, float stddev) {
  return stddev * gauss(grad_key(seed, step, k, t), i);
}

}  // namespace stepcore_demo
