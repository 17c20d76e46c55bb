// NUMA-aware placement for the CPU half of the offload step: which cores and which
// memory node a rank should use, given the GPU it drives (hwloc topology, live or from
// an XML file), and the helpers that bind threads and place optimizer state there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace stepcore::numa {

/// One physical core: the OS indexes of its hardware threads (PUs), lowest first.
struct Core {
  std::vector<int> pus;
};

/// One NUMA node and the cores local to it.
struct Node {
  int os_index = -1;
  std::vector<Core> cores;
  std::uint64_t local_memory_bytes = 0;
};

/// One GPU (a PCI device of NVIDIA's vendor id with a display/3D class).
struct Gpu {
  std::string pci_bus_id;       ///< "dddd:bb:dd.f", lower case
  std::vector<int> numa_nodes;  ///< os indexes of the nodes local to it; empty: unknown
};

/// Where one rank's CPU work should run.
struct Placement {
  int local_rank = 0;
  int local_world_size = 1;
  std::string pci_bus_id;       ///< the rank's GPU ("" when not known)
  int numa_node = -1;           ///< memory node for the rank's state; -1: unbound
  std::vector<int> cpus;        ///< one PU per core of the rank's share, in core order
  bool bound = false;           ///< false: run unbound (see reason)
  bool oversubscribed = false;  ///< more ranks share the node than it has cores
  std::string reason;           ///< why unbound or oversubscribed ("" when fully placed)
  /// Returns the number of worker threads: one per core of the share (1 when unbound
  /// and nothing else is known: callers then use the engine's default).
  int threads() const noexcept { return cpus.empty() ? 0 : static_cast<int>(cpus.size()); }
};

/// Options of the placement.
struct PlacementOptions {
  /// Throw Errc::not_supported instead of falling back to an unbound placement when
  /// the topology is unknown or the GPU has no NUMA node.
  bool strict = false;
};

/// A machine topology loaded with hwloc, with its PCI devices.
class Topology {
 public:
  /// Loads the live machine's topology.
  static Topology live();
  /// Loads a topology saved by hwloc as XML (`lstopo --of xml`); throws
  /// Errc::invalid_argument naming "xml_path" when it cannot be read.
  static Topology from_xml(const std::string& xml_path);

  Topology(Topology&&) noexcept;
  Topology& operator=(Topology&&) noexcept;
  ~Topology();

  /// Returns true for the live machine (binding is possible), false for XML.
  bool is_this_system() const noexcept;
  /// Returns the NUMA nodes with their cores, by os index.
  const std::vector<Node>& nodes() const noexcept;
  /// Returns the GPUs in PCI bus order.
  const std::vector<Gpu>& gpus() const noexcept;
  /// Returns the GPU with this bus id (case-insensitive, "bb:dd.f" accepted for domain
  /// 0), or nullptr.
  const Gpu* find_gpu(std::string_view pci_bus_id) const noexcept;

  /// Returns where local rank `local_rank` of `rank_gpus.size()` local ranks runs, rank
  /// i driving the GPU `rank_gpus[i]`. Ranks whose GPUs share a NUMA node split that
  /// node's physical cores evenly and disjointly in local-rank order (the first
  /// `cores % ranks` ranks get one more); more ranks than cores share round-robin and
  /// are flagged oversubscribed. A GPU that is unknown or has no single NUMA node gives
  /// an unbound placement with the reason, warned once on stderr (or throws when
  /// options.strict). Pure function of the topology and arguments.
  Placement place(std::span<const std::string> rank_gpus, int local_rank,
                  PlacementOptions options = {}) const;

  /// Returns the share of NUMA node `node` for the `index`-th of `sharers` ranks placed
  /// on it (the same split as place()); for runs without a GPU, e.g. CPU-only offload
  /// tests on a one-node machine. Throws Errc::out_of_range for an unknown node or index.
  Placement place_on_node(int node, int index, int sharers) const;

  struct Impl;  ///< implementation detail (hwloc state)

 private:
  explicit Topology(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Returns the local rank from the launcher's environment: LOCAL_RANK (torchrun), else
/// OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), else `fallback`.
int local_rank_from_env(int fallback = 0);
/// Returns the local world size: LOCAL_WORLD_SIZE, else OMPI_COMM_WORLD_LOCAL_SIZE,
/// else `fallback`.
int local_world_size_from_env(int fallback = 1);

/// Binds the calling thread to the PU with this OS index; returns false (and leaves
/// the affinity unchanged) when the system refuses.
bool bind_this_thread(int pu);
/// Returns the OS indexes of the PUs in the calling thread's affinity mask.
std::vector<int> this_thread_affinity();

/// Host memory for optimizer state: page-aligned, with transparent huge pages advised
/// for large sizes, optionally bound to a NUMA node. Pages are not touched here: touch
/// them first from the threads that will use them (cpu::Engine::first_touch) so each
/// thread's partition is local to it.
class HostBuffer {
 public:
  HostBuffer() = default;
  /// Allocates `bytes` (rounded up to whole pages); `numa_node` >= 0 binds the range to
  /// that node (falls back to unbound with a warning if the kernel refuses, unless
  /// `strict`). Throws Errc::out_of_range when the allocation fails.
  HostBuffer(std::size_t bytes, int numa_node = -1, bool strict = false);
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  /// Returns the node the buffer was bound to (-1: unbound).
  int numa_node() const noexcept { return node_; }
  /// Returns a view of `count` elements of T at `offset_bytes`, which must keep the
  /// view inside the buffer and aligned for T (throws otherwise).
  template <class T>
  T* at(std::size_t offset_bytes, std::size_t count) const;

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int node_ = -1;
};

/// Returns the NUMA node each page of [data, data + bytes) is on (-errno for pages not
/// yet faulted in or on error), one entry per page. Linux move_pages query.
std::vector<int> page_nodes(const void* data, std::size_t bytes);

/// Returns "0-3,8,10-11" for a sorted list of CPU indexes ("-" when empty).
std::string cpu_list_string(const std::vector<int>& cpus);

}  // namespace stepcore::numa

// ---- inline definitions -------------------------------------------------------------
#include "stepcore/error.hpp"

namespace stepcore::numa {

template <class T>
T* HostBuffer::at(std::size_t offset_bytes, std::size_t count) const {
  if (offset_bytes % alignof(T) != 0)
    throw Error(Errc::invalid_argument, "offset_bytes", "not aligned for the element type");
  if (offset_bytes > bytes_ || count > (bytes_ - offset_bytes) / sizeof(T))
    throw Error(Errc::out_of_range, "count", "view extends past the end of the buffer");
  return reinterpret_cast<T*>(static_cast<char*>(data_) + offset_bytes);
}

}  // namespace stepcore::numa
