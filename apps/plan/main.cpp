// stepcore-plan: predicts the host and device bytes each rank's gradient manager allocates
// for a model (a parameter count, a shapes file or a Hugging Face config.json) sharded over
// ranks, by kind, and whether it fits the given memory (stepcore/plan.hpp; docs/managers.md,
// "Planning memory"). Exit status: 0 planned (and fits what was given), 1 does not fit,
// 2 bad input (an error naming the argument or file).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/plan.hpp"

namespace {

using namespace stepcore;

constexpr const char* kUsage = R"(usage: stepcore-plan MODEL [options]
MODEL, exactly one of:
  --params COUNT          a parameter count: an integer, or with K M B T (10^3 10^6 10^9
                          10^12; "70B"); planned as tensors of 2^24 elements
  --shapes FILE           one parameter's shape per line: its dimensions as integers,
                          separated by spaces, 'x' or ',' ("4096 11008"); '#' comments
  --hf-config FILE        a Hugging Face config.json of a Llama/Mistral/Qwen-style decoder
options:
  --dtype bf16|f16|f32    gradients' and compute weights' dtype (default bf16; a config's
                          torch_dtype when not given)
  --ranks N               ranks the parameters are sharded over (FSDP; default 1)
  --ranks-per-node N      ranks on one node (default 1)
  --offload MODE          none, optimizer or full (default full)
  --optimizer NAME        any optimizer of stepcore's table (default adamw), or its 8-bit
                          name where it has one ("adamw8bit": block-wise 8-bit state)
  --min-8bit-size N       an 8-bit name's smallest parameter shard with 8-bit state, in
                          elements (default 4096; smaller ones keep f32 state)
  --micro-batches N       micro-batches per step (default 2)
  --overlap               overlapped steps: the rollback space is reserved
  --trainer-buffers       gradients and compute weights in the model's own tensors (as
                          stepcore.torch): no device gradient or compute buffers
  --speculation POLICY    always, never or auto (default auto)
  --speculation-bytes B   rollback budget in bytes, or "all" (default all)
  --speculation-device-bytes B   mode full: device staging budget, or "all" (default 0)
  --ring-slots N          mode full: slots per ring, or "default" (default)
  --ring-slot-elements N  mode full: elements per ring slot (default 524288)
  --chunk-elements N      elements per chunk (default 16777216)
  --checkpoint PHASE      none, save or load at the peak (default load)
  --host-memory BYTES     host memory per node to check against
  --gpu-memory BYTES      device memory per GPU to check against
BYTES: an integer, or with K M G T (10^3 ...), KB MB GB TB (the same) or KiB MiB GiB TiB
(2^10 ...): "480GB", "80GiB".
)";

// A bad command line: the option it names and what is wrong.
[[noreturn]] void bad(const std::string& option, const std::string& what) {
  throw Error(Errc::invalid_argument, option, what);
}

struct Suffix {
  std::string_view text;
  std::uint64_t factor;
};
constexpr Suffix kCountSuffixes[] = {
    {"K", 1000ull}, {"M", 1000000ull}, {"B", 1000000000ull}, {"T", 1000000000000ull}};
constexpr Suffix kByteSuffixes[] = {
    {"K", 1000ull},      {"M", 1000000ull},   {"G", 1000000000ull},  {"T", 1000000000000ull},
    {"KB", 1000ull},     {"MB", 1000000ull},  {"GB", 1000000000ull}, {"TB", 1000000000000ull},
    {"KiB", 1ull << 10}, {"MiB", 1ull << 20}, {"GiB", 1ull << 30},   {"TiB", 1ull << 40}};

