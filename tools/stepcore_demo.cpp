// stepcore-demo, the main job: a few training steps "after backward" of a synthetic
// model with a real LLM's tensor layout -- accumulate micro-batch gradients, apply
// the 1/tokens scale lazily, exact global norm, clip, AdamW or SignSGD -- with
// per-phase timings and a bitwise checksum of the result. Runs on the CPU engine
// (stepcore::cpu::Engine) by default, cross-checked bit for bit against
// stepcore::reference on the first step(s); --backend reference runs the oracle alone.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "demo_managers.hpp"
#include "demo_model.hpp"
#include "stepcore/config.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/cuda.hpp"
#include "stepcore/error.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/numa.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"
#include "stepcore/tensor.hpp"

namespace sc = stepcore;
namespace demo = stepcore_demo;

namespace {

constexpr int kExitOk = 0;
constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;

/// A bad command line: reported with a hint, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// --strict-numa and the rank cannot be placed (or its state cannot be bound): exit 2.
struct StrictNumaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- options ----------------------------------------------------------------------

enum class Optimizer { adamw, sign_sgd };

/// Everything the command line sets.
struct Options {
  std::string model = "qwen2.5-0.5b";
  std::int64_t layers = 4;     ///< 0: the model's own count
  std::int64_t vocab = 32768;  ///< 0: the model's own size
  std::int64_t steps = 3;
  std::int64_t micro_batches = 4;
  double max_norm = 1.0;  ///< 0: no clipping
  sc::DType grad_dtype = sc::DType::bf16;
  sc::AdamWFormula formula = sc::AdamWFormula::native;
  Optimizer optimizer = Optimizer::adamw;
  double lr = 3e-4;
  double weight_decay = 0.1;
  std::uint64_t seed = 1;
  std::string backend = "cpu";
  std::optional<sc::cpu::Isa> isa;  ///< unset: the engine's choice (STEPCORE_ISA, else best)
  int threads = 0;                  ///< 0: the engine's choice (STEPCORE_THREADS, else affinity)
  std::int64_t check_steps = 1;     ///< steps cross-checked against the reference; 0: none
  std::int64_t inject_inf = 0;      ///< 1-based step whose gradients get one +Inf; 0: none
  std::optional<int> local_rank;    ///< unset: LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, else 0
  std::optional<int> local_world_size;  ///< unset: LOCAL_WORLD_SIZE, OMPI_..._LOCAL_SIZE, else 1
  bool no_bind = false;                 ///< no NUMA placement: unbound threads, pre-faulted state
  bool strict_numa = false;             ///< an unbound placement is an error (exit 2)
  bool print_layout = false;
  bool help = false;
  bool managers = true;                ///< run the managers phase
  std::int64_t managers_layers = 1;    ///< decoder layers of the managers phase's model
  std::int64_t managers_vocab = 8192;  ///< vocabulary rows of the managers phase's model
};

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
  --optimizer O        adamw (default) or sign_sgd
  --formula F          AdamW arithmetic: native (default) or torch
  --lr X               learning rate (default 3e-4)
  --weight-decay X     decoupled weight decay of matrices and embeddings (default 0.1;
                       norms and biases never decay)
  --seed N             seed of the synthetic weights and gradients (default 1)
  --backend B          implementation of the phases: cpu (default: stepcore::cpu::Engine,
                       SIMD + OpenMP) or reference (the scalar oracle, one thread)
  --isa I              cpu engine ISA: sse2, avx2 or avx512 (default: STEPCORE_ISA,
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

/// Returns `text` as an integer in [lo, hi]; throws UsageError naming `opt`.
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
    if (demo::find_model(value) == nullptr) {
      std::string known;
      for (const demo::ModelConfig& m : demo::kModels)
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
    if (value == "adamw")
      o.optimizer = Optimizer::adamw;
    else if (value == "sign_sgd")
      o.optimizer = Optimizer::sign_sgd;
    else
      throw UsageError("--optimizer: expected adamw or sign_sgd, got '" + value + "'");
  } else if (name == "--formula") {
    if (value == "native")
      o.formula = sc::AdamWFormula::native;
    else if (value == "torch")
      o.formula = sc::AdamWFormula::torch;
    else
      throw UsageError("--formula: expected native or torch, got '" + value + "'");
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
      throw UsageError("--isa: expected sse2, avx2 or avx512, got '" + value + "'");
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

/// Returns the options of the command line; throws UsageError on anything bad.
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

// ---- NUMA placement ----------------------------------------------------------------------

/// Returns true when the environment variable `name` is set and not empty.
bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

/// Returns "0-3,8,10-11" for a sorted list of CPU indexes ("-" when empty).
std::string cpu_list(const std::vector<int>& v) { return stepcore::numa::cpu_list_string(v); }

/// Where the cpu backend runs: the rank's NUMA placement, as chosen before any state
/// is allocated, for the engine (worker binding), the allocator and the header.
struct NumaChoice {
  bool enabled = false;  ///< false: --no-bind or the reference backend (nothing placed)
  bool bound = false;    ///< workers bound to `cpus`, f32 state placed on `node`
  int local_rank = 0;
  int local_world_size = 1;
  std::string gpu = "none";     ///< the rank's GPU, for the header
  int node = -1;                ///< memory node of the state (-1: unbound)
  std::string node_why;         ///< how the node was chosen
  std::vector<int> share;       ///< the placement's PUs, one per core of the rank's share
  std::vector<int> cpus;        ///< the PUs the engine's workers are bound to (a prefix of share)
  std::string threads_source;   ///< what set the worker count: share, --threads, STEPCORE_THREADS
  bool oversubscribed = false;  ///< more ranks than cores on the node (see reason)
  std::string reason;           ///< unbound: why; oversubscribed: the placement's note
  bool warned = false;          ///< numa::Topology already warned once about `reason`
};

/// Returns the rank's placement for the options: local rank and size from the options,
/// else the launcher's environment; the rank's GPU (CUDA device local_rank mod the
/// device count) and every local rank's, placed with numa::Topology::place; without a
/// GPU, the share of a one-node machine's node (Topology::place_on_node); anything else
/// is unbound, with the reason. Throws UsageError for an impossible rank or a thread
/// count above the share, StrictNumaError when Topology::place finds no node under
/// --strict-numa, stepcore::Error for a malformed LOCAL_* variable.
NumaChoice choose_numa(const Options& o) {
  NumaChoice c;
  if (o.no_bind) return c;
  c.enabled = true;
  c.local_rank = o.local_rank ? *o.local_rank : sc::numa::local_rank_from_env(0);
  c.local_world_size =
      o.local_world_size ? *o.local_world_size : sc::numa::local_world_size_from_env(1);
  if (c.local_rank >= c.local_world_size)
    throw UsageError("local rank " + std::to_string(c.local_rank) +
                     " is not below the local world size " + std::to_string(c.local_world_size) +
                     " (--local-rank / --local-world-size, or LOCAL_RANK / LOCAL_WORLD_SIZE)");
  const auto unbound = [&](std::string why) {
    c.reason = std::move(why);
    return c;
  };

  const int devices = sc::cuda::device_count();
  std::vector<std::string> rank_gpus;  // empty: no GPU
  if (devices > 0) {
    try {
      for (int r = 0; r < c.local_world_size; ++r)
        rank_gpus.push_back(sc::cuda::pci_bus_id(r % devices));
    } catch (const sc::Error& e) {
      c.gpu = "unknown";
      return unbound(std::string("cannot read the PCI bus id of a CUDA device: ") + e.what());
    }
    c.gpu = rank_gpus[static_cast<std::size_t>(c.local_rank)] + " (CUDA device " +
            std::to_string(c.local_rank % devices) + " of " + std::to_string(devices) + ")";
  } else {
    c.gpu = "none (no CUDA device)";
  }

  std::optional<sc::numa::Topology> topo;
  try {
    topo.emplace(sc::numa::Topology::live());
  } catch (const sc::Error& e) {
    return unbound(std::string("cannot load this machine's topology: ") + e.what());
  }
  sc::numa::Placement p;
  if (!rank_gpus.empty()) {
    try {
      p = topo->place(rank_gpus, c.local_rank, sc::numa::PlacementOptions{o.strict_numa});
    } catch (const sc::Error& e) {
      if (o.strict_numa && e.code() == sc::Errc::not_supported)
        throw StrictNumaError("cannot place local rank " + std::to_string(c.local_rank) +
                              " on one NUMA node: " + e.what());
      throw;
    }
    c.node_why = "the GPU's node";
  } else {
    const std::size_t nodes = topo->nodes().size();
    if (nodes != 1)
      return unbound("no CUDA device to place by, and " +
                     (nodes == 0 ? std::string("the topology has no NUMA node")
                                 : "this machine has " + std::to_string(nodes) +
                                       " NUMA nodes to choose from"));
    p = topo->place_on_node(topo->nodes().front().os_index, c.local_rank, c.local_world_size);
    c.node_why = "CPU-only run, one NUMA node";
  }
  // place() and place_on_node() warn once themselves when they fall back or oversubscribe.
  c.warned = true;
  if (!p.bound || p.cpus.empty())
    return unbound(p.reason.empty() ? "the placement has no cores" : p.reason);

  c.bound = true;
  c.node = p.numa_node;
  c.share = p.cpus;
  c.oversubscribed = p.oversubscribed;
  if (p.oversubscribed) c.reason = p.reason;
  // An explicit worker count takes the first cores of the share; it cannot exceed it.
  int want = 0;
  c.threads_source = "NUMA share";
  if (o.threads != 0) {
    want = o.threads;
    c.threads_source = "--threads";
  } else if (env_set("STEPCORE_THREADS")) {
    want =
        static_cast<int>(parse_int("STEPCORE_THREADS", std::getenv("STEPCORE_THREADS"), 1, 4096));
    c.threads_source = "STEPCORE_THREADS";
  }
  if (want > static_cast<int>(c.share.size()))
    throw UsageError(c.threads_source + " " + std::to_string(want) + " exceeds the " +
                     std::to_string(c.share.size()) + (c.share.size() == 1 ? " core" : " cores") +
                     " of local rank " + std::to_string(c.local_rank) + "'s share of NUMA node " +
                     std::to_string(c.node) + " (cpus " + cpu_list(c.share) +
                     "); use at most that many, or --no-bind");
  c.cpus.assign(c.share.begin(),
                c.share.begin() + (want != 0 ? want : static_cast<int>(c.share.size())));
  return c;
}

/// Restricts the calling (main) thread to the PUs of `cpus` before any OpenMP team
/// exists, so that the work outside stepcore calls (the synthetic gradients, the
/// reference check) and the pool threads it creates stay on the rank's share too; the
/// engine binds each worker to one PU during its calls. Returns false when refused.
bool restrict_main_thread(const std::vector<int>& cpus) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int pu : cpus)
    if (pu >= 0 && pu < CPU_SETSIZE) CPU_SET(pu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
#else
  (void)cpus;
  return false;
#endif
}

// ---- the backend: the one place that names an implementation ------------------------

/// The operations of a step, bound to one implementation: the scalar reference or
/// the CPU engine. Later backends (CUDA) add an entry in make_backend; the driver
/// does not change.
struct Backend {
  std::string name;
  std::string description;
  std::optional<sc::cpu::Engine> engine;  ///< set for the cpu backend
  NumaChoice numa;                        ///< the cpu backend's placement (enabled: false if none)

  /// Returns the threads the backend's calls use (and the synthetic fill uses).
  int threads() const { return engine ? engine->threads() : 1; }

  void accumulate(std::span<const sc::AccumulatePair> pairs) const {
    if (engine)
      engine->accumulate(pairs);
    else
      sc::reference::accumulate(pairs);
  }
  /// Returns the finalized global norm of the read values (never needs_exact: the
  /// engine recomputes an uncertifiable fast partial exactly).
  sc::NormResult norm(std::span<const sc::ConstTensorView> tensors, sc::GradientRead read) const {
    return engine ? engine->norm(tensors, read)
                  : sc::finalize(sc::reference::norm_partial(tensors, read));
  }
  void adamw_step(std::span<const sc::AdamWTensor> tensors, const sc::AdamWConfig& config,
                  sc::GradientRead read) const {
    if (engine)
      engine->adamw_step(tensors, config, read, nullptr);
    else
      sc::reference::adamw_step(tensors, config, read, nullptr);
  }
  void sign_sgd_step(std::span<const sc::SignSgdTensor> tensors, const sc::SignSgdConfig& config,
                     sc::GradientRead read) const {
    if (engine)
      engine->sign_sgd_step(tensors, config, read, nullptr);
    else
      sc::reference::sign_sgd_step(tensors, config, read, nullptr);
  }
};

/// Returns the backend of the options. Throws UsageError for an unknown backend or
/// engine options given to the reference, StrictNumaError for --strict-numa without a
/// placement, and the engine's stepcore::Error for a configuration it rejects (an ISA
/// this processor lacks, a bad STEPCORE_* or LOCAL_* value).
Backend make_backend(const Options& o) {
  Backend b;
  if (o.backend == "reference") {
    if (o.isa || o.threads != 0)
      throw UsageError(
          "--isa and --threads configure the cpu engine; not valid with "
          "--backend reference");
    if (o.local_rank || o.local_world_size || o.no_bind || o.strict_numa)
      throw UsageError(
          "--local-rank, --local-world-size, --no-bind and --strict-numa place "
          "the cpu engine; not valid with --backend reference");
    b.name = "reference";
    b.description = "scalar reference, one element at a time (the oracle)";
    return b;
  }
  if (o.backend == "cpu") {
    // Placement first: it decides the engine's workers and where the state goes.
    b.numa = choose_numa(o);
    const NumaChoice& nc = b.numa;
    if (nc.enabled && !nc.bound) {
      if (o.strict_numa)
        throw StrictNumaError("cannot place local rank " + std::to_string(nc.local_rank) +
                              " on one NUMA node: " + nc.reason);
      if (!nc.warned)
        sc::numa::warn_once("NUMA placement: " + nc.reason +
                            "; running unbound (threads float, state pre-faulted by the "
                            "allocating thread)");
    }
    if (nc.oversubscribed && !nc.warned) sc::numa::warn_once("NUMA placement: " + nc.reason);
    if (nc.bound) {
      if (!restrict_main_thread(nc.share))
        sc::numa::warn_once("cannot restrict the main thread to cpus " + cpu_list(nc.share) +
                            "; only the engine's workers are bound");
      b.engine.emplace(sc::cpu::EngineConfig{o.isa, static_cast<int>(nc.cpus.size()), nc.cpus});
    } else {
      b.engine.emplace(sc::cpu::EngineConfig{o.isa, o.threads, {}});
    }
    const sc::cpu::Engine& e = *b.engine;
    std::string supported;
    for (const sc::cpu::Isa i : sc::cpu::supported_isas())
      supported += (supported.empty() ? "" : ", ") + std::string(sc::cpu::isa_name(i));
    b.name = "cpu";
    b.description = "stepcore::cpu::Engine (SIMD + OpenMP), isa " + std::string(e.isa_name()) +
                    " (" +
                    (o.isa                     ? "--isa"
                     : env_set("STEPCORE_ISA") ? "STEPCORE_ISA"
                                               : "best") +
                    "; this processor: " + supported + "), " + std::to_string(e.threads()) +
                    (e.threads() == 1 ? " thread (" : " threads (") +
                    (nc.bound                      ? nc.threads_source
                     : o.threads != 0              ? std::string("--threads")
                     : env_set("STEPCORE_THREADS") ? std::string("STEPCORE_THREADS")
                                                   : std::string("affinity mask")) +
                    ")";
    char selftest[96];
    std::snprintf(selftest, sizeof selftest, "; %s self-test passed (%.2f ms)",
                  std::string(e.isa_name()).c_str(), e.self_test().seconds * 1e3);
    b.description += selftest;
    for (const sc::cpu::SelfTestResult& r : e.rejected_isas())
      b.description += "; " + std::string(sc::cpu::isa_name(r.isa)) + " failed its self-test (" +
                       r.kernel + "), not used";
    return b;
  }
  throw UsageError("--backend: unknown backend '" + o.backend + "' (available: cpu, reference)");
}

// ---- memory -------------------------------------------------------------------------

/// A zero-filled, page-aligned array of trivially copyable T whose pages are all
/// touched before any timed phase, so none pays for first-touch page faults: either
/// anonymous memory pre-faulted at allocation by the allocating thread, or a
/// NUMA-placed numa::HostBuffer the engine's workers have first-touched.
template <class T>
class AlignedArray {
 public:
  AlignedArray() = default;
  /// Allocates n zeroed elements, pre-faulted; throws std::bad_alloc.
  explicit AlignedArray(std::size_t n) : n_(n) {
    if (n == 0) return;
    bytes_ = (n * sizeof(T) + 4095) / 4096 * 4096;
#if defined(__linux__)
    // MAP_POPULATE faults the (kernel-zeroed) pages in one go: about twice as fast
    // as touching them one by one on virtual machines.
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
#else
    void* p = std::aligned_alloc(4096, bytes_);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes_);
#endif
    p_.reset(static_cast<T*>(p));
    p_.get_deleter().bytes = bytes_;
  }
  /// Takes the first n elements of `placed` (already first-touched by the caller).
  AlignedArray(std::size_t n, sc::numa::HostBuffer placed) : placed_(std::move(placed)), n_(n) {
    (void)placed_.at<T>(0, n);  // throws unless the buffer holds n elements of T
  }
  T* data() const { return p_ ? p_.get() : static_cast<T*>(placed_.data()); }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  /// Returns the placed buffer, or nullptr for pre-faulted anonymous memory.
  const sc::numa::HostBuffer* placed() const { return placed_.data() ? &placed_ : nullptr; }

 private:
  struct Release {
    std::size_t bytes = 0;
    void operator()(T* p) const {
#if defined(__linux__)
      munmap(p, bytes);
#else
      std::free(p);
#endif
    }
  };
  std::unique_ptr<T, Release> p_;
  sc::numa::HostBuffer placed_;
  std::size_t n_ = 0;
  std::size_t bytes_ = 0;
};

/// Elements [begin, end) of tensor `tensor`: one unit of the parallel synthetic fills.
struct FillChunk {
  std::size_t tensor;
  std::size_t begin;
  std::size_t end;
};

/// Elements per fill chunk.
constexpr std::size_t kFillChunk = std::size_t{1} << 16;

/// Elements each tensor's slice of a flat buffer is aligned to: 128 bytes of f32, 64 of
/// bf16, so every per-tensor view starts on a 64-byte boundary (a cache line, an
/// AVX-512 vector) of its page-aligned buffer.
constexpr std::size_t kSliceAlign = 32;

/// The instantiated model: config with overrides, tensor table and offsets.
struct Model {
  demo::ModelConfig config;  ///< with --layers/--vocab applied
  const demo::ModelConfig* published = nullptr;
  std::vector<demo::TensorSpec> layout;
  std::vector<std::size_t> offset;  ///< element offset of each tensor, kSliceAlign-aligned
  std::size_t numel = 0;            ///< parameters
  std::size_t padded = 0;           ///< elements of each flat buffer
  std::vector<FillChunk> chunks;    ///< every tensor cut into kFillChunk pieces, in order
};

/// Returns the model of the options: the published config, scaled down as asked.
Model make_model(const Options& o) {
  Model m;
  m.published = demo::find_model(o.model);
  m.config = *m.published;
  if (o.layers != 0) m.config.layers = o.layers;
  if (o.vocab != 0) m.config.vocab = o.vocab;
  m.layout = demo::build_layout(m.config);
  for (const demo::TensorSpec& t : m.layout) {
    m.offset.push_back(m.padded);
    m.numel += t.numel();
    m.padded += (t.numel() + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  }
  for (std::size_t t = 0; t < m.layout.size(); ++t)
    for (std::size_t b = 0; b < m.layout[t].numel(); b += kFillChunk)
      m.chunks.push_back({t, b, std::min(m.layout[t].numel(), b + kFillChunk)});
  return m;
}

/// The training state: flat buffers, one slice per tensor.
struct State {
  AlignedArray<float> param;               ///< f32 master parameters
  AlignedArray<float> exp_avg;             ///< AdamW first moment (empty for SignSGD)
  AlignedArray<float> exp_avg_sq;          ///< AdamW second moment (empty for SignSGD)
  AlignedArray<float> acc;                 ///< f32 gradient accumulators
  AlignedArray<sc::bfloat16_t> compute;    ///< bf16 compute weights (the model's copy)
  AlignedArray<sc::bfloat16_t> grad_bf16;  ///< one micro-batch's gradients, bf16
  AlignedArray<float> grad_f32;            ///< one micro-batch's gradients, f32
  std::vector<float> step;                 ///< per-tensor AdamW step counters
};

/// Returns a copy of `a` (same size, same bytes).
template <class T>
AlignedArray<T> clone(const AlignedArray<T>& a) {
  AlignedArray<T> c(a.size());
  if (a.size() != 0) std::memcpy(c.data(), a.data(), a.bytes());
  return c;
}

/// Returns one f32 array family (params, a moment, the accumulators) for `m` in a
/// numa::HostBuffer bound to the backend's node, first-touched by the engine: one
/// first_touch per list of `calls` (tensor indexes), the lists the kernels that use the
/// family most are called with, so each page is placed by the worker that will read and
/// write it. Under --strict-numa a buffer the kernel refuses to bind is an error.
AlignedArray<float> placed_f32(const Model& m, const Backend& b, bool strict,
                               std::span<const std::vector<std::size_t>> calls) {
  sc::numa::HostBuffer buf;
  try {
    buf = sc::numa::HostBuffer(m.padded * sizeof(float), b.numa.node, strict);
  } catch (const sc::Error& e) {
    if (strict && e.code() == sc::Errc::not_supported) throw StrictNumaError(e.what());
    throw;
  }
  for (const std::vector<std::size_t>& tensors : calls) {
    std::vector<sc::TensorView> views;
    views.reserve(tensors.size());
    for (const std::size_t t : tensors) {  // carved at the model's 64-byte aligned offsets
      const std::size_t n = m.layout[t].numel();
      views.push_back(sc::f32_view(buf.at<float>(m.offset[t] * sizeof(float), n), n));
    }
    b.engine->first_touch(views);
  }
  return AlignedArray<float>(m.padded, std::move(buf));
}

/// Allocates the (zeroed, touched) state for `m`. With a NUMA placement the f32
/// families are placed and first-touched by the engine's workers (placed_f32); the
/// rest, and everything without a placement, is pre-faulted anonymous memory.
State make_state(const Model& m, const Options& o, const Backend& b) {
  State s;
  if (b.engine && b.numa.bound) {
    // The optimizer is called once per weight-decay group, accumulate and the norm once
    // over all tensors: first-touch each family in the partition of its kernels.
    std::vector<std::vector<std::size_t>> groups(2), all(1);
    for (std::size_t t = 0; t < m.layout.size(); ++t) {
      groups[demo::no_decay(m.layout[t].kind) ? 1 : 0].push_back(t);
      all[0].push_back(t);
    }
    s.param = placed_f32(m, b, o.strict_numa, groups);
    if (o.optimizer == Optimizer::adamw) {
      s.exp_avg = placed_f32(m, b, o.strict_numa, groups);
      s.exp_avg_sq = placed_f32(m, b, o.strict_numa, groups);
    }
    s.acc = placed_f32(m, b, o.strict_numa, all);
  } else {
    s.param = AlignedArray<float>(m.padded);
    if (o.optimizer == Optimizer::adamw) {
      s.exp_avg = AlignedArray<float>(m.padded);
      s.exp_avg_sq = AlignedArray<float>(m.padded);
    }
    s.acc = AlignedArray<float>(m.padded);
  }
  s.compute = AlignedArray<sc::bfloat16_t>(m.padded);
  if (o.grad_dtype == sc::DType::bf16)
    s.grad_bf16 = AlignedArray<sc::bfloat16_t>(m.padded);
  else
    s.grad_f32 = AlignedArray<float>(m.padded);
  s.step.assign(m.layout.size(), 0.0f);
  return s;
}

/// Sets the initial f32 weights and their bf16 compute copies, on `threads`
/// threads (pure functions of the coordinates: the same bits for any count).
void init_weights(const Model& m, State& s, const Options& o, int threads) {
  const auto chunks = static_cast<std::int64_t>(m.chunks.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t i = 0; i < chunks; ++i) {
    const FillChunk& ch = m.chunks[static_cast<std::size_t>(i)];
    float* p = s.param.data() + m.offset[ch.tensor];
    sc::bfloat16_t* c = s.compute.data() + m.offset[ch.tensor];
    demo::fill_init_range(p, ch.begin, ch.end, o.seed, ch.tensor, m.layout[ch.tensor].kind);
    for (std::size_t j = ch.begin; j < ch.end; ++j) c[j] = sc::from_f32<sc::bfloat16_t>(p[j]);
  }
}

/// The stepcore argument lists of a run, built once over the state's buffers.
struct Calls {
  std::vector<sc::AccumulatePair> first;  ///< copy pairs (first micro-batch)
  std::vector<sc::AccumulatePair> rest;   ///< add pairs
  std::vector<sc::ConstTensorView> accs;  ///< accumulators, for the norm
  std::vector<sc::AdamWTensor> adamw[2];  ///< [0]: decayed, [1]: no decay
  std::vector<sc::SignSgdTensor> sign[2];
};

/// Returns the argument lists over `s` for the model `m`, reading the micro-batch
/// gradients from `grads` (s itself, or the state a checking copy was taken of).
Calls make_calls(const Model& m, State& s, const State& grads, const Options& o) {
  Calls c;
  for (std::size_t t = 0; t < m.layout.size(); ++t) {
    const std::size_t n = m.layout[t].numel();
    const std::size_t off = m.offset[t];
    const sc::TensorView acc = sc::f32_view(s.acc.data() + off, n);
    const sc::ConstTensorView src = o.grad_dtype == sc::DType::bf16
                                        ? sc::const_view(grads.grad_bf16.data() + off, n)
                                        : sc::const_view(grads.grad_f32.data() + off, n);
    c.first.push_back({acc, src, true});
    c.rest.push_back({acc, src, false});
    c.accs.push_back(acc);
    const sc::TensorView param = sc::f32_view(s.param.data() + off, n);
    const sc::TensorView out = sc::view(s.compute.data() + off, n);
    const int group = demo::no_decay(m.layout[t].kind) ? 1 : 0;
    if (o.optimizer == Optimizer::adamw)
      c.adamw[group].push_back({param, sc::f32_view(s.exp_avg.data() + off, n),
                                sc::f32_view(s.exp_avg_sq.data() + off, n), &s.step[t], acc, out});
    else
      c.sign[group].push_back({param, acc, out});
  }
  return c;
}

// ---- synthetic gradients --------------------------------------------------------------

/// Writes micro-batch k of `step` into the gradient buffer: element i of tensor
/// t is stddev[t] * gauss(grad_key(seed, step, k, t), i), rounded to the dtype.
/// Runs a static parallel-for over the model's chunks on `threads` threads; every
/// value is a pure function of its coordinates, so the bits do not depend on it.
void fill_micro_batch(const Model& m, State& s, const Options& o, std::int64_t step, std::int64_t k,
                      std::span<const double> stddev, int threads) {
  std::vector<std::uint64_t> keys(m.layout.size());
  std::vector<float> sds(m.layout.size());
  for (std::size_t t = 0; t < m.layout.size(); ++t) {
    keys[t] = demo::grad_key(o.seed, step, k, t);
    sds[t] = static_cast<float>(stddev[t]);
  }
  const bool bf16 = o.grad_dtype == sc::DType::bf16;
  const auto chunks = static_cast<std::int64_t>(m.chunks.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t i = 0; i < chunks; ++i) {
    const FillChunk& ch = m.chunks[static_cast<std::size_t>(i)];
    if (bf16)
      demo::fill_gauss_range(s.grad_bf16.data() + m.offset[ch.tensor], ch.begin, ch.end,
                             keys[ch.tensor], sds[ch.tensor]);
    else
      demo::fill_gauss_range(s.grad_f32.data() + m.offset[ch.tensor], ch.begin, ch.end,
                             keys[ch.tensor], sds[ch.tensor]);
  }
  for (std::size_t t = 0; t < m.layout.size(); ++t) {
    // Spot check: the vectorised fill gives what regenerating one element gives.
    const std::size_t n = m.layout[t].numel();
    const float x = demo::grad_value(o.seed, step, k, t, n - 1, sds[t]);
    const bool same =
        bf16 ? s.grad_bf16.data()[m.offset[t] + n - 1].bits == sc::from_f32<sc::bfloat16_t>(x).bits
             : sc::f32_bits(s.grad_f32.data()[m.offset[t] + n - 1]) == sc::f32_bits(x);
    if (!same)
      throw sc::Error(sc::Errc::internal, m.layout[t].name,
                      "synthetic gradient fill is not reproducible");
  }
}

/// Sets one element (middle of the middle tensor) of the gradient buffer to +Inf;
/// returns a description of where.
std::string inject_inf(const Model& m, State& s, const Options& o) {
  const std::size_t t = m.layout.size() / 2;
  const std::size_t i = m.layout[t].numel() / 2;
  const float inf = std::numeric_limits<float>::infinity();
  if (o.grad_dtype == sc::DType::bf16)
    s.grad_bf16.data()[m.offset[t] + i] = sc::from_f32<sc::bfloat16_t>(inf);
  else
    s.grad_f32.data()[m.offset[t] + i] = inf;
  return m.layout[t].name + "[" + std::to_string(i) + "]";
}

// ---- reporting helpers ---------------------------------------------------------------

using Clock = std::chrono::steady_clock;

/// Returns the seconds since `t0`.
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Returns n with thousands separators ("37,174,144").
std::string grouped(std::uint64_t n) {
  std::string d = std::to_string(n);
  for (int i = static_cast<int>(d.size()) - 3; i > 0; i -= 3)
    d.insert(static_cast<std::size_t>(i), ",");
  return d;
}

/// Returns a byte count in MiB or GiB.
std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  return buf;
}

/// Returns "%.9g [0xXXXXXXXX]": the value and its f32 bit pattern.
std::string f32_text(float x) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.9g [0x%08" PRIx32 "]", static_cast<double>(x), sc::f32_bits(x));
  return buf;
}

