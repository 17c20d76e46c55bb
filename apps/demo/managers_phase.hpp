// stepcore-demo's managers phase: the same synthetic model and gradient stream driven
// through the gradient managers of the three offload modes (none, optimizer, full) via
// make_gradient_manager, with a 64-bit FNV-1a hash of every parameter's master weights,
// moments and compute weights after every step, so the modes can be compared bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends.hpp"
#include "model.hpp"
#include "options.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore_demo {

/// What the managers phase runs.
struct ManagersOptions {
  std::vector<TensorSpec> layout;
  bool tied = true;
  std::uint64_t seed = 1;
  std::int64_t steps = 3;
  std::int64_t micro_batches = 4;
  double max_norm = 1.0;  ///< 0: no clipping
  sc::DType grad_dtype = sc::DType::bf16;
  sc::OptimizerConfig optimizer;
  bool q8_state = false;  ///< ManagerConfig::q8_state (adamw8bit), min_8bit_size kMin8bitSize
  sc::cpu::EngineConfig engine;
  std::size_t chunk_elements = std::size_t{16} << 20;
  bool cuda = false;  ///< run on CUDA device 0 instead of the host device
};

/// Returns the managers phase of the options: the demo's model scaled to
/// --managers-layers/--managers-vocab, the same seed, steps, optimizer and gradient
/// stream, the backend's engine ISA and threads, on CUDA device 0 when there is one.
ManagersOptions managers_options(const Options& o, const Backend& backend);

/// Runs the three modes and prints one line per mode and the "bitwise:" verdict;
/// returns true when all agree bit for bit on every step.
bool run_managers_phase(const ManagersOptions& o);

}  // namespace stepcore_demo
