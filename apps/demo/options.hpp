// stepcore-demo's command line: the options it sets, the usage text, and the
// parser that turns argv into Options or a UsageError (exit code 2).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "stepcore/cpu.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore_demo {

namespace sc = ::stepcore;

/// A bad command line: reported with a hint, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Optimizer { adamw, sign_sgd };

/// The smallest tensor whose moments --optimizer adamw8bit keeps in 8 bits (the peers'
/// min_8bit_size; the managers' ManagerConfig::min_8bit_size).
inline constexpr std::size_t kMin8bitSize = 4096;

/// Everything the command line sets.
struct Options {
  std::string model = "qwen2.5-0.5b";
  std::int64_t layers = 4;     ///< 0: the model's own count
  std::int64_t vocab = 32768;  ///< 0: the model's own size
  std::int64_t steps = 3;
  std::int64_t micro_batches = 4;
  double max_norm = 1.0;  ///< 0: no clipping
  sc::DType grad_dtype = sc::DType::bf16;
  sc::AdamWFormula formula = sc::AdamWFormula::torch;
  /// The torch build the torch formula follows (--torch-build): aarch64's NEON kernel
  /// (true) or x86's AVX2 kernel (false); default: this target's torch.
  bool torch_aarch64 = sc::kTorchVFirst;
  Optimizer optimizer = Optimizer::adamw;
  /// --optimizer adamw8bit: AdamW with block-wise 8-bit moments (docs/numerics.md 8f) for
  /// tensors of at least kMin8bitSize elements, in every phase.
  bool q8 = false;
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

/// Returns the --help text (options, defaults, exit status).
const char* usage_text();

/// Returns the options of the command line; throws UsageError on anything bad.
Options parse_options(int argc, char** argv);

/// Returns `text` as an integer in [lo, hi]; throws UsageError naming `opt`.
std::int64_t parse_int(std::string_view opt, const std::string& text, std::int64_t lo,
                       std::int64_t hi);

/// Sets the torch build an AdamW configuration's torch formula follows: aarch64's NEON
/// kernel (4 wide, v's one form) or x86's AVX2 kernel (8 wide, v's body and tail forms).
inline void set_torch_build(sc::AdamWConfig& c, bool aarch64) {
  c.torch_v_first = aarch64;
  c.torch_tail_width = aarch64 ? 4 : 8;
}

/// The demo's learning-rate schedule: linear warm-up over the first quarter of `steps`
/// (at least one step), then cosine decay to a tenth of `peak` at the last step.
inline double scheduled_lr(double peak, std::int64_t step, std::int64_t steps) {
  const std::int64_t warmup = steps / 4 > 1 ? steps / 4 : 1;
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double t = static_cast<double>(step - warmup) /
                   static_cast<double>(steps - warmup > 1 ? steps - warmup : 1);
  return peak * (0.1 + 0.45 * (1.0 + std::cos(3.141592653589793 * t)));
}

}  // namespace stepcore_demo