/// Prints one timed phase: name, milliseconds, GB/s of `bytes` touched, and a note.
void print_phase(const char* name, double sec, double bytes, const std::string& note) {
  if (bytes > 0 && sec > 0)
    std::printf("  %-10s %9.1f ms %7.2f GB/s   %s\n", name, sec * 1e3, bytes / sec / 1e9,
                note.c_str());
  else
    std::printf("  %-10s %9.1f ms %12s   %s\n", name, sec * 1e3, "", note.c_str());
}

/// FNV-1a (64-bit) over a sequence of words (32-bit f32 or 16-bit bf16 patterns).
struct Fnv64 {
  std::uint64_t h = 0xCBF29CE484222325ull;
  /// Mixes one word into the hash.
  void add(std::uint64_t word) { h = (h ^ word) * 0x100000001B3ull; }
};

/// Returns the FNV-1a hash of the f32 bit patterns of every tensor slice of `buf`.
std::uint64_t hash_f32(const Model& m, const float* buf) {
  Fnv64 f;
  for (std::size_t t = 0; t < m.layout.size(); ++t)
    for (std::size_t i = 0; i < m.layout[t].numel(); ++i) f.add(sc::f32_bits(buf[m.offset[t] + i]));
  return f.h;
}

/// Returns the FNV-1a hash of the bf16 bit patterns of every tensor slice of `buf`.
std::uint64_t hash_bf16(const Model& m, const sc::bfloat16_t* buf) {
  Fnv64 f;
  for (std::size_t t = 0; t < m.layout.size(); ++t)
    for (std::size_t i = 0; i < m.layout[t].numel(); ++i) f.add(buf[m.offset[t] + i].bits);
  return f.h;
}

