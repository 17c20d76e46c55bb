// The determinism levels every function's contract names ("Determinism: bitwise."),
// defined once here and in docs/numerics.md section 10.
#pragma once

#include <cstdint>

namespace stepcore {

/// How far a result is reproducible.
enum class Determinism : std::uint8_t {
  /// Equal to the scalar reference (docs/numerics.md) bit for bit on every run, for
  /// every ISA, thread count, launch shape, device (CPU or GPU), rank count, sharding
  /// and collective algorithm; +0 and -0 and NaN payloads included.
  bitwise,
  /// The same bits on every run of the same implementation with the same launch shape
  /// and input, not across implementations or shapes (an approximate norm partial: only
  /// its finalised norm is bitwise).
  run_to_run,
  /// May differ between runs (a transport's floating-point sum order: the baseline
  /// collectives the norm does not use).
  not_guaranteed,
};

}  // namespace stepcore