// Parses a non-negative integer with an optional suffix of `suffixes`; anything else (a
// sign, a fraction, an exponent, an unknown suffix, more than 64 bits) names `option`.
std::uint64_t integer(const std::string& option, std::string_view text,
                      std::span<const Suffix> suffixes = {}) {
  std::size_t n = 0;
  while (n < text.size() && text[n] >= '0' && text[n] <= '9') ++n;
  const std::string shown = "'" + std::string(text) + "'";
  if (!text.empty() && text[0] == '-') bad(option, shown + " is negative");
  if (n == 0) bad(option, shown + " is not an integer");
  std::uint64_t factor = 1;
  if (n < text.size()) {
    const std::string_view rest = text.substr(n);
    bool known = false;
    for (const Suffix& s : suffixes)
      if (s.text == rest) {
        factor = s.factor;
        known = true;
      }
    if (!known)
      bad(option, shown + " is not an integer" +
                      (suffixes.empty() ? std::string() : " (with a suffix of the usage)"));
  }
  std::uint64_t x = 0;
  for (std::size_t k = 0; k < n; ++k)
    if (__builtin_mul_overflow(x, 10, &x) ||
        __builtin_add_overflow(x, static_cast<std::uint64_t>(text[k] - '0'), &x))
      bad(option, shown + " does not fit 64 bits");
  if (__builtin_mul_overflow(x, factor, &x)) bad(option, shown + " does not fit 64 bits");
  return x;
}

// A count of at least 1.
std::uint64_t positive(const std::string& option, std::string_view text) {
  const std::uint64_t x = integer(option, text);
  if (x == 0) throw Error(Errc::out_of_range, option, "'0': must be at least 1");
  return x;
}

// A budget: bytes, or "all" (ManagerConfig::kAllChunks).
std::int64_t budget(const std::string& option, std::string_view text) {
  if (text == "all") return ManagerConfig::kAllChunks;
  const std::uint64_t x = integer(option, text, kByteSuffixes);
  if (x > static_cast<std::uint64_t>(INT64_MAX)) bad(option, "more than 2^63 - 1 bytes");
  return static_cast<std::int64_t>(x);
}

DType dtype_of(const std::string& option, std::string_view text) {
  if (text == "bf16") return DType::bf16;
  if (text == "f16") return DType::f16;
  if (text == "f32") return DType::f32;
  bad(option, "'" + std::string(text) + "': one of bf16, f16, f32");
}

// The shapes file: one shape per line.
std::vector<ModelParam> read_shapes(const std::string& path, DType dtype) {
  std::ifstream in(path);
  if (!in) throw Error(Errc::io_error, path, "cannot open for reading");
  std::vector<ModelParam> model;
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    line = line.substr(0, line.find('#'));
    for (char& c : line)
      if (c == 'x' || c == ',' || c == '\t' || c == '\r') c = ' ';
    std::istringstream words(line);
    std::vector<std::uint64_t> shape;
    for (std::string w; words >> w;) {
      try {
        shape.push_back(integer(path, w));
      } catch (const Error&) {
        throw Error(Errc::invalid_argument, path,
                    "line " + std::to_string(number) + ": '" + w +
                        "' is not a non-negative integer dimension");
      }
    }
    if (shape.empty()) continue;
    model.push_back(ModelParam{"line" + std::to_string(number), std::move(shape), dtype});
  }
  if (in.bad()) throw Error(Errc::io_error, path, "read failed");
  if (model.empty()) throw Error(Errc::invalid_argument, path, "no shapes");
  return model;
}

struct Args {
  ModelPlanRequest request;
  std::string model_text;  // how the model was given, for the heading
  std::string checkpoint = "load";
  std::string optimizer = "adamw";  // as named (an 8-bit name included)
};

