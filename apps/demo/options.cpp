// stepcore-demo's command line: the usage text, the value parsers, and the option
// table that fills Options (every bad value a UsageError naming its option).
#include "options.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>

#include "model.hpp"
#include "stepcore/error.hpp"

namespace stepcore_demo {

namespace {

constexpr const char* kUsage = R"(usage: stepcore-demo [options]

Runs a few training steps "after backward" on a synthetic model with a published
LLM's tensor layout: per step, micro-batch gradients (synthetic, deterministic) are
accumulated into f32, scaled by 1/loss-tokens, the exact global norm and the clip
coefficient are computed, and the optimizer writes f32 parameters and bf16 compute
weights. Prints per-phase timings and a bitwise checksum of the final state.
The CPU engine's first step is checked bit for bit against the scalar reference.
NUMA placement (cpu backend): local rank r takes a disjoint share of the cores of its
GPU's NUMA node (CUDA device r mod the device count; without a GPU, the node of a
one-node machine); the engine's workers are bound to the share and the f32 state
(params, moments, accumulators) is bound to the node and first-touched by the
workers that use it. Without a single node to choose: a warning, and an unbound run.

options (--name value or --name=value):
  --model NAME         qwen2.5-0.5b (default), llama-3.2-1b, llama-3.2-3b, llama-3.1-8b
  --layers N|full      decoder layers to instantiate (default 4; full: the model's)
  --vocab N|full       vocabulary rows (default 32768; full: the model's)
  --steps N            optimizer steps (default 3)
  --micro-batches N    micro-batches accumulated per step (default 4)
  --max-norm X|none    clip the global norm to X (default 1.0; 0 or none: no clipping)
  --grad-dtype T       dtype of the micro-batch gradients: bf16 (default) or f32
  --optimizer O        adamw (default), adamw8bit (AdamW with block-wise 8-bit moments
                       for tensors of at least 4096 elements) or sign_sgd
  --formula F          AdamW arithmetic: torch (default), native or torchao
  --torch-build B      the torch kernel the torch formula reproduces: x86 (its AVX2
                       build) or aarch64 (its NEON build); default: this machine's
  --lr X               learning rate (default 3e-4)
  --weight-decay X     decoupled weight decay of matrices and embeddings (default 0.1;
                       norms and biases never decay)
  --seed N             seed of the synthetic weights and gradients (default 1)
  --backend B          implementation of the phases: cpu (default: stepcore::cpu::Engine,
                       SIMD + OpenMP) or reference (the scalar oracle, one thread)
  --isa I              cpu engine ISA: sse2, avx2, avx512 or neon (default: STEPCORE_ISA,
                       else the best this processor runs)
  --threads N          cpu engine threads, also used to generate the synthetic
                       gradients (default: STEPCORE_THREADS, else one per core of the
                       rank's NUMA share, else the CPUs of the affinity mask;
                       OMP_NUM_THREADS is ignored). With a NUMA share, N <= its cores:
                       the workers are bound to its first N cores
  --local-rank R       this process's rank on the node (default: LOCAL_RANK, else
                       OMPI_COMM_WORLD_LOCAL_RANK, else 0)
  --local-world-size N ranks on the node (default: LOCAL_WORLD_SIZE, else
                       OMPI_COMM_WORLD_LOCAL_SIZE, else 1)
  --no-bind            no NUMA placement: unbound threads, state pre-faulted by the
                       allocating thread (for comparison)
  --strict-numa        fail (exit 2) when the rank cannot be placed on one NUMA node,
                       instead of warning and running unbound
  --check-steps N      run the first N steps also with stepcore::reference on a copy
                       of the state and compare every buffer bit for bit (default 1;
                       0: off; cpu backend only; not counted in the phase timings)
  --inject-inf STEP    put one +Inf into STEP's gradients (1-based) to show found-inf
  --print-layout       list every tensor of the layout
  --managers-layers N  decoder layers of the managers phase's model (default 1)
  --managers-vocab N   vocabulary rows of the managers phase's model (default 8192)
  --no-managers        skip the managers phase: the same model (scaled by the two
                       options above) and gradient stream through the gradient managers
                       of offload modes none, optimizer and full (make_gradient_manager;
                       on CUDA device 0 when there is one, else on the host device that
                       runs the CUDA kernels' block bodies on the CPU), compared bit for
                       bit after every step (a second "bitwise:" line)
  --help               this text

exit status: 0 success, 1 runtime error or bitwise mismatch, 2 bad usage (including
an ISA this processor lacks, and --strict-numa without a placement)
)";

/// Returns `text` as a finite double >= 0; throws UsageError naming `opt`.
double parse_nonneg(std::string_view opt, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v) || v < 0.0)
    throw UsageError(std::string(opt) + ": expected a finite number >= 0, got '" + text + "'");
  return v;
}

