// The CPU engine: SIMD (run-time ISA dispatch) + OpenMP multi-tensor kernels for
// the full-offload step. Same results as stepcore::reference, bit for bit, on every
// ISA and thread count (docs/numerics.md).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stepcore/determinism.hpp"  // the levels named in "Determinism:" lines
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::cpu {

/// An instruction set the engine has a compiled kernel body for. A build has the kernels
/// of its target's ISAs: x86-64 builds sse2, avx2 and avx512, aarch64 builds neon.
enum class Isa : std::uint8_t {
  sse2 = 0,    ///< x86-64 baseline (FMA emulated exactly in double)
  avx2 = 1,    ///< AVX2 + FMA3
  avx512 = 2,  ///< AVX-512 F/BW/DQ
  neon = 3,    ///< AArch64 Advanced SIMD (NEON, 128-bit), the aarch64 baseline
};

/// How many Isa enumerators there are.
inline constexpr int kIsaCount = 4;

/// Returns "sse2", "avx2", "avx512" or "neon".
std::string_view isa_name(Isa isa) noexcept;

/// Returns the ISA named `name` ("sse2", "avx2", "avx512", "neon"); throws
/// Errc::invalid_argument naming `argument` for anything else.
Isa parse_isa(std::string_view name, const char* argument = "isa");

/// Returns every ISA this processor can run, lowest first.
std::vector<Isa> supported_isas();

/// Returns the best ISA this processor can run.
Isa best_isa();

/// The outcome of one ISA's known-answer self-test (docs/numerics.md section 13):
/// every kernel of the ISA run on a small built-in adversarial input and compared
/// with stepcore::reference bit for bit.
struct SelfTestResult {
  Isa isa = Isa::sse2;
  bool passed = false;
  std::string
      kernel;  ///< the first kernel that differed, e.g. "adamw (torch, grad bf16, output f16)"
  std::string detail;  ///< where: the case, the element, the reference's and the kernel's bits
  double seconds = 0;  ///< how long the self-test took (wall clock, on first use)
};

/// Returns the self-test result of `isa`, running the self-test on first use in this
/// process (thread-safe; later calls return the recorded result). Throws
/// Errc::not_supported when this processor cannot run `isa`.
SelfTestResult self_test(Isa isa);

/// Engine settings. Unset fields come from the environment, then the machine:
/// isa from STEPCORE_ISA, else the best ISA whose self-test passes; threads from STEPCORE_THREADS,
/// else the number of CPUs in this process's affinity mask (never OMP_NUM_THREADS, which launchers
/// set to 1).
struct EngineConfig {
  std::optional<Isa> isa;
  int threads = 0;  ///< 0: from STEPCORE_THREADS or the affinity mask (or cpus.size())
  /// When non-empty, worker k of every call is bound to the PU cpus[k % size] (e.g.
  /// numa::Placement::cpus); threads defaults to cpus.size(). The calling thread is
  /// worker 0 during a call and gets its own affinity back afterwards.
  std::vector<int> cpus;
};

/// How a norm partial is computed (stepcore::NormMode, norm.hpp).
using NormMode = ::stepcore::NormMode;

/// A configured CPU engine. Cheap to create (the first engine of each ISA in a process
/// also runs that ISA's self-test, a few milliseconds); thread-safe for concurrent calls on
/// disjoint buffers (each call opens its own OpenMP parallel region).
///
/// Every call validates all arguments first (stepcore::Error, nothing written),
/// then runs one parallel region over all tensors with a static partition into
/// chunks of kWorkChunkElements, so the memory each thread touches does not depend
/// on timing. Determinism: bitwise for every result, for every ISA and thread count
/// (the norm because its partial is exact); approximate partials are run_to_run.
class Engine {
 public:
  /// Elements per work chunk (a multiple of every vector width and cache line).
  static constexpr std::size_t kWorkChunkElements = std::size_t{1} << 15;

  /// Throws Errc::not_supported when the requested ISA (config.isa or STEPCORE_ISA)
  /// is not available here or fails its self-test (the message names the kernel),
  /// Errc::invalid_argument for a bad thread count or environment value. An ISA the
  /// engine chooses itself that fails its self-test is skipped for the best lower one
  /// that passes, with one warning per process on stderr naming the ISA and kernel.
  explicit Engine(EngineConfig config = {});

  /// Returns the ISA in use.
  Isa isa() const noexcept { return isa_; }
  /// Returns its name ("avx2", ...).
  std::string_view isa_name() const noexcept { return cpu::isa_name(isa_); }
  /// Returns the self-test result of the ISA in use (always passed).
  const SelfTestResult& self_test() const noexcept { return self_test_; }
  /// Returns the results of the higher ISAs this engine skipped because their
  /// self-test failed (empty unless a fallback happened; never for an ISA asked for).
  const std::vector<SelfTestResult>& rejected_isas() const noexcept { return rejected_; }
  /// Returns the number of threads each call uses.
  int threads() const noexcept { return threads_; }
  /// Returns the PUs workers are bound to (empty: unbound).
  const std::vector<int>& cpus() const noexcept { return cpus_; }

  /// Writes zeros to every tensor in the same static partition the kernels use for a
  /// list of tensors of these sizes, so that each page is first touched — and placed
  /// on its NUMA node — by the worker thread that will later read and write it.
  void first_touch(std::span<const TensorView> tensors) const;

  /// One step of the optimizer `config` configures (AdamWConfig, SignSgdConfig, ...: the
  /// library defines it for each optimizer it has; docs/numerics.md defines each) over
  /// tensors holding its state in its slot order (e.g. AdamW: state[0] exp_avg, state[1]
  /// exp_avg_sq, a step counter each; SignSGD: the param alone). Everything is validated
  /// before anything is written; found_inf (host, != 0) skips the step, counters kept.
  /// Determinism: bitwise; equals the reference's step for the same optimizer
  /// (reference::adamw_step, reference::sign_sgd_step, ...).
  template <class Config>
  void step(std::span<const OptimizerTensor> tensors, const Config& config, GradientRead read = {},
            const std::int32_t* found_inf = nullptr) const;
  /// acc = acc + f32(src) (or copy) for every pair.
  void accumulate(std::span<const AccumulatePair> pairs) const;
  /// g = R_T(f32(g) * scale) in place.
  void scale_(std::span<const TensorView> tensors, float scale) const;
  /// Returns the fast (approximate) norm partial of the read values: S within
  /// 2^-40 relative of exact, combined exactly across chunks (docs/numerics.md 6.2).
  /// Not bitwise comparable across ISAs; its finalized norm is, when certified.
  NormPartial norm_partial(std::span<const ConstTensorView> tensors, GradientRead read = {}) const;
  /// Returns the norm partial of the given order in the given mode (finalize it with the
  /// same order); NormMode::exact equals reference::norm_partial digit for digit.
  NormPartial norm_partial(std::span<const ConstTensorView> tensors, GradientRead read,
                           NormMode mode, NormOrder order = NormOrder::two) const;
  /// Returns the finalized norm of the given order of the read values in one process: the
  /// fast partial, and the exact one only when the fast one cannot be certified.
  /// Determinism: bitwise: equals finalize(reference::norm_partial(..., order), order).
  NormResult norm(std::span<const ConstTensorView> tensors, GradientRead read = {},
                  NormOrder order = NormOrder::two) const;
  /// Returns the p-norm of the read values for any order p but NaN (docs/numerics.md 6.6:
  /// 2 and 1 exact and correctly rounded as norm(); +-inf and 0 exact; other p from an
  /// exact sum of binary64 powers, faithfully rounded). Throws Errc::invalid_argument
  /// naming 'p' for a NaN p. Determinism: bitwise: equals reference::p_norm for every ISA
  /// and thread count.
  NormResult p_norm(std::span<const ConstTensorView> tensors, double p,
                    GradientRead read = {}) const;

 private:
  template <class Opt>
  void run_unit(std::span<const OptimizerTensor> tensors, const typename Opt::Config& config,
                GradientRead read) const;

  Isa isa_ = Isa::sse2;
  int threads_ = 0;
  std::vector<int> cpus_;
  SelfTestResult self_test_;
  std::vector<SelfTestResult> rejected_;
};

}  // namespace stepcore::cpu
