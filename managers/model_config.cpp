// The models a planner starts from (stepcore/plan.hpp): a Hugging Face decoder
// config.json read by a small strict JSON reader (RFC 8259; any malformed text is an
// Error naming the file, never a crash), and the decoder's parameters derived from it.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "stepcore/error.hpp"
#include "stepcore/plan.hpp"

namespace stepcore {
namespace {

// One JSON value. Numbers keep their text (sizes must be integers; other numbers are
// only skipped).
struct Json {
  enum class Kind : std::uint8_t { null, boolean, number, string, array, object } kind = Kind::null;
  bool flag = false;
  std::string text;  // number: its text; string: its decoded bytes
  std::vector<Json> items;
  std::map<std::string, Json, std::less<>> members;
};

constexpr int kMaxDepth = 64;
// Layers a planned decoder may have (its tensors are listed one by one).
constexpr std::uint64_t kMaxLayers = std::uint64_t{1} << 16;

class Reader {
 public:
  Reader(std::string_view s, const std::string& name) : s_(s), name_(name) {}

  Json document() {
    Json v = value(0);
    space();
    if (at_ != s_.size()) fail("text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(Errc::corrupt_file, name_,
                "not valid JSON at byte " + std::to_string(at_) + ": " + what);
  }
  void space() {
    while (at_ < s_.size() &&
           (s_[at_] == ' ' || s_[at_] == '\t' || s_[at_] == '\n' || s_[at_] == '\r'))
      ++at_;
  }
  bool take(char c) {
    if (at_ < s_.size() && s_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  void word(std::string_view w) {
    if (s_.substr(at_, w.size()) != w) fail("expected a value");
    at_ += w.size();
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail("nested more than 64 deep");
    space();
    if (at_ >= s_.size()) fail("unexpected end of the text");
    Json v;
    switch (s_[at_]) {
      case '{':
        ++at_;
        v.kind = Json::Kind::object;
        space();
        if (take('}')) return v;
        do {
          space();
          if (at_ >= s_.size() || s_[at_] != '"') fail("expected a string key");
          std::string key = string();
          space();
          if (!take(':')) fail("expected ':'");
          Json member = value(depth + 1);
          if (!v.members.emplace(key, std::move(member)).second)
            fail("the key \"" + key + "\" appears twice");
          space();
        } while (take(','));
        if (!take('}')) fail("expected ',' or '}'");
        return v;
      case '[':
        ++at_;
        v.kind = Json::Kind::array;
        space();
        if (take(']')) return v;
        do {
          v.items.push_back(value(depth + 1));
          space();
        } while (take(','));
        if (!take(']')) fail("expected ',' or ']'");
        return v;
      case '"':
        v.kind = Json::Kind::string;
        v.text = string();
        return v;
      case 't':
        word("true");
        v.kind = Json::Kind::boolean;
        v.flag = true;
        return v;
      case 'f':
        word("false");
        v.kind = Json::Kind::boolean;
        return v;
      case 'n':
        word("null");
        return v;
      default:
        v.kind = Json::Kind::number;
        v.text = number();
        return v;
    }
  }

  std::string number() {
    const std::size_t start = at_;
    auto digits = [&] {
      const std::size_t from = at_;
      while (at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9') ++at_;
      return at_ > from;
    };
    take('-');
    if (take('0')) {
    } else if (!digits()) {
      fail("expected a value");
    }
    if (take('.') && !digits()) fail("expected digits after '.'");
    if (take('e') || take('E')) {
      if (!take('+')) take('-');
      if (!digits()) fail("expected digits in the exponent");
    }
    return std::string(s_.substr(start, at_ - start));
  }

  unsigned hex4() {
    unsigned u = 0;
    for (int k = 0; k < 4; ++k, ++at_) {
      if (at_ >= s_.size()) fail("unterminated \\u escape");
      const char c = s_[at_];
      u <<= 4;
      if (c >= '0' && c <= '9')
        u |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f')
        u |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        u |= static_cast<unsigned>(c - 'A' + 10);
      else
        fail("bad \\u escape");
    }
    return u;
  }
  static void utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    ++at_;  // the opening quote
    std::string out;
    for (;;) {
      if (at_ >= s_.size()) fail("unterminated string");
      const char c = s_[at_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= s_.size()) fail("unterminated string");
      switch (s_[at_++]) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a lone low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!take('\\') || !take('u')) fail("a high surrogate without its low one");
            const unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("a high surrogate without its low one");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          utf8(out, cp);
          break;
        }
        default:
          --at_;
          fail("a bad escape");
      }
    }
  }

  std::string_view s_;
  const std::string& name_;
  std::size_t at_ = 0;
};

// The fields of the top-level object, each read once with its type checked.
class Fields {
 public:
  Fields(const Json& doc, const std::string& name) : doc_(doc), name_(name) {
    if (doc.kind != Json::Kind::object) bad("the config", "is not a JSON object");
  }
  [[noreturn]] void bad(const std::string& field, const std::string& what) const {
    throw Error(Errc::invalid_argument, name_, field + " " + what);
  }
  const Json* find(std::string_view key) const {
    const auto it = doc_.members.find(key);
    return it == doc_.members.end() || it->second.kind == Json::Kind::null ? nullptr : &it->second;
  }
  // A size: a non-negative integer of at most 64 bits; `fallback` when absent (0: required).
  std::uint64_t size(std::string_view key, std::uint64_t fallback = 0, bool required = true) const {
    const Json* v = find(key);
    const std::string field = "\"" + std::string(key) + "\"";
    if (v == nullptr) {
      if (required) bad(field, "is missing");
      return fallback;
    }
    if (v->kind != Json::Kind::number || v->text.empty() ||
        v->text.find_first_not_of("0123456789") != std::string::npos)
      bad(field, "is not a non-negative integer");
    std::uint64_t x = 0;
    for (char c : v->text)
      if (__builtin_mul_overflow(x, 10, &x) ||
          __builtin_add_overflow(x, static_cast<std::uint64_t>(c - '0'), &x))
        bad(field, "does not fit 64 bits");
    if (x == 0) bad(field, "is 0");
    return x;
  }
  bool flag(std::string_view key) const {
    const Json* v = find(key);
    if (v == nullptr) return false;
    if (v->kind != Json::Kind::boolean) bad("\"" + std::string(key) + "\"", "is not true or false");
    return v->flag;
  }
  std::string text(std::string_view key) const {
    const Json* v = find(key);
    if (v == nullptr) return {};
    if (v->kind != Json::Kind::string) bad("\"" + std::string(key) + "\"", "is not a string");
    return v->text;
  }