/// Returns the printable name of a tensor kind.
const char* kind_name(demo::TensorKind k) {
  switch (k) {
    case demo::TensorKind::embedding:
      return "embedding";
    case demo::TensorKind::lm_head:
      return "lm_head";
    case demo::TensorKind::attn_weight:
      return "attention";
    case demo::TensorKind::attn_bias:
      return "bias";
    case demo::TensorKind::mlp_weight:
      return "mlp";
    case demo::TensorKind::norm:
      return "norm";
  }
  return "?";
}

/// Prints the backend, the model, its layout summary, the size of the state and the run.
void print_header(const Model& m, const Options& o, const Backend& b) {
  const demo::ModelConfig& c = m.config;
  const demo::ModelConfig& p = *m.published;
  std::printf("stepcore-demo %d.%d.%d\n", STEPCORE_VERSION_MAJOR, STEPCORE_VERSION_MINOR,
              STEPCORE_VERSION_PATCH);
  std::printf("backend    %.*s: %.*s\n", static_cast<int>(b.name.size()), b.name.data(),
              static_cast<int>(b.description.size()), b.description.data());
  std::printf("model      %.*s layout: layers %" PRId64 " of %" PRId64 ", vocab %" PRId64
              " of %" PRId64 ", hidden %" PRId64 ", intermediate %" PRId64 ", heads %" PRId64
              " (kv %" PRId64 ") x %" PRId64 "%s, %s embeddings\n",
              static_cast<int>(c.name.size()), c.name.data(), c.layers, p.layers, c.vocab, p.vocab,
              c.hidden, c.intermediate, c.heads, c.kv_heads, c.head_dim,
              c.qkv_bias ? ", q/k/v bias" : "", c.tied_embeddings ? "tied" : "untied");
  std::size_t nodecay = 0;
  for (const demo::TensorSpec& t : m.layout)
    if (demo::no_decay(t.kind)) ++nodecay;
  std::printf("layout     %zu tensors (%zu without decay), %s parameters (published model: %s)\n",
              m.layout.size(), nodecay, grouped(m.numel).c_str(),
              grouped(demo::total_numel(demo::build_layout(p))).c_str());
  if (o.print_layout)
    for (std::size_t t = 0; t < m.layout.size(); ++t)
      std::printf("  %-48s %7" PRId64 " x %-6" PRId64 " %12s  %s\n", m.layout[t].name.c_str(),
                  m.layout[t].rows, m.layout[t].cols, grouped(m.layout[t].numel()).c_str(),
                  kind_name(m.layout[t].kind));
  const double n = static_cast<double>(m.numel);
  const double moments = o.optimizer == Optimizer::adamw ? 8.0 * n : 0.0;
  const double grads = static_cast<double>(sc::dtype_size(o.grad_dtype)) * n;
  const double total = 4.0 * n + moments + 4.0 * n + grads + 2.0 * n;
  std::printf("state      %s (%.0f B/parameter): params f32 %s, ", human_bytes(total).c_str(),
              total / n, human_bytes(4.0 * n).c_str());
  if (o.optimizer == Optimizer::adamw)
    std::printf("exp_avg + exp_avg_sq f32 %s, ", human_bytes(moments).c_str());
  std::printf("accumulators f32 %s, micro-batch grads %s %s, compute weights bf16 %s\n",
              human_bytes(4.0 * n).c_str(), o.grad_dtype == sc::DType::bf16 ? "bf16" : "f32",
              human_bytes(grads).c_str(), human_bytes(2.0 * n).c_str());
  std::printf("run        %" PRId64 " steps x %" PRId64 " micro-batches, ", o.steps,
              o.micro_batches);
  if (o.optimizer == Optimizer::adamw)
    std::printf("adamw (%s formula, betas 0.9/0.999, eps 1e-8), ",
                o.formula == sc::AdamWFormula::native ? "native" : "torch");
  else
    std::printf("sign_sgd, ");
  std::printf("lr %g, weight decay %g, max_norm ", o.lr, o.weight_decay);
  if (o.max_norm > 0.0)
    std::printf("%g", o.max_norm);
  else
    std::printf("none (no clipping)");
  std::printf(", seed %" PRIu64 "\n", o.seed);
  if (!b.engine)
    std::printf("check      none: the reference backend is the oracle\n");
  else if (o.check_steps == 0)
    std::printf("check      off (--check-steps 0)\n");
  else
    std::printf(
        "check      step%s 1%s also run by stepcore::reference on a copy of the state, "
        "compared bit for bit (not in the phase timings)\n",
        o.check_steps > 1 && o.steps > 1 ? "s" : "",
        o.check_steps > 1 && o.steps > 1
            ? ("-" + std::to_string(std::min(o.check_steps, o.steps))).c_str()
            : "");
}

