// stepcore-demo's NUMA placement: the rank's node and cores from the live topology
// (stepcore::numa::Topology), the worker count within the share, and the main
// thread's affinity.
#include "placement.hpp"

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#if defined(__linux__)
#include <sched.h>
#endif

#include "stepcore/cuda_host.hpp"
#include "stepcore/error.hpp"
#include "stepcore/numa.hpp"

namespace stepcore_demo {

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

std::string cpu_list(const std::vector<int>& v) { return stepcore::numa::cpu_list_string(v); }

NumaChoice choose_numa(const Options& o) {
  NumaChoice c;
  if (o.no_bind) return c;
  c.enabled = true;
  c.local_rank = o.local_rank ? *o.local_rank : sc::numa::local_rank_from_env(0);
  c.local_world_size =
      o.local_world_size ? *o.local_world_size : sc::numa::local_world_size_from_env(1);
  if (c.local_rank >= c.local_world_size)
    throw UsageError("local rank " + std::to_string(c.local_rank) +
                     " is not below the local world size " + std::to_string(c.local_world_size) +
                     " (--local-rank / --local-world-size, or LOCAL_RANK / LOCAL_WORLD_SIZE)");
  const auto unbound = [&](std::string why) {
    c.reason = std::move(why);
    return c;
  };

  const int devices = sc::cuda::device_count();
  std::vector<std::string> rank_gpus;  // empty: no GPU
  if (devices > 0) {
    try {
      for (int r = 0; r < c.local_world_size; ++r)
        rank_gpus.push_back(sc::cuda::pci_bus_id(r % devices));
    } catch (const sc::Error& e) {
      c.gpu = "unknown";
      return unbound(std::string("cannot read the PCI bus id of a CUDA device: ") + e.what());
    }
    c.gpu = rank_gpus[static_cast<std::size_t>(c.local_rank)] + " (CUDA device " +
            std::to_string(c.local_rank % devices) + " of " + std::to_string(devices) + ")";
  } else {
    c.gpu = "none (no CUDA device)";
  }

  std::optional<sc::numa::Topology> topo;
  try {
    topo.emplace(sc::numa::Topology::live());
  } catch (const sc::Error& e) {
    return unbound(std::string("cannot load this machine's topology: ") + e.what());
  }
  sc::numa::Placement p;
  if (!rank_gpus.empty()) {
    try {
      p = topo->place(rank_gpus, c.local_rank, sc::numa::PlacementOptions{o.strict_numa});
    } catch (const sc::Error& e) {
      if (o.strict_numa && e.code() == sc::Errc::not_supported)
        throw StrictNumaError("cannot place local rank " + std::to_string(c.local_rank) +
                              " on one NUMA node: " + e.what());
      throw;
    }
    c.node_why = "the GPU's node";
  } else {
    const std::size_t nodes = topo->nodes().size();
    if (nodes != 1)
      return unbound("no CUDA device to place by, and " +
                     (nodes == 0 ? std::string("the topology has no NUMA node")
                                 : "this machine has " + std::to_string(nodes) +
                                       " NUMA nodes to choose from"));
    p = topo->place_on_node(topo->nodes().front().os_index, c.local_rank, c.local_world_size);
    c.node_why = "CPU-only run, one NUMA node";
  }
  // place() and place_on_node() warn once themselves when they fall back or oversubscribe.
  c.warned = true;
  if (!p.bound || p.cpus.empty())
    return unbound(p.reason.empty() ? "the placement has no cores" : p.reason);

  c.bound = true;
  c.node = p.numa_node;
  c.share = p.cpus;
  c.oversubscribed = p.oversubscribed;
  if (p.oversubscribed) c.reason = p.reason;
  // An explicit worker count takes the first cores of the share; it cannot exceed it.
  int want = 0;
  c.threads_source = "NUMA share";
  if (o.threads != 0) {
    want = o.threads;
    c.threads_source = "--threads";
  } else if (env_set("STEPCORE_THREADS")) {
    want =
        static_cast<int>(parse_int("STEPCORE_THREADS", std::getenv("STEPCORE_THREADS"), 1, 4096));
    c.threads_source = "STEPCORE_THREADS";
  }
  if (want > static_cast<int>(c.share.size()))
    throw UsageError(c.threads_source + " " + std::to_string(want) + " exceeds the " +
                     std::to_string(c.share.size()) + (c.share.size() == 1 ? " core" : " cores") +
                     " of local rank " + std::to_string(c.local_rank) + "'s share of NUMA node " +
                     std::to_string(c.node) + " (cpus " + cpu_list(c.share) +
                     "); use at most that many, or --no-bind");
  c.cpus.assign(c.share.begin(),
                c.share.begin() + (want != 0 ? want : static_cast<int>(c.share.size())));
  return c;
}

bool restrict_main_thread(const std::vector<int>& cpus) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int pu : cpus)
    if (pu >= 0 && pu < CPU_SETSIZE) CPU_SET(pu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
#else
  (void)cpus;
  return false;
#endif
}

}  // namespace stepcore_demo
