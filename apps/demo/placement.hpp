// stepcore-demo's NUMA placement: which node and cores the cpu backend's rank uses
// (from its GPU, or a one-node machine), decided before any state is allocated, and
// the binding of the main thread to that share.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "options.hpp"

namespace stepcore_demo {

/// --strict-numa and the rank cannot be placed (or its state cannot be bound): exit 2.
struct StrictNumaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Returns true when the environment variable `name` is set and not empty.
bool env_set(const char* name);

/// Returns "0-3,8,10-11" for a sorted list of CPU indexes ("-" when empty).
std::string cpu_list(const std::vector<int>& v);

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
NumaChoice choose_numa(const Options& o);

/// Restricts the calling (main) thread to the PUs of `cpus` before any OpenMP team
/// exists, so that the work outside stepcore calls (the synthetic gradients, the
/// reference check) and the pool threads it creates stay on the rank's share too; the
/// engine binds each worker to one PU during its calls. Returns false when refused.
bool restrict_main_thread(const std::vector<int>& cpus);

}  // namespace stepcore_demo