 private:
  const Json& doc_;
  const std::string& name_;
};

std::uint64_t product(std::uint64_t a, std::uint64_t b, const std::string& name, const char* what) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw Error(Errc::invalid_argument, name, std::string(what) + " overflows 64 bits");
  return r;
}

}  // namespace

DecoderConfig parse_decoder_config(std::string_view json, const std::string& name) {
  const Json doc = Reader(json, name).document();
  const Fields f(doc, name);
  DecoderConfig c;
  c.model_type = f.text("model_type");
  c.vocab_size = f.size("vocab_size");
  c.hidden_size = f.size("hidden_size");
  c.intermediate_size = f.size("intermediate_size");
  c.num_hidden_layers = f.size("num_hidden_layers");
  if (c.num_hidden_layers > kMaxLayers)
    f.bad("\"num_hidden_layers\"", "is more than " + std::to_string(kMaxLayers));
  c.num_attention_heads = f.size("num_attention_heads");
  c.num_key_value_heads = f.size("num_key_value_heads", c.num_attention_heads, false);
  if (f.find("head_dim") != nullptr) {
    c.head_dim = f.size("head_dim");
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      f.bad("\"hidden_size\"",
            "is not a multiple of \"num_attention_heads\" (and no \"head_dim\")");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    f.bad("\"num_attention_heads\"", "is not a multiple of \"num_key_value_heads\"");
  c.tie_word_embeddings = f.flag("tie_word_embeddings");
  c.attention_bias = f.flag("attention_bias");
  c.mlp_bias = f.flag("mlp_bias");
  const std::string dtype = f.text("torch_dtype");
  if (dtype.empty() || dtype == "bfloat16")
    c.dtype = DType::bf16;
  else if (dtype == "float16")
    c.dtype = DType::f16;
  else if (dtype == "float32")
    c.dtype = DType::f32;
  else
    f.bad("\"torch_dtype\"", "'" + dtype + "' is not bfloat16, float16 or float32");
  // Every shape's element count fits 64 bits (the largest products).
  (void)product(product(c.num_attention_heads, c.head_dim, name, "the attention width"),
                c.hidden_size, name, "a projection's size");
  (void)product(c.vocab_size, c.hidden_size, name, "the embedding's size");
  (void)product(c.intermediate_size, c.hidden_size, name, "an MLP projection's size");
  return c;
}

DecoderConfig read_decoder_config(const std::string& path) {
  constexpr std::uint64_t kMaxBytes = std::uint64_t{16} << 20;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Errc::io_error, path, "cannot open for reading");
  std::string text;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxBytes) throw Error(Errc::io_error, path, "larger than 16 MiB");
  }
  if (in.bad()) throw Error(Errc::io_error, path, "read failed");
  return parse_decoder_config(text, path);
}

std::vector<ModelParam> decoder_params(const DecoderConfig& c) {
  std::vector<ModelParam> out;
  auto add = [&](std::string name, std::vector<std::uint64_t> shape) {
    out.push_back(ModelParam{std::move(name), std::move(shape), c.dtype});
  };
  const std::uint64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim;
  const std::uint64_t kv = c.num_key_value_heads * c.head_dim, m = c.intermediate_size;
  const bool qkv_bias = c.attention_bias || c.model_type == "qwen2";
  const bool o_bias = c.attention_bias;
  add("model.embed_tokens.weight", {c.vocab_size, h});
  for (std::uint64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::pair<const char*, std::uint64_t> projections[] = {
        {"q_proj", q}, {"k_proj", kv}, {"v_proj", kv}};
    for (const auto& [proj, rows] : projections) {
      add(p + "self_attn." + proj + ".weight", {rows, h});
      if (qkv_bias) add(p + "self_attn." + proj + ".bias", {rows});
    }
    add(p + "self_attn.o_proj.weight", {h, q});
    if (o_bias) add(p + "self_attn.o_proj.bias", {h});
    if (c.model_type == "qwen3") {
      add(p + "self_attn.q_norm.weight", {c.head_dim});
      add(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    const std::pair<const char*, std::vector<std::uint64_t>> mlp[] = {
        {"gate_proj", {m, h}}, {"up_proj", {m, h}}, {"down_proj", {h, m}}};
    for (const auto& [proj, shape] : mlp) {
      add(p + "mlp." + proj + ".weight", shape);
      if (c.mlp_bias) add(p + "mlp." + proj + ".bias", {shape[0]});
    }
    add(p + "input_layernorm.weight", {h});
    add(p + "post_attention_layernorm.weight", {h});
  }
  add("model.norm.weight", {h});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h});
  return out;
}

}  // namespace stepcore
