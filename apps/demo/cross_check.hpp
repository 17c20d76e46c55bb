// stepcore-demo's bitwise cross-check: the reference's copy of the state for a checked
// step (the Shadow), and the comparison of every buffer and scalar the engine computed
// with what stepcore::reference computed, bit for bit.
#pragma once

#include <cstdint>
#include <memory>

#include "backends.hpp"
#include "options.hpp"
#include "state.hpp"
#include "stepcore/norm.hpp"

namespace stepcore_demo {

/// The reference's copy of the state for one checked step, and what it computed.
struct Shadow {
  State state;  ///< params, moments, step counters, accumulators, compute weights
  Calls calls;  ///< over `state`, reading the engine state's micro-batch gradients
  sc::NormResult norm;
  float clip = 1.0f;
  bool applied = false;  ///< the reference ran its optimizer step
  double seconds = 0.0;  ///< copy, reference calls and comparison
};

/// The norm, clip and optimizer outcome of one step.
struct StepOutcome {
  sc::NormResult norm;
  float clip = 1.0f;
  bool applied = false;
};

/// Returns a copy of every buffer of `s` that a step reads or writes, except the
/// micro-batch gradients (shared: the reference reads the engine state's).
std::unique_ptr<Shadow> make_shadow(const Model& m, const State& s, const Options& o);

/// Compares the engine's state and outcome with the reference's, bit for bit.
/// Prints the "bitwise:" line; returns true when everything matched.
bool compare_with_reference(const Model& m, const State& s, const StepOutcome& e, const Shadow& sh,
                            const Options& o, const Backend& b, std::int64_t step);

}  // namespace stepcore_demo