/// Where a sample of the placed state's pages are (numa::page_nodes).
struct PageCheck {
  std::size_t checked = 0;
  std::size_t on_node = 0;    ///< on the chosen node
  std::size_t elsewhere = 0;  ///< on another node
  std::size_t absent = 0;     ///< not faulted in (never touched)
  std::size_t unknown = 0;    ///< the query failed
  int error = 0;              ///< errno of the last failed query
};

/// Adds every 64th page of [data, data + bytes) to `pc` (a coarser stride for buffers
/// of more than 2^20 pages, at most 16,384 samples each): one move_pages query per
/// sample page.
void check_pages(PageCheck& pc, const void* data, std::size_t bytes, int node) {
#if defined(__linux__)
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
#else
  const std::size_t page = 4096;
#endif
  const std::size_t pages = (bytes + page - 1) / page;
  const std::size_t stride = std::max<std::size_t>(64, (pages + 16383) / 16384);
  for (std::size_t i = 0; i < pages; i += stride) {
    const std::vector<int> where =
        sc::numa::page_nodes(static_cast<const char*>(data) + i * page, 1);
    const int w = where.empty() ? -EFAULT : where.front();
    ++pc.checked;
    if (w == node)
      ++pc.on_node;
    else if (w >= 0)
      ++pc.elsewhere;
    else if (w == -ENOENT)
      ++pc.absent;
    else {
      ++pc.unknown;
      pc.error = -w;
    }
  }
}

