// stepcore-demo's backends: the step operations dispatched to the CPU engine or the
// reference, and make_backend, which places and configures the engine (or refuses
// engine options given to the reference) and describes the result for the header.
#include "backends.hpp"

#include <cstdio>
#include <variant>

#include "report.hpp"
#include "stepcore/numa.hpp"
#include "stepcore/reference.hpp"

namespace stepcore_demo {

void Backend::accumulate(std::span<const sc::AccumulatePair> pairs) const {
  if (engine)
    engine->accumulate(pairs);
  else
    sc::reference::accumulate(pairs);
}

sc::NormResult Backend::norm(std::span<const sc::ConstTensorView> tensors,
                             sc::GradientRead read) const {
  return engine ? engine->norm(tensors, read)
                : sc::finalize(sc::reference::norm_partial(tensors, read));
}

void Backend::step(std::span<const sc::OptimizerTensor> tensors, const sc::OptimizerConfig& config,
                   sc::GradientRead read) const {
  if (engine)
    std::visit([&](const auto& c) { engine->step(tensors, c, read, nullptr); }, config);
  else
    sc::reference::optimizer_step(tensors, config, read, nullptr);
}

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
        warn_once("NUMA placement: " + nc.reason +
                  "; running unbound (threads float, state pre-faulted by the "
                  "allocating thread)");
    }
    if (nc.oversubscribed && !nc.warned) warn_once("NUMA placement: " + nc.reason);
    if (nc.bound) {
      if (!restrict_main_thread(nc.share))
        warn_once("cannot restrict the main thread to cpus " + cpu_list(nc.share) +
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

}  // namespace stepcore_demo
