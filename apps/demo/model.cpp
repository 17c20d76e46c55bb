// The synthetic model's shape: config lookup, the state-dict layout of a config, and
// the per-kind properties (names, gradient magnitudes).
#include "model.hpp"

namespace stepcore_demo {

const ModelConfig* find_model(std::string_view name) {
  for (const ModelConfig& m : kModels)
    if (m.name == name) return &m;
  return nullptr;
}

const char* kind_name(TensorKind k) {
  switch (k) {
    case TensorKind::embedding:
      return "embedding";
    case TensorKind::lm_head:
      return "lm_head";
    case TensorKind::attn_weight:
      return "attention";
    case TensorKind::attn_bias:
      return "bias";
    case TensorKind::mlp_weight:
      return "mlp";
    case TensorKind::norm:
      return "norm";
  }
  return "?";
}

std::vector<TensorSpec> build_layout(const ModelConfig& c) {
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

std::size_t total_numel(std::span<const TensorSpec> layout) {
  std::size_t n = 0;
  for (const TensorSpec& t : layout) n += t.numel();
  return n;
}

double grad_weight(TensorKind k, bool tied) {
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

}  // namespace stepcore_demo
