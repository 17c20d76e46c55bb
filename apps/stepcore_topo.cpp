// stepcore-topo: prints the machine's (or an hwloc XML file's) NUMA nodes, GPUs and
// their locality, and for a local world size the cores, threads and memory node each
// rank would get. Usage: stepcore-topo [--xml FILE] [--local-world-size N] [--strict]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "stepcore/error.hpp"
#include "stepcore/numa.hpp"

namespace {

std::string join(const std::vector<int>& v) { return stepcore::numa::cpu_list_string(v); }

int usage(const char* msg) {
  if (msg) std::fprintf(stderr, "stepcore-topo: %s\n", msg);
  std::fprintf(stderr, "usage: stepcore-topo [--xml FILE] [--local-world-size N] [--strict]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string xml;
  int lws = -1;
  bool strict = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--xml" && i + 1 < argc) {
      xml = argv[++i];
    } else if (a == "--local-world-size" && i + 1 < argc) {
      char* end = nullptr;
      const long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v < 1 || v > 4096)
        return usage("--local-world-size must be in [1, 4096]");
      lws = static_cast<int>(v);
    } else if (a == "--strict") {
      strict = true;
    } else if (a == "--help" || a == "-h") {
      usage(nullptr);
      return 0;
    } else {
      return usage(("unknown argument '" + a + "'").c_str());
    }
  }
  try {
    const stepcore::numa::Topology topo =
        xml.empty() ? stepcore::numa::Topology::live() : stepcore::numa::Topology::from_xml(xml);
    std::printf("topology  %s\n", xml.empty() ? "this machine" : xml.c_str());
    for (const auto& n : topo.nodes()) {
      std::vector<int> pus;
      for (const auto& c : n.cores) pus.insert(pus.end(), c.pus.begin(), c.pus.end());
      std::sort(pus.begin(), pus.end());
      std::printf("numa %-3d  %zu cores, cpus %s, %.1f GiB\n", n.os_index, n.cores.size(),
                  join(pus).c_str(),
                  static_cast<double>(n.local_memory_bytes) / (1024.0 * 1024.0 * 1024.0));
    }
    if (topo.gpus().empty()) std::printf("gpus      none found\n");
    for (const auto& g : topo.gpus())
      std::printf("gpu       %s  numa %s\n", g.pci_bus_id.c_str(),
                  g.numa_nodes.empty() ? "unknown" : join(g.numa_nodes).c_str());
    if (lws < 0)
      lws = stepcore::numa::local_world_size_from_env(
          static_cast<int>(std::max<std::size_t>(topo.gpus().size(), 1)));
    // Local rank r drives GPU r (mod the GPU count), CUDA's PCI order.
    std::vector<std::string> rank_gpus;
    for (int r = 0; r < lws; ++r)
      rank_gpus.push_back(
          topo.gpus().empty()
              ? std::string("none")
              : topo.gpus()[static_cast<std::size_t>(r) % topo.gpus().size()].pci_bus_id);
    std::printf("ranks     local world size %d\n", lws);
    for (int r = 0; r < lws; ++r) {
      const auto p = topo.place(rank_gpus, r, stepcore::numa::PlacementOptions{strict});
      std::printf("rank %-3d  gpu %s  ", r, p.pci_bus_id.c_str());
      if (p.bound)
        std::printf("numa %d  threads %d  cpus %s%s%s\n", p.numa_node, p.threads(),
                    join(p.cpus).c_str(), p.oversubscribed ? "  OVERSUBSCRIBED: " : "",
                    p.oversubscribed ? p.reason.c_str() : "");
      else
        std::printf("unbound (%s)\n", p.reason.c_str());
    }
  } catch (const stepcore::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
