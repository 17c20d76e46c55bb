// stepcore-demo, the main job: a few training steps "after backward" of a synthetic
// model with a real LLM's tensor layout -- accumulate micro-batch gradients, apply
// the 1/tokens scale lazily, exact global norm, clip, AdamW or SignSGD -- with
// per-phase timings and a bitwise checksum of the result. Runs on the CPU engine
// (stepcore::cpu::Engine) by default, cross-checked bit for bit against
// stepcore::reference on the first step(s); --backend reference runs the oracle alone.
//
// This file wires the run: options -> backend -> model and state -> steps (each
// optionally cross-checked) -> checksums -> the managers phase; the concerns live in
// apps/demo/ (options, placement, backends, memory, model, synthetic, state, step,
// cross_check, report, managers_phase).
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <optional>

#include "backends.hpp"
#include "cross_check.hpp"
#include "managers_phase.hpp"
#include "options.hpp"
#include "placement.hpp"
#include "report.hpp"
#include "state.hpp"
#include "step.hpp"
#include "stepcore/error.hpp"

namespace stepcore_demo {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;

/// Runs the main phase and then the managers phase on `backend`; returns the exit code
/// (1 when the engine and the reference, or the managers' modes, differ). Throws
/// stepcore::Error, StrictNumaError or std::bad_alloc on failure.
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

  print_checksums(model, state, o);
  print_summary(o, totals, seconds_since(start));
  bool managers_agree = true;
  if (o.managers) {
    std::fflush(stdout);
    managers_agree = run_managers_phase(managers_options(o, backend));
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
}  // namespace stepcore_demo

int main(int argc, char** argv) {
  namespace demo = stepcore_demo;
  using demo::kExitOk, demo::kExitRuntime, demo::kExitUsage;
  demo::Options options;
  try {
    options = demo::parse_options(argc, argv);
    if (options.help) {
      std::fputs(demo::usage_text(), stdout);
      return kExitOk;
    }
  } catch (const demo::UsageError& e) {
    std::fprintf(stderr, "stepcore-demo: %s\n(try --help)\n", e.what());
    return kExitUsage;
  }
  // The backend: an unknown one, or an engine configuration the engine rejects (an
  // ISA this processor lacks, a bad STEPCORE_ISA or STEPCORE_THREADS), is bad usage.
  std::optional<demo::Backend> backend;
  try {
    backend.emplace(demo::make_backend(options));
  } catch (const demo::UsageError& e) {
    std::fprintf(stderr, "stepcore-demo: %s\n(try --help)\n", e.what());
    return kExitUsage;
  } catch (const demo::StrictNumaError& e) {
    std::fprintf(stderr, "stepcore-demo: --strict-numa: %s\n", e.what());
    return kExitUsage;
  } catch (const stepcore::Error& e) {
    std::fprintf(stderr, "stepcore-demo: cannot configure the cpu engine: %s\n", e.what());
    return kExitUsage;
  }
  try {
    return demo::run(options, *backend);
  } catch (const demo::StrictNumaError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "stepcore-demo: --strict-numa: %s\n", e.what());
    return kExitUsage;
  } catch (const stepcore::Error& e) {
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