/// Prints the "numa" line: the rank, its GPU, the node and cores chosen and where the
/// state's pages are (checked on a sample), or why nothing was placed.
void print_numa(const State& s, const Backend& b) {
  const NumaChoice& c = b.numa;
  constexpr const char* kUnplaced = "threads float, state pre-faulted by the allocating thread";
  if (!b.engine) {
    std::printf("numa       not used: the reference backend runs one unbound thread\n");
    return;
  }
  if (!c.enabled) {
    std::printf("numa       off (--no-bind): %s\n", kUnplaced);
    return;
  }
  std::printf("numa       local rank %d/%d, gpu %s, ", c.local_rank, c.local_world_size,
              c.gpu.c_str());
  if (!c.bound) {
    std::printf("unbound: %s; %s\n", c.reason.c_str(), kUnplaced);
    return;
  }
  std::printf("node %d (%s), cpus %s (", c.node, c.node_why.c_str(), cpu_list(c.cpus).c_str());
  if (c.cpus.size() == c.share.size())
    std::printf("%zu core%s", c.cpus.size(), c.cpus.size() == 1 ? "" : "s");
  else
    std::printf("%s %zu of the share's %zu cores %s", c.threads_source.c_str(), c.cpus.size(),
                c.share.size(), cpu_list(c.share).c_str());
  if (c.oversubscribed) std::printf("; OVERSUBSCRIBED: %s", c.reason.c_str());
  std::printf("), ");

  PageCheck pc;
  bool all_bound = true;
  for (const AlignedArray<float>* a : {&s.param, &s.exp_avg, &s.exp_avg_sq, &s.acc}) {
    const sc::numa::HostBuffer* h = a->placed();
    if (h == nullptr) continue;  // empty (SignSGD moments)
    all_bound = all_bound && h->numa_node() == c.node;
    check_pages(pc, a->data(), a->bytes(), c.node);
  }
  if (all_bound)
    std::printf("state on node %d", c.node);
  else
    std::printf("state first-touched by the workers, not bound to node %d (mbind refused)", c.node);
  std::printf(" (checked %zu pages: %zu on node %d", pc.checked, pc.on_node, c.node);
  if (pc.elsewhere) std::printf(", %zu on other nodes", pc.elsewhere);
  if (pc.absent) std::printf(", %zu not present", pc.absent);
  if (pc.unknown) std::printf(", %zu unknown: %s", pc.unknown, std::strerror(pc.error));
  std::printf(")\n");
  if (pc.on_node != pc.checked) {
    std::fflush(stdout);
    sc::numa::warn_once(std::to_string(pc.checked - pc.on_node) + " of " +
                        std::to_string(pc.checked) + " sampled state pages are not on NUMA node " +
                        std::to_string(c.node));
  }
}