/// Returns `text` as an unsigned 64-bit integer; throws UsageError naming `opt`.
std::uint64_t parse_u64(std::string_view opt, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || *end != '\0' || errno != 0)
    throw UsageError(std::string(opt) + ": expected an unsigned integer, got '" + text + "'");
  return v;
}

/// Returns the layer or vocab override: "full" -> 0, else an integer in [1, hi].
std::int64_t parse_size(std::string_view opt, const std::string& text, std::int64_t hi) {
  if (text == "full") return 0;
  try {
    return parse_int(opt, text, 1, hi);
  } catch (const UsageError&) {
    throw UsageError(std::string(opt) + ": expected 'full' or an integer in [1, " +
                     std::to_string(hi) + "], got '" + text + "'");
  }
}

/// Returns true for the options that take a value.
bool takes_value(std::string_view name) {
  static constexpr std::string_view kValued[] = {"--model",
                                                 "--layers",
                                                 "--vocab",
                                                 "--steps",
                                                 "--micro-batches",
                                                 "--max-norm",
                                                 "--grad-dtype",
                                                 "--optimizer",
                                                 "--formula",
                                                 "--torch-build",
                                                 "--lr",
                                                 "--weight-decay",
                                                 "--seed",
                                                 "--backend",
                                                 "--inject-inf",
                                                 "--isa",
                                                 "--threads",
                                                 "--check-steps",
                                                 "--local-rank",
                                                 "--local-world-size",
                                                 "--managers-layers",
                                                 "--managers-vocab"};
  for (const std::string_view v : kValued)
    if (v == name) return true;
  return false;
}