Args parse(int argc, char** argv) {
  Args a;
  a.request.manager.mode = OffloadMode::full;
  a.request.options.checkpoint = CheckpointPhase::load;
  std::optional<DType> dtype;
  std::optional<std::uint64_t> count;
  std::string shapes, hf, model_option;
  auto value = [&](int& k, const std::string& option) -> std::string_view {
    if (k + 1 >= argc) bad(option, "needs a value");
    return argv[++k];
  };
  auto model = [&](const std::string& option) {
    if (!model_option.empty()) bad(option, "the model is already given by " + model_option);
    model_option = option;
  };
  for (int k = 1; k < argc; ++k) {
    const std::string o = argv[k];
    ManagerConfig& m = a.request.manager;
    if (o == "--help" || o == "-h") {
      std::cout << kUsage;
      std::exit(0);
    } else if (o == "--params") {
      model(o);
      count = integer(o, value(k, o), kCountSuffixes);
    } else if (o == "--shapes") {
      model(o);
      shapes = value(k, o);
    } else if (o == "--hf-config") {
      model(o);
      hf = value(k, o);
    } else if (o == "--dtype") {
      dtype = dtype_of(o, value(k, o));
    } else if (o == "--ranks") {
      a.request.ranks = positive(o, value(k, o));
    } else if (o == "--ranks-per-node") {
      a.request.ranks_per_node = positive(o, value(k, o));
    } else if (o == "--offload") {
      const std::string_view v = value(k, o);
      try {
        m.mode = parse_offload_mode(v);
      } catch (const Error&) {
        bad(o, "'" + std::string(v) + "': one of none, optimizer, full");
      }
    } else if (o == "--optimizer") {
      a.optimizer = value(k, o);
      try {
        const OptimizerChoice choice = parse_optimizer_choice(a.optimizer);
        m.optimizer = choice.optimizer;
        m.q8_state = choice.q8_state;
      } catch (const Error& e) {
        // The library's message after its prefix: "unknown optimizer '<name>': expected ...".
        const std::string what = e.what();
        const std::string::size_type at = what.find("unknown optimizer");
        bad(o, at == std::string::npos ? what : what.substr(at));
      }
    } else if (o == "--min-8bit-size") {
      m.min_8bit_size = integer(o, value(k, o));
    } else if (o == "--micro-batches") {
      a.request.options.micro_batches = positive(o, value(k, o));
    } else if (o == "--trainer-buffers") {
      a.request.trainer_buffers = true;
    } else if (o == "--overlap") {
      a.request.options.overlap = true;
    } else if (o == "--speculation") {
      const std::string_view v = value(k, o);
      try {
        m.speculation = parse_speculation(v);
      } catch (const Error&) {
        bad(o, "'" + std::string(v) + "': one of always, never, auto");
      }
    } else if (o == "--speculation-bytes") {
      m.speculation_bytes = budget(o, value(k, o));
    } else if (o == "--speculation-device-bytes") {
      m.speculation_device_bytes = budget(o, value(k, o));
    } else if (o == "--ring-slots") {
      const std::string_view v = value(k, o);
      m.ring_slots =
          v == "default"
              ? ManagerConfig::kDefaultRing
              : static_cast<std::int64_t>(std::min<std::uint64_t>(positive(o, v), INT64_MAX));
    } else if (o == "--ring-slot-elements") {
      m.ring_slot_elements = positive(o, value(k, o));
    } else if (o == "--chunk-elements") {
      m.chunk_elements = positive(o, value(k, o));
    } else if (o == "--checkpoint") {
      a.checkpoint = value(k, o);
      try {
        a.request.options.checkpoint = parse_checkpoint_phase(a.checkpoint);
      } catch (const Error&) {
        bad(o, "'" + a.checkpoint + "': one of none, save, load");
      }
    } else if (o == "--host-memory") {
      a.request.host_memory = integer(o, value(k, o), kByteSuffixes);
    } else if (o == "--gpu-memory") {
      a.request.gpu_memory = integer(o, value(k, o), kByteSuffixes);
    } else {
      bad(o, "unknown option (--help lists them)");
    }
  }
  if (model_option.empty()) bad("--params", "no model: give --params, --shapes or --hf-config");
  if (count) {
    a.request.model = model_of_count(*count, dtype.value_or(DType::bf16));
    a.model_text = "--params " + std::to_string(*count);
  } else if (!shapes.empty()) {
    a.request.model = read_shapes(shapes, dtype.value_or(DType::bf16));
    a.model_text = shapes;
  } else {
    const DecoderConfig c = read_decoder_config(hf);
    a.request.model = decoder_params(c);
    if (dtype)
      for (ModelParam& p : a.request.model) p.dtype = *dtype;
    a.model_text = hf;
  }
  return a;
}

// Library arguments as the options that set them ("ring_slots" -> "--ring-slots").
std::string option_of(const std::string& argument) {
  static const char* const kNamed[] = {"ranks",
                                       "ranks_per_node",
                                       "micro_batches",
                                       "ring_slots",
                                       "ring_slot_elements",
                                       "chunk_elements",
                                       "speculation_bytes",
                                       "speculation_device_bytes"};
  for (const char* n : kNamed)
    if (argument == n) {
      std::string o = "--" + argument;
      for (char& c : o)
        if (c == '_') c = '-';
      return o;
    }
  return argument;
}