// ---- the bitwise cross-check -----------------------------------------------------------

/// The reference's copy of the state for one checked step, and what it computed.
struct Shadow {
  State state;  ///< params, moments, step counters, accumulators, compute weights
  Calls calls;  ///< over `state`, reading the engine state's micro-batch gradients
  sc::NormResult norm;
  float clip = 1.0f;
  bool applied = false;  ///< the reference ran its optimizer step
  double seconds = 0.0;  ///< copy, reference calls and comparison
};

/// Returns a copy of every buffer of `s` that a step reads or writes, except the
/// micro-batch gradients (shared: the reference reads the engine state's).
std::unique_ptr<Shadow> make_shadow(const Model& m, const State& s, const Options& o) {
  auto sh = std::make_unique<Shadow>();
  sh->state.param = clone(s.param);
  sh->state.exp_avg = clone(s.exp_avg);
  sh->state.exp_avg_sq = clone(s.exp_avg_sq);
  sh->state.acc = clone(s.acc);
  sh->state.compute = clone(s.compute);
  sh->state.step = s.step;
  sh->calls = make_calls(m, sh->state, s, o);
  return sh;
}

/// The norm, clip and optimizer outcome of one step.
struct StepOutcome {
  sc::NormResult norm;
  float clip = 1.0f;
  bool applied = false;
};

/// Returns "" when tensor slices of `a` and `b` (padding included) hold the same
/// bytes, else the first difference: "<what> <tensor>[<i>]: engine 0x.. reference 0x..".
template <class T>
std::string first_difference(const Model& m, const char* what, const T* a, const T* b) {
  for (std::size_t t = 0; t < m.layout.size(); ++t) {
    const std::size_t begin = m.offset[t];
    const std::size_t end = t + 1 < m.layout.size() ? m.offset[t + 1] : m.padded;
    if (std::memcmp(a + begin, b + begin, (end - begin) * sizeof(T)) == 0) continue;
    std::size_t i = begin;
    while (std::memcmp(a + i, b + i, sizeof(T)) == 0) ++i;
    std::uint32_t x = 0, y = 0;
    std::memcpy(&x, a + i, sizeof(T));
    std::memcpy(&y, b + i, sizeof(T));
    char buf[96];
    std::snprintf(buf, sizeof buf, "]%s: engine 0x%0*" PRIx32 " reference 0x%0*" PRIx32,
                  i - begin >= m.layout[t].numel() ? " (padding)" : "",
                  static_cast<int>(2 * sizeof(T)), x, static_cast<int>(2 * sizeof(T)), y);
    return std::string(what) + " " + m.layout[t].name + "[" + std::to_string(i - begin) + buf;
  }
  return "";
}

/// Compares the engine's state and outcome with the reference's, bit for bit.
/// Prints the "bitwise:" line; returns true when everything matched.
bool compare_with_reference(const Model& m, const State& s, const StepOutcome& e, const Shadow& sh,
                            const Options& o, const Backend& b, std::int64_t step) {
  std::vector<std::string> diffs;  // in the order the step computes them
  std::string matched;             // what was compared and equal
  const auto check = [&](const char* name, std::string diff) {
    if (!diff.empty())
      diffs.push_back(std::move(diff));
    else
      matched += (matched.empty() ? "" : ", ") + std::string(name);
  };
  const auto scalar = [&](const char* name, std::uint64_t x, std::uint64_t y, bool hex) {
    if (x == y) return;
    char buf[96];
    std::snprintf(buf, sizeof buf,
                  hex ? "%s: engine 0x%08" PRIx64 " reference 0x%08" PRIx64
                      : "%s: engine %" PRIu64 " reference %" PRIu64,
                  name, x, y);
    diffs.emplace_back(buf);
  };
  const bool adamw = o.optimizer == Optimizer::adamw;
  check("accumulators", first_difference(m, "accumulators", s.acc.data(), sh.state.acc.data()));
  scalar("norm", sc::f32_bits(e.norm.norm), sc::f32_bits(sh.norm.norm), true);
  scalar("max|g|", sc::f32_bits(e.norm.max_abs), sc::f32_bits(sh.norm.max_abs), true);
  scalar("finite", e.norm.finite, sh.norm.finite, false);
  scalar("NaN count", e.norm.nan_count, sh.norm.nan_count, false);
  scalar("Inf count", e.norm.inf_count, sh.norm.inf_count, false);
  scalar("optimizer applied", e.applied, sh.applied, false);
  if (e.applied && sh.applied) scalar("clip", sc::f32_bits(e.clip), sc::f32_bits(sh.clip), true);
  check("params", first_difference(m, "params", s.param.data(), sh.state.param.data()));
  if (adamw) {
    check("exp_avg", first_difference(m, "exp_avg", s.exp_avg.data(), sh.state.exp_avg.data()));
    check("exp_avg_sq",
          first_difference(m, "exp_avg_sq", s.exp_avg_sq.data(), sh.state.exp_avg_sq.data()));
  }
  check("compute weights",
        first_difference(m, "compute weights", s.compute.data(), sh.state.compute.data()));
  if (adamw) {
    std::string diff;
    for (std::size_t t = 0; t < s.step.size() && diff.empty(); ++t)
      if (sc::f32_bits(s.step[t]) != sc::f32_bits(sh.state.step[t])) {
        char buf[64];
        std::snprintf(buf, sizeof buf, ": engine %g reference %g", static_cast<double>(s.step[t]),
                      static_cast<double>(sh.state.step[t]));
        diff = "steps " + m.layout[t].name + buf;
      }
    check("steps", diff);
  }

  char who[96];
  std::snprintf(who, sizeof who, "cpu engine (%.*s, %d thread%s)",
                static_cast<int>(b.engine->isa_name().size()), b.engine->isa_name().data(),
                b.engine->threads(), b.engine->threads() == 1 ? "" : "s");
  if (diffs.empty()) {
    std::printf("bitwise: %s == reference on step %" PRId64 ": %s, norm 0x%08" PRIx32
                ", max|g| 0x%08" PRIx32,
                who, step + 1, matched.c_str(), sc::f32_bits(e.norm.norm),
                sc::f32_bits(e.norm.max_abs));
    if (e.applied)
      std::printf(", clip 0x%08" PRIx32, sc::f32_bits(e.clip));
    else
      std::printf(", found-inf (both skipped the optimizer)");
    std::printf(" (check %.2f s)\n", sh.seconds);
    return true;
  }
  std::printf("bitwise: MISMATCH %s != reference on step %" PRId64 ": %s", who, step + 1,
              diffs.front().c_str());
  if (diffs.size() > 1)
    std::printf(" (and %zu more difference%s)", diffs.size() - 1, diffs.size() == 2 ? "" : "s");
  std::printf("\n");
  return false;
}