/// Applies option `name` with `value` to `o`; throws UsageError when either is bad.
void apply_option(Options& o, const std::string& name, const std::string& value) {
  if (name == "--model") {
    if (find_model(value) == nullptr) {
      std::string known;
      for (const ModelConfig& m : kModels)
        known += (known.empty() ? "" : ", ") + std::string(m.name);
      throw UsageError("--model: unknown model '" + value + "' (known: " + known + ")");
    }
    o.model = value;
  } else if (name == "--layers") {
    o.layers = parse_size(name, value, 4096);
  } else if (name == "--vocab") {
    o.vocab = parse_size(name, value, 16 * 1024 * 1024);
  } else if (name == "--steps") {
    o.steps = parse_int(name, value, 1, 16777215);  // f32 step counters stay exact
  } else if (name == "--micro-batches") {
    o.micro_batches = parse_int(name, value, 1, 4096);
  } else if (name == "--max-norm") {
    o.max_norm = value == "none" ? 0.0 : parse_nonneg(name, value);
    if (!std::isfinite(static_cast<float>(o.max_norm)))
      throw UsageError("--max-norm: must be finite in f32, got '" + value + "'");
  } else if (name == "--grad-dtype") {
    if (value == "bf16")
      o.grad_dtype = sc::DType::bf16;
    else if (value == "f32")
      o.grad_dtype = sc::DType::f32;
    else
      throw UsageError("--grad-dtype: expected bf16 or f32, got '" + value + "'");
  } else if (name == "--optimizer") {
    o.q8 = value == "adamw8bit";
    if (value == "adamw" || value == "adamw8bit")
      o.optimizer = Optimizer::adamw;
    else if (value == "sign_sgd")
      o.optimizer = Optimizer::sign_sgd;
    else
      throw UsageError("--optimizer: expected adamw, adamw8bit or sign_sgd, got '" + value + "'");
  } else if (name == "--formula") {
    std::size_t k = 0;
    while (k < std::size(sc::kAdamWFormulaNames) && sc::kAdamWFormulaNames[k] != value) ++k;
    if (k == std::size(sc::kAdamWFormulaNames))
      throw UsageError("--formula: expected native, torch or torchao, got '" + value + "'");
    o.formula = static_cast<sc::AdamWFormula>(k);
  } else if (name == "--torch-build") {
    if (value == "x86")
      o.torch_aarch64 = false;
    else if (value == "aarch64")
      o.torch_aarch64 = true;
    else
      throw UsageError("--torch-build: expected x86 or aarch64, got '" + value + "'");
  } else if (name == "--lr") {
    o.lr = parse_nonneg(name, value);
  } else if (name == "--weight-decay") {
    o.weight_decay = parse_nonneg(name, value);
  } else if (name == "--seed") {
    o.seed = parse_u64(name, value);
  } else if (name == "--backend") {
    o.backend = value;  // checked by make_backend, the one place that knows backends
  } else if (name == "--inject-inf") {
    o.inject_inf = parse_int(name, value, 1, 16777215);
  } else if (name == "--isa") {
    try {
      o.isa = sc::cpu::parse_isa(value, "--isa");
    } catch (const sc::Error&) {
      throw UsageError("--isa: expected sse2, avx2, avx512 or neon, got '" + value + "'");
    }
  } else if (name == "--threads") {
    o.threads = static_cast<int>(parse_int(name, value, 1, 4096));
  } else if (name == "--check-steps") {
    o.check_steps = parse_int(name, value, 0, 16777215);
  } else if (name == "--local-rank") {
    o.local_rank = static_cast<int>(parse_int(name, value, 0, 1 << 20));
  } else if (name == "--managers-layers") {
    o.managers_layers = parse_int(name, value, 1, 4096);
  } else if (name == "--managers-vocab") {
    o.managers_vocab = parse_int(name, value, 1, 16 * 1024 * 1024);
  } else if (name == "--local-world-size") {
    o.local_world_size = static_cast<int>(parse_int(name, value, 1, 1 << 20));
  } else {
    throw UsageError("unknown option '" + name + "'");
  }
}

}  // namespace

const char* usage_text() { return kUsage; }

std::int64_t parse_int(std::string_view opt, const std::string& text, std::int64_t lo,
                       std::int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v < lo || v > hi)
    throw UsageError(std::string(opt) + ": expected an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], got '" + text + "'");
  return v;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      o.help = true;
      continue;
    }
    if (arg == "--print-layout") {
      o.print_layout = true;
      continue;
    }
    if (arg == "--no-bind") {
      o.no_bind = true;
      continue;
    }
    if (arg == "--no-managers") {
      o.managers = false;
      continue;
    }
    if (arg == "--strict-numa") {
      o.strict_numa = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2)
      throw UsageError("unexpected argument '" + arg + "'");
    const std::size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else {
      if (takes_value(name)) {
        if (i + 1 >= argc) throw UsageError(name + ": missing value");
        value = argv[++i];
      }
    }
    apply_option(o, name, value);
  }
  if (o.lr * o.weight_decay > 1.0) throw UsageError("--lr times --weight-decay must be <= 1");
  if (!std::isfinite(static_cast<float>(o.lr))) throw UsageError("--lr: must be finite in f32");
  if (o.no_bind && o.strict_numa)
    throw UsageError("--strict-numa requires a placement; not valid with --no-bind");
  if (o.inject_inf > o.steps)
    throw UsageError("--inject-inf: step " + std::to_string(o.inject_inf) + " is beyond --steps " +
                     std::to_string(o.steps));
  return o;
}

}  // namespace stepcore_demo
