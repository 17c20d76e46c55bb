// stepcore-demo's training step: generate and accumulate the micro-batches, the exact
// global norm, clip and the optimizer, timed phase by phase -- and, on a checked step,
// the same calls with stepcore::reference on the shadow copy.
#pragma once

#include <cstdint>

#include "backends.hpp"
#include "cross_check.hpp"
#include "options.hpp"
#include "report.hpp"
#include "state.hpp"

namespace stepcore_demo {

/// Runs training step `step` (0-based): generate and accumulate the micro-batches,
/// norm, clip, optimizer. Prints one line per phase; updates `totals`. With a
/// shadow, also runs every stepcore call of the step with stepcore::reference on
/// the shadow's copy (untimed; its seconds go to shadow->seconds).
StepOutcome run_step(const Model& m, State& s, const Calls& c, const Options& o, const Backend& b,
                     std::int64_t step, Totals& totals, Shadow* shadow);

}  // namespace stepcore_demo
