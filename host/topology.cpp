// Machine topology with hwloc: NUMA nodes, their cores, GPUs and their NUMA locality,
// and the placement of local ranks onto disjoint shares of their GPU's node.
#include <hwloc.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "host/warn.hpp"
#include "stepcore/error.hpp"
#include "stepcore/numa.hpp"

namespace stepcore::numa {

struct Topology::Impl {
  hwloc_topology_t topo = nullptr;
  bool this_system = false;
  std::vector<Node> nodes;
  std::vector<Gpu> gpus;
  ~Impl() {
    if (topo) hwloc_topology_destroy(topo);
  }
};

namespace {

std::vector<int> os_indexes(hwloc_const_bitmap_t set) {
  std::vector<int> out;
  for (int i = hwloc_bitmap_first(set); i != -1; i = hwloc_bitmap_next(set, i)) out.push_back(i);
  return out;
}

std::string bus_id_of(hwloc_obj_t dev) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%01x", dev->attr->pcidev.domain,
                dev->attr->pcidev.bus, dev->attr->pcidev.dev, dev->attr->pcidev.func);
  return buf;
}

// Lower case, and "bb:dd.f" completed with domain 0000.
std::string normalize_bus_id(std::string_view id) {
  std::string s;
  for (char c : id) s.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (std::count(s.begin(), s.end(), ':') == 1) s = "0000:" + s;
  // CUDA reports 8-digit domains ("00000000:19:00.0"): keep the last four.
  const auto colon = s.find(':');
  if (colon != std::string::npos && colon > 4) s = s.substr(colon - 4);
  return s;
}

void collect(Topology::Impl& t) {
  hwloc_topology_t topo = t.topo;
  const int n_nodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < n_nodes; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    Node nd;
    nd.os_index = static_cast<int>(node->os_index);
    nd.local_memory_bytes = node->attr ? node->attr->numanode.local_memory : 0;
    hwloc_obj_t core = nullptr;
    while (
        (core = hwloc_get_next_obj_inside_cpuset_by_type(topo, node->cpuset, HWLOC_OBJ_CORE, core)))
      nd.cores.push_back(Core{os_indexes(core->cpuset)});
    if (nd.cores.empty()) {  // no Core objects (some VMs): every PU is a core
      for (int pu : os_indexes(node->cpuset)) nd.cores.push_back(Core{{pu}});
    }
    t.nodes.push_back(std::move(nd));
  }
  std::sort(t.nodes.begin(), t.nodes.end(),
            [](const Node& a, const Node& b) { return a.os_index < b.os_index; });

  hwloc_obj_t dev = nullptr;
  while ((dev = hwloc_get_next_pcidev(topo, dev))) {
    const unsigned klass = dev->attr->pcidev.class_id >> 8;  // 0x03: display controllers
    if (dev->attr->pcidev.vendor_id != 0x10de || klass != 0x03) continue;
    Gpu g;
    g.pci_bus_id = bus_id_of(dev);
    hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(topo, dev);
    hwloc_location loc;
    loc.type = HWLOC_LOCATION_TYPE_OBJECT;
    loc.location.object = anc;
    unsigned nr = static_cast<unsigned>(n_nodes > 0 ? n_nodes : 1);
    std::vector<hwloc_obj_t> local(nr);
    // Nodes whose locality is exactly the GPU's: none when the GPU hangs off the
    // whole machine of a multi-node system.
    if (hwloc_get_local_numanode_objs(topo, &loc, &nr, local.data(), 0) == 0)
      for (unsigned k = 0; k < nr; ++k)
        g.numa_nodes.push_back(static_cast<int>(local[k]->os_index));
    std::sort(g.numa_nodes.begin(), g.numa_nodes.end());
    t.gpus.push_back(std::move(g));
  }
  std::sort(t.gpus.begin(), t.gpus.end(),
            [](const Gpu& a, const Gpu& b) { return a.pci_bus_id < b.pci_bus_id; });
}

std::unique_ptr<Topology::Impl> load(const std::string* xml) {
  auto t = std::make_unique<Topology::Impl>();
  if (hwloc_topology_init(&t->topo) != 0)
    throw Error(Errc::internal, "topology", "hwloc_topology_init failed");
  hwloc_topology_set_io_types_filter(t->topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  // PCI devices come from the pci/linux backends. The GPU-runtime plugins (OpenCL,
  // CUDA, NVML, ROCm, Level Zero, GL) only add OS devices we do not use, and they load
  // vendor runtimes (an OpenCL ICD, say) that are slow and leak at exit.
  for (const char* c : {"opencl", "cuda", "nvml", "rsmi", "levelzero", "gl"})
    hwloc_topology_set_components(t->topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, c);
  if (xml && hwloc_topology_set_xml(t->topo, xml->c_str()) != 0)
    throw Error(Errc::invalid_argument, "xml_path", "hwloc cannot read '" + *xml + "'");
  if (hwloc_topology_load(t->topo) != 0)
    throw Error(
        Errc::invalid_argument, xml ? "xml_path" : "topology",
        xml ? "hwloc cannot load '" + *xml + "'" : "hwloc cannot load this machine's topology");
  t->this_system = hwloc_topology_is_thissystem(t->topo) != 0 && xml == nullptr;
  collect(*t);
  return t;
}

}  // namespace