// ---- the step ---------------------------------------------------------------------------

/// What a run did, for the summary line.
struct Totals {
  std::int64_t applied = 0, skipped = 0, clipped = 0;
  double phases = 0.0;  ///< seconds in accumulate, norm and optimizer
  double check = 0.0;   ///< seconds of the bitwise cross-check (not in phases)
  std::int64_t checked = 0, mismatched = 0;
};

/// Runs the optimizer of `o` over the calls `c` with the gradient read `read`,
/// through `b` (or the reference when b is null).
void optimizer_step(const Calls& c, const Options& o, const Backend* b, sc::GradientRead read) {
  if (o.optimizer == Optimizer::adamw) {
    sc::AdamWConfig cfg;
    cfg.lr = o.lr;
    cfg.formula = o.formula;
    for (int g = 0; g < 2; ++g) {
      cfg.weight_decay = g == 0 ? o.weight_decay : 0.0;
      if (b)
        b->adamw_step(c.adamw[g], cfg, read);
      else
        sc::reference::adamw_step(c.adamw[g], cfg, read, nullptr);
    }
  } else {
    sc::SignSgdConfig cfg;
    cfg.lr = o.lr;
    for (int g = 0; g < 2; ++g) {
      cfg.weight_decay = g == 0 ? o.weight_decay : 0.0;
      if (b)
        b->sign_sgd_step(c.sign[g], cfg, read);
      else
        sc::reference::sign_sgd_step(c.sign[g], cfg, read, nullptr);
    }
  }
}

/// Returns the clip coefficient of `norm` under the options (1 without clipping).
float clip_of(const Options& o, float norm) {
  return o.max_norm > 0.0 ? sc::clip_coefficient(norm, static_cast<float>(o.max_norm)) : 1.0f;
}

/// Runs training step `step` (0-based): generate and accumulate the micro-batches,
/// norm, clip, optimizer. Prints one line per phase; updates `totals`. With a
/// shadow, also runs every stepcore call of the step with stepcore::reference on
/// the shadow's copy (untimed; its seconds go to shadow->seconds).
StepOutcome run_step(const Model& m, State& s, const Calls& c, const Options& o, const Backend& b,
                     std::int64_t step, Totals& totals, Shadow* shadow) {
  const std::vector<std::int64_t> tokens = demo::micro_batch_tokens(o.seed, step, o.micro_batches);
  std::int64_t total_tokens = 0;
  std::string split;
  for (const std::int64_t n : tokens) {
    total_tokens += n;
    if (tokens.size() <= 8) split += (split.empty() ? "" : "+") + std::to_string(n);
  }
  // The step's gradient scale: 1 / loss tokens, a Python double narrowed to f32.
  const float scale = static_cast<float>(1.0 / static_cast<double>(total_tokens));
  std::printf("step %" PRId64 "/%" PRId64 ": %" PRId64 " loss tokens in %" PRId64
              " micro-batches%s%s%s, scale %s\n",
              step + 1, o.steps, total_tokens, o.micro_batches, split.empty() ? "" : " (",
              split.c_str(), split.empty() ? "" : ")", f32_text(scale).c_str());

  // Micro-batches: generate (not a stepcore phase), then accumulate.
  const double n = static_cast<double>(m.numel);
  const std::vector<double> stddev = demo::grad_sigmas(m.layout, m.config.tied_embeddings, tokens,
                                                       demo::target_norm(o.seed, step));
  double gen_s = 0.0, acc_s = 0.0, acc_bytes = 0.0;
  std::string injected;
  for (std::int64_t k = 0; k < o.micro_batches; ++k) {
    std::vector<double> sd(stddev);
    for (double& v : sd) v *= static_cast<double>(tokens[static_cast<std::size_t>(k)]);
    auto t0 = Clock::now();
    fill_micro_batch(m, s, o, step, k, sd, b.threads());
    if (o.inject_inf == step + 1 && k == o.micro_batches - 1) injected = inject_inf(m, s, o);
    gen_s += seconds_since(t0);
    t0 = Clock::now();
    b.accumulate(k == 0 ? c.first : c.rest);
    acc_s += seconds_since(t0);
    acc_bytes += n * static_cast<double>(sc::dtype_size(o.grad_dtype)) + n * (k == 0 ? 4.0 : 8.0);
    if (shadow) {  // the same micro-batch into the reference's accumulators
      t0 = Clock::now();
      sc::reference::accumulate(k == 0 ? shadow->calls.first : shadow->calls.rest);
      shadow->seconds += seconds_since(t0);
    }
  }
  const int gen_threads = b.threads();
  print_phase("generate", gen_s, 0.0,
              std::string("synthetic ") + (o.grad_dtype == sc::DType::bf16 ? "bf16" : "f32") +
                  " gradients on " + std::to_string(gen_threads) +
                  (gen_threads == 1 ? " thread" : " threads") +
                  " (input synthesis, not a stepcore phase)" +
                  (injected.empty() ? "" : "; +Inf injected at " + injected));
  print_phase("accumulate", acc_s, acc_bytes, "into f32 accumulators (copy, then add)");

  // Exact global norm of the scaled gradients.
  const sc::GradientRead unclipped{scale, 1.0f};
  auto t0 = Clock::now();
  StepOutcome out;
  out.norm = b.norm(c.accs, unclipped);
  const sc::NormResult& r = out.norm;
  const double norm_s = seconds_since(t0);
  if (r.needs_exact)  // Engine::norm and the exact reference never leave this set
    throw sc::Error(sc::Errc::internal, "norm", "backend returned an uncertified norm");
  if (shadow) {  // the reference's own norm, clip and optimizer step on the copy
    t0 = Clock::now();
    shadow->norm = sc::finalize(sc::reference::norm_partial(shadow->calls.accs, unclipped));
    if (shadow->norm.finite) {
      shadow->clip = clip_of(o, shadow->norm.norm);
      optimizer_step(shadow->calls, o, nullptr, sc::GradientRead{scale, shadow->clip});
      shadow->applied = true;
    }
    shadow->seconds += seconds_since(t0);
  }
  print_phase("norm", norm_s, 4.0 * n,
              "norm " + f32_text(r.norm) + "  max|g| " + f32_text(r.max_abs));
  totals.phases += acc_s + norm_s;
  if (!r.finite) {
    if (r.nan_count + r.inf_count > 0)
      std::printf("  found-inf  %" PRIu64 " NaN and %" PRIu64 " Inf gradient values", r.nan_count,
                  r.inf_count);
    else
      std::printf("  found-inf  the norm overflows f32");
    std::printf(": optimizer step SKIPPED, parameters and moments unchanged\n");
    ++totals.skipped;
    return out;
  }

  out.clip = clip_of(o, r.norm);
  const bool clipped = out.clip < 1.0f;
  std::printf("  clip       coefficient %s  %s\n", f32_text(out.clip).c_str(),
              o.max_norm > 0.0 ? (clipped ? "-> clipped" : "-> not clipped") : "(clipping off)");
  totals.clipped += clipped ? 1 : 0;

  t0 = Clock::now();
  optimizer_step(c, o, &b, sc::GradientRead{scale, out.clip});
  const double opt_s = seconds_since(t0);
  if (o.optimizer == Optimizer::adamw)
    print_phase("adamw", opt_s, 30.0 * n, "f32 params + moments in place, bf16 compute weights");
  else
    print_phase("sign_sgd", opt_s, 14.0 * n, "f32 params in place, bf16 compute weights");
  out.applied = true;
  totals.phases += opt_s;
  ++totals.applied;
  return out;
}