// Bytes in the largest binary unit that leaves at least 1 ("4.00 MiB", "32.85 GiB").
std::string human(std::uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, kUnits[u]);
  return buf;
}

void print(const Args& a, const ModelPlan& p) {
  const ModelPlanRequest& r = a.request;
  const ManagerConfig& m = r.manager;
  std::printf("stepcore-plan: a prediction of what each rank's gradient manager allocates\n");
  std::printf("model     %llu parameters in %llu tensors (%s)\n",
              static_cast<unsigned long long>(p.model_params),
              static_cast<unsigned long long>(p.tensors), a.model_text.c_str());
  std::printf("ranks     %llu, %llu per node; rank 0 holds the largest shards: %llu parameters\n",
              static_cast<unsigned long long>(r.ranks),
              static_cast<unsigned long long>(r.ranks_per_node),
              static_cast<unsigned long long>(p.params_per_rank));
  std::printf("manager   mode %s, optimizer %s, %zu micro-batches per step, %s, checkpoint %s\n",
              std::string(offload_mode_name(m.mode)).c_str(), a.optimizer.c_str(),
              r.options.micro_batches, r.options.overlap ? "overlapped" : "no overlap",
              a.checkpoint.c_str());
  if (m.q8_state)
    std::printf("          8-bit state for each parameter shard of at least %zu elements\n",
                m.min_8bit_size);
  if (r.trainer_buffers)
    std::printf("          gradients and compute weights in the model's own tensors\n");
  std::printf("\n");
  const double per = p.params_per_rank == 0 ? 1.0 : static_cast<double>(p.params_per_rank);
  std::printf("%-20s %-6s %16s %11s %11s %8s\n", "kind", "memory", "bytes/rank", "size", "peak",
              "B/param");
  auto row = [&](const std::string& kind, const char* where, std::uint64_t bytes,
                 std::uint64_t peak) {
    std::printf("%-20s %-6s %16llu %11s %11s %8.2f\n", kind.c_str(), where,
                static_cast<unsigned long long>(bytes), human(bytes).c_str(), human(peak).c_str(),
                static_cast<double>(bytes) / per);
  };
  for (const MemoryUse& k : p.rank.kinds)
    row(k.kind, k.device ? "device" : "host", k.bytes, k.peak);
  std::printf("\n");
  row("host total", "host", p.rank.host_bytes, p.rank.host_peak);
  row("device total", "device", p.rank.device_bytes, p.rank.device_peak);
  std::printf("%-20s %-6s %16llu %11s %11s (%llu ranks)\n", "host per node", "host",
              static_cast<unsigned long long>(p.rank.host_bytes * r.ranks_per_node),
              human(p.rank.host_bytes * r.ranks_per_node).c_str(), human(p.node_host_peak).c_str(),
              static_cast<unsigned long long>(r.ranks_per_node));
  if (p.fits_host)
    std::printf("fits host memory: %s (peak %s per node of %s)\n", *p.fits_host ? "yes" : "no",
                human(p.node_host_peak).c_str(), human(*r.host_memory).c_str());
  if (p.fits_gpu)
    std::printf("fits GPU memory:  %s (peak %s per GPU of %s)\n", *p.fits_gpu ? "yes" : "no",
                human(p.rank.device_peak).c_str(), human(*r.gpu_memory).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    const ModelPlan p = plan_model(a.request);
    print(a, p);
    return (p.fits_host.value_or(true) && p.fits_gpu.value_or(true)) ? 0 : 1;
  } catch (const Error& e) {
    // The library names its fields ("ring_slots"): say which option sets it.
    const std::string option = option_of(e.argument());
    std::fprintf(stderr, "stepcore-plan: %s%s\n", e.what(),
                 option != e.argument() ? (" (option " + option + ")").c_str() : "");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stepcore-plan: %s\n", e.what());
    return 2;
  }
}