Topology::Topology(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Topology::Topology(Topology&&) noexcept = default;
Topology& Topology::operator=(Topology&&) noexcept = default;
Topology::~Topology() = default;

Topology Topology::live() { return Topology(load(nullptr)); }
Topology Topology::from_xml(const std::string& xml_path) { return Topology(load(&xml_path)); }

bool Topology::is_this_system() const noexcept { return impl_->this_system; }
const std::vector<Node>& Topology::nodes() const noexcept { return impl_->nodes; }
const std::vector<Gpu>& Topology::gpus() const noexcept { return impl_->gpus; }

const Gpu* Topology::find_gpu(std::string_view pci_bus_id) const noexcept {
  const std::string want = normalize_bus_id(pci_bus_id);
  for (const Gpu& g : impl_->gpus)
    if (g.pci_bus_id == want) return &g;
  return nullptr;
}

Placement Topology::place(std::span<const std::string> rank_gpus, int local_rank,
                          PlacementOptions options) const {
  if (rank_gpus.empty())
    throw Error(Errc::invalid_argument, "rank_gpus", "needs one GPU bus id per local rank");
  if (local_rank < 0 || static_cast<std::size_t>(local_rank) >= rank_gpus.size())
    throw Error(
        Errc::out_of_range, "local_rank",
        std::to_string(local_rank) + " is not in [0, " + std::to_string(rank_gpus.size()) + ")");
  Placement p;
  p.local_rank = local_rank;
  p.local_world_size = static_cast<int>(rank_gpus.size());
  p.pci_bus_id = normalize_bus_id(rank_gpus[static_cast<std::size_t>(local_rank)]);

  auto unbound = [&](const std::string& why) {
    if (options.strict)
      throw Error(Errc::not_supported, "rank_gpus[" + std::to_string(local_rank) + "]", why);
    p.bound = false;
    p.reason = why;
    detail::warn_once(
        why + "; the CPU optimizer runs unbound (set strict placement to make this an error)");
    return p;
  };
  // The node of every rank's GPU (-1: unknown or not a single node).
  auto node_of = [&](const std::string& id) {
    const Gpu* g = find_gpu(id);
    return g && g->numa_nodes.size() == 1 ? g->numa_nodes.front() : -1;
  };
  const Gpu* mine = find_gpu(p.pci_bus_id);
  if (!mine) return unbound("GPU " + p.pci_bus_id + " is not in the topology");
  if (mine->numa_nodes.empty()) return unbound("GPU " + p.pci_bus_id + " reports no NUMA node");
  if (mine->numa_nodes.size() > 1)
    return unbound("GPU " + p.pci_bus_id + " is local to " +
                   std::to_string(mine->numa_nodes.size()) + " NUMA nodes");
  const int node = mine->numa_nodes.front();
  const auto it = std::find_if(impl_->nodes.begin(), impl_->nodes.end(),
                               [&](const Node& n) { return n.os_index == node; });
  if (it == impl_->nodes.end() || it->cores.empty())
    return unbound("NUMA node " + std::to_string(node) + " has no cores");

  // Ranks sharing this node, in local-rank order; my index among them.
  int sharers = 0, index = 0;
  for (std::size_t r = 0; r < rank_gpus.size(); ++r) {
    if (node_of(rank_gpus[r]) != node) continue;
    if (static_cast<int>(r) == local_rank) index = sharers;
    ++sharers;
  }
  Placement share = place_on_node(node, index, sharers);
  share.local_rank = p.local_rank;
  share.local_world_size = p.local_world_size;
  share.pci_bus_id = p.pci_bus_id;
  return share;
}

Placement Topology::place_on_node(int node, int index, int sharers) const {
  const auto it = std::find_if(impl_->nodes.begin(), impl_->nodes.end(),
                               [&](const Node& n) { return n.os_index == node; });
  if (it == impl_->nodes.end())
    throw Error(Errc::out_of_range, "node", "no NUMA node " + std::to_string(node));
  if (sharers < 1 || index < 0 || index >= sharers)
    throw Error(Errc::out_of_range, "index",
                std::to_string(index) + " is not in [0, " + std::to_string(sharers) + ")");
  Placement p;
  p.local_rank = index;
  p.local_world_size = sharers;
  const int cores = static_cast<int>(it->cores.size());
  if (cores == 0) {
    p.reason = "NUMA node " + std::to_string(node) + " has no cores";
    return p;
  }
  p.numa_node = node;
  p.bound = true;
  if (sharers <= cores) {
    const int base = cores / sharers, extra = cores % sharers;
    const int first = index * base + std::min(index, extra);
    const int count = base + (index < extra ? 1 : 0);
    for (int c = first; c < first + count; ++c)
      p.cpus.push_back(it->cores[static_cast<std::size_t>(c)].pus.front());
  } else {
    p.oversubscribed = true;
    p.cpus.push_back(it->cores[static_cast<std::size_t>(index % cores)].pus.front());
    p.reason = std::to_string(sharers) + " ranks share NUMA node " + std::to_string(node) +
               " with " + std::to_string(cores) + " cores: one core each, shared round-robin";
    detail::warn_once(p.reason);
  }
  return p;
}

namespace {
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > 1 << 20)
    throw Error(Errc::invalid_argument, name,
                std::string("not a non-negative integer: '") + v + "'");
  return static_cast<int>(x);
}
}  // namespace

int local_rank_from_env(int fallback) {
  if (std::getenv("LOCAL_RANK")) return env_int("LOCAL_RANK", fallback);
  return env_int("OMPI_COMM_WORLD_LOCAL_RANK", fallback);
}

int local_world_size_from_env(int fallback) {
  if (std::getenv("LOCAL_WORLD_SIZE")) return env_int("LOCAL_WORLD_SIZE", fallback);
  return env_int("OMPI_COMM_WORLD_LOCAL_SIZE", fallback);
}

}  // namespace stepcore::numa