/// Runs the whole demo on `backend`; returns the exit code. Throws stepcore::Error
/// on failure.
/// Runs the managers phase: the demo's model scaled to --managers-layers/--managers-vocab,
/// the same gradient stream, through the three offload modes; returns true when they
/// agree bit for bit.
bool run_managers_phase(const Options& o, const Backend& backend) {
  demo::ManagersOptions mo;
  demo::ModelConfig config = *demo::find_model(o.model);
  config.layers = o.managers_layers;
  config.vocab = o.managers_vocab;
  mo.layout = demo::build_layout(config);
  mo.tied = config.tied_embeddings;
  mo.seed = o.seed;
  mo.steps = o.steps;
  mo.micro_batches = o.micro_batches;
  mo.max_norm = o.max_norm;
  mo.grad_dtype = o.grad_dtype;
  mo.optimizer.kind =
      o.optimizer == Optimizer::adamw ? sc::OptimizerKind::adamw : sc::OptimizerKind::sign_sgd;
  mo.optimizer.adamw.lr = o.lr;
  mo.optimizer.adamw.weight_decay = o.weight_decay;
  mo.optimizer.adamw.formula = o.formula;
  mo.optimizer.sign_sgd.lr = o.lr;
  mo.optimizer.sign_sgd.weight_decay = o.weight_decay;
  if (backend.engine) {
    mo.engine.isa = backend.engine->isa();
    mo.engine.threads = backend.engine->threads();
  }
  mo.chunk_elements = std::size_t{4} << 20;  // several chunks even for the small model
  mo.cuda = sc::cuda::device_count() > 0;
  return demo::run_managers_phase(mo);
}

int run(const Options& o, const Backend& backend) {
  const auto start = Clock::now();
  const Model model = make_model(o);
  print_header(model, o, backend);
  std::fflush(stdout);
  auto t0 = Clock::now();
  State state = make_state(model, o, backend);
  const double alloc_s = seconds_since(t0);
  print_numa(state, backend);
  t0 = Clock::now();
  init_weights(model, state, o, backend.threads());
  const double init_s = seconds_since(t0);
  const Calls calls = make_calls(model, state, state, o);
  std::printf("init       allocate and %s %.1f ms, initial weights %.1f ms\n",
              backend.numa.bound ? "first-touch (f32 state) / pre-fault (the rest)" : "pre-fault",
              alloc_s * 1e3, init_s * 1e3);

  Totals totals;
  for (std::int64_t step = 0; step < o.steps; ++step) {
    std::unique_ptr<Shadow> shadow;  // freed at the end of the iteration
    if (backend.engine && step < o.check_steps) {
      t0 = Clock::now();
      shadow = make_shadow(model, state, o);
      shadow->seconds += seconds_since(t0);
    }
    const StepOutcome out = run_step(model, state, calls, o, backend, step, totals, shadow.get());
    if (shadow) {
      t0 = Clock::now();
      const bool same = compare_with_reference(model, state, out, *shadow, o, backend, step);
      shadow->seconds += seconds_since(t0);
      totals.check += shadow->seconds;
      ++totals.checked;
      totals.mismatched += same ? 0 : 1;
    }
    std::fflush(stdout);
  }

  std::printf("checksum   params f32 %016" PRIx64 "  compute bf16 %016" PRIx64,
              hash_f32(model, state.param.data()), hash_bf16(model, state.compute.data()));
  if (o.optimizer == Optimizer::adamw)
    std::printf("  exp_avg %016" PRIx64 "  exp_avg_sq %016" PRIx64,
                hash_f32(model, state.exp_avg.data()), hash_f32(model, state.exp_avg_sq.data()));
  std::printf("  (FNV-1a 64 over bit patterns)\n");
  std::printf("summary    %" PRId64 " steps: %" PRId64 " applied, %" PRId64
              " skipped (found-inf), %" PRId64 " clipped; stepcore phases %.2f s, ",
              o.steps, totals.applied, totals.skipped, totals.clipped, totals.phases);
  if (totals.checked > 0)
    std::printf("bitwise check %.2f s (%" PRId64 " step%s, %s), ", totals.check, totals.checked,
                totals.checked == 1 ? "" : "s",
                totals.mismatched == 0
                    ? "all equal"
                    : (std::to_string(totals.mismatched) + " MISMATCHED").c_str());
  std::printf("total %.2f s\n", seconds_since(start));
  bool managers_agree = true;
  if (o.managers) {
    std::fflush(stdout);
    managers_agree = run_managers_phase(o, backend);
  }
  if (!managers_agree) {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "stepcore-demo: the gradient managers' modes differ (see the bitwise: "
                 "lines)\n");
    return kExitRuntime;
  }
  if (totals.mismatched > 0) {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "stepcore-demo: the cpu engine differs from stepcore::reference on %" PRId64
                 " checked step%s (see the bitwise: lines)\n",
                 totals.mismatched, totals.mismatched == 1 ? "" : "s");
    return kExitRuntime;
  }
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_options(argc, argv);
    if (options.help) {
      std::fputs(kUsage, stdout);
      return kExitOk;
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "stepcore-demo: %s\n(try --help)\n", e.what());
    return kExitUsage;
  }
  // The backend: an unknown one, or an engine configuration the engine rejects (an
  // ISA this processor lacks, a bad STEPCORE_ISA or STEPCORE_THREADS), is bad usage.
  std::optional<Backend> backend;
  try {
    backend.emplace(make_backend(options));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "stepcore-demo: %s\n(try --help)\n", e.what());
    return kExitUsage;
  } catch (const StrictNumaError& e) {
    std::fprintf(stderr, "stepcore-demo: --strict-numa: %s\n", e.what());
    return kExitUsage;
  } catch (const sc::Error& e) {
    std::fprintf(stderr, "stepcore-demo: cannot configure the cpu engine: %s\n", e.what());
    return kExitUsage;
  }
  try {
    return run(options, *backend);
  } catch (const StrictNumaError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "stepcore-demo: --strict-numa: %s\n", e.what());
    return kExitUsage;
  } catch (const sc::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "stepcore-demo: %s\n", e.what());
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "stepcore-demo: out of memory allocating the training state\n");
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "stepcore-demo: error: %s\n", e.what());
  }
  return kExitRuntime;
}
