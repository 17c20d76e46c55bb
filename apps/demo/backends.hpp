// stepcore-demo's backends: the one place that names an implementation of a step's
// operations -- the CPU engine (stepcore::cpu::Engine, NUMA-placed) or the scalar
// reference (stepcore::reference, the oracle).
#pragma once

#include <optional>
#include <span>
#include <string>

#include "options.hpp"
#include "placement.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore_demo {

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

  /// Copies or adds each pair's gradients into its f32 accumulator.
  void accumulate(std::span<const sc::AccumulatePair> pairs) const;
  /// Returns the finalized global norm of the read values (never needs_exact: the
  /// engine recomputes an uncertifiable fast partial exactly).
  sc::NormResult norm(std::span<const sc::ConstTensorView> tensors, sc::GradientRead read) const;
  /// Runs one step of the optimizer `config` holds over `tensors` (its state in its slot
  /// order; no found-inf flag: the caller checked the norm).
  void step(std::span<const sc::OptimizerTensor> tensors, const sc::OptimizerConfig& config,
            sc::GradientRead read) const;
};

/// Returns the backend of the options. Throws UsageError for an unknown backend or
/// engine options given to the reference, StrictNumaError for --strict-numa without a
/// placement, and the engine's stepcore::Error for a configuration it rejects (an ISA
/// this processor lacks, a bad STEPCORE_* or LOCAL_* value).
Backend make_backend(const Options& o);

}  // namespace stepcore_demo
