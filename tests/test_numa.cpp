// NUMA placement: rank shares on synthetic hwloc topologies (tests/data/topo), the
// unbound fallback, and — on this machine — real thread binding and page placement.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "stepcore/cpu.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/error.hpp"
#include "stepcore/host_slab.hpp"
#include "stepcore/numa.hpp"

namespace {

using namespace stepcore;

numa::Topology load(const char* name) {
  return numa::Topology::from_xml(std::string(STEPCORE_TEST_DATA_DIR) + "/topo/" + name);
}

std::vector<std::string> gpu_ids(const numa::Topology& t) {
  std::vector<std::string> ids;
  for (const auto& g : t.gpus()) ids.push_back(g.pci_bus_id);
  return ids;
}

std::vector<int> range(int first, int count) {
  std::vector<int> v;
  for (int i = 0; i < count; ++i) v.push_back(first + i);
  return v;
}

/// Checks that the ranks sharing each node got disjoint shares covering its cores.
void expect_disjoint_cover(const numa::Topology& t, const std::vector<std::string>& ranks) {
  std::map<int, std::multiset<int>> used;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    const numa::Placement p = t.place(ranks, r);
    ASSERT_TRUE(p.bound) << p.reason;
    used[p.numa_node].insert(p.cpus.begin(), p.cpus.end());
  }
  for (const auto& [node_index, cpus] : used) {
    const int node = node_index;
    const auto it = std::find_if(t.nodes().begin(), t.nodes().end(),
                                 [&](const numa::Node& n) { return n.os_index == node; });
    ASSERT_NE(it, t.nodes().end());
    std::multiset<int> cores;
    for (const auto& c : it->cores) cores.insert(c.pus.front());
    EXPECT_EQ(cpus, cores) << "node " << node << ": shares must be disjoint and cover every core";
  }
}

TEST(NumaTopology, TwoSocketsEightGpus) {
  const numa::Topology t = load("dgx_2socket_8gpu.xml");
  EXPECT_FALSE(t.is_this_system());
  ASSERT_EQ(t.nodes().size(), 2u);
  EXPECT_EQ(t.nodes()[0].cores.size(), 16u);
  EXPECT_EQ(t.nodes()[0].cores[0].pus, (std::vector<int>{0, 32}));  // SMT siblings
  ASSERT_EQ(t.gpus().size(), 8u);
  const auto ids = gpu_ids(t);
  for (int r = 0; r < 8; ++r) {
    const numa::Placement p = t.place(ids, r);
    EXPECT_TRUE(p.bound);
    EXPECT_FALSE(p.oversubscribed);
    EXPECT_EQ(p.numa_node, r / 4) << "rank " << r;
    // Four ranks per socket split its 16 physical cores: 4 each, one PU per core.
    EXPECT_EQ(p.cpus, range(16 * (r / 4) + 4 * (r % 4), 4)) << "rank " << r;
    EXPECT_EQ(p.threads(), 4);
  }
  expect_disjoint_cover(t, ids);
}

TEST(NumaTopology, UnevenSplitGivesTheFirstRanksOneMore) {
  const numa::Topology t = load("dgx_2socket_8gpu.xml");
  const auto all = gpu_ids(t);
  const std::vector<std::string> three = {all[0], all[1], all[2]};  // all on node 0
  EXPECT_EQ(t.place(three, 0).cpus, range(0, 6));
  EXPECT_EQ(t.place(three, 1).cpus, range(6, 5));
  EXPECT_EQ(t.place(three, 2).cpus, range(11, 5));
  expect_disjoint_cover(t, three);
}

TEST(NumaTopology, OneSocket) {
  const numa::Topology t = load("one_socket_4gpu.xml");
  ASSERT_EQ(t.nodes().size(), 1u);
  const auto ids = gpu_ids(t);
  ASSERT_EQ(ids.size(), 4u);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(t.place(ids, r).cpus, range(2 * r, 2));
  expect_disjoint_cover(t, ids);
}

TEST(NumaTopology, SubNumaClusteringFourNodes) {
  const numa::Topology t = load("snc_2socket_4numa_8gpu.xml");
  ASSERT_EQ(t.nodes().size(), 4u);
  const auto ids = gpu_ids(t);
  ASSERT_EQ(ids.size(), 8u);
  for (int r = 0; r < 8; ++r) {
    const numa::Placement p = t.place(ids, r);
    EXPECT_EQ(p.numa_node, r / 2) << "rank " << r;
    EXPECT_EQ(p.cpus, range(8 * (r / 2) + 4 * (r % 2), 4)) << "rank " << r;
  }
  expect_disjoint_cover(t, ids);
}

TEST(NumaTopology, GpuWithoutNumaNodeRunsUnboundOrFailsWhenStrict) {
  const numa::Topology t = load("gpu_without_numa.xml");
  ASSERT_EQ(t.gpus().size(), 2u);
  EXPECT_TRUE(t.gpus()[0].numa_nodes.empty());
  const auto ids = gpu_ids(t);
  const numa::Placement p = t.place(ids, 1);
  EXPECT_FALSE(p.bound);
  EXPECT_EQ(p.numa_node, -1);
  EXPECT_TRUE(p.cpus.empty());
  EXPECT_NE(p.reason.find("no NUMA node"), std::string::npos) << p.reason;
  try {
    t.place(ids, 1, numa::PlacementOptions{true});
    FAIL() << "strict placement accepted a GPU without a NUMA node";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::not_supported);
    EXPECT_EQ(e.argument(), "rank_gpus[1]");
  }
}

TEST(NumaTopology, MoreRanksThanCores) {
  const numa::Topology t = load("tiny_2core_8gpu.xml");
  const auto ids = gpu_ids(t);
  ASSERT_EQ(ids.size(), 8u);
  for (int r = 0; r < 8; ++r) {
    const numa::Placement p = t.place(ids, r);
    EXPECT_TRUE(p.bound);
    EXPECT_TRUE(p.oversubscribed);
    EXPECT_EQ(p.cpus, std::vector<int>{r % 2});
    EXPECT_FALSE(p.reason.empty());
  }
}

TEST(NumaTopology, BusIdsAndBadInput) {
  const numa::Topology t = load("dgx_2socket_8gpu.xml");
  ASSERT_NE(t.find_gpu("0000:19:00.0"), nullptr);
  EXPECT_EQ(t.find_gpu("19:00.0"), t.find_gpu("0000:19:00.0"));
  EXPECT_EQ(t.find_gpu("0000:9B:00.0"), t.find_gpu("0000:9b:00.0"));
  EXPECT_EQ(t.find_gpu("00000000:19:00.0"), t.find_gpu("0000:19:00.0"));  // CUDA's form
  EXPECT_EQ(t.find_gpu("0000:77:00.0"), nullptr);
  const auto ids = gpu_ids(t);
  EXPECT_THROW(t.place({}, 0), Error);
  try {
    t.place(ids, 8);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "local_rank");
  }
  const numa::Placement unknown = t.place(std::vector<std::string>{"0000:77:00.0"}, 0);
  EXPECT_FALSE(unknown.bound);
  try {
    numa::Topology::from_xml("/nonexistent/topology.xml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "xml_path");
  }
}

TEST(NumaTopology, LauncherEnvironment) {
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
  EXPECT_EQ(numa::local_rank_from_env(), 3);
  EXPECT_EQ(numa::local_world_size_from_env(), 4);
  ::setenv("LOCAL_RANK", "1", 1);  // torchrun's wins
  ::setenv("LOCAL_WORLD_SIZE", "8", 1);
  EXPECT_EQ(numa::local_rank_from_env(), 1);
  EXPECT_EQ(numa::local_world_size_from_env(), 8);
  ::setenv("LOCAL_RANK", "x", 1);
  EXPECT_THROW(numa::local_rank_from_env(), Error);
  for (const char* v : {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "OMPI_COMM_WORLD_LOCAL_SIZE"})
    ::unsetenv(v);
  EXPECT_EQ(numa::local_rank_from_env(7), 7);
}

// ---- this machine: real binding and placement ----------------------------------------
TEST(NumaLive, EngineWorkersAreBoundAndTheCallerRestored) {
  const std::vector<int> mine = numa::this_thread_affinity();
  ASSERT_FALSE(mine.empty());
  // Two workers on the first two CPUs we may use (the same one twice on a 1-CPU mask).
  const std::vector<int> cpus = {mine.front(), mine.back()};
  const cpu::Engine eng(cpu::EngineConfig{std::nullopt, 0, cpus});
  EXPECT_EQ(eng.threads(), 2);
  std::vector<float> a(1 << 18, 1.0f), b(1 << 18, 2.0f);
  const std::vector<AccumulatePair> pairs{
      {{a.data(), a.size(), DType::f32}, {b.data(), b.size(), DType::f32}, false}};
  std::vector<std::vector<int>> seen(2);
  // The engine's region binds its pool threads; the next region with the same pool
  // sees the masks they kept (worker 0 is the caller, whose mask comes back).
  eng.accumulate(pairs);
#pragma omp parallel num_threads(2)
  { seen[static_cast<std::size_t>(omp_get_thread_num())] = numa::this_thread_affinity(); }
  EXPECT_EQ(numa::this_thread_affinity(), mine) << "the caller's affinity is restored";
  if (omp_get_max_threads() >= 2 && !seen[1].empty()) EXPECT_EQ(seen[1], std::vector<int>{cpus[1]});
  EXPECT_EQ(a[12345], 3.0f);
}

TEST(NumaLive, StateIsFirstTouchedOnTheRanksNode) {
  const numa::Topology t = numa::Topology::live();
  ASSERT_FALSE(t.nodes().empty());
  EXPECT_TRUE(t.is_this_system());
  const int node = t.nodes().front().os_index;
  numa::HostBuffer buf(std::size_t{8} << 20, node);
  EXPECT_EQ(buf.numa_node(), node);
  for (int s : numa::page_nodes(buf.data(), buf.bytes()))
    EXPECT_LT(s, 0) << "no page may be placed before first touch";
  float* f = buf.at<float>(0, buf.bytes() / 4);
  const std::vector<TensorView> views{{f, buf.bytes() / 8, DType::f32},
                                      {f + buf.bytes() / 8, buf.bytes() / 8, DType::f32}};
  cpu::Engine(cpu::EngineConfig{std::nullopt, 2}).first_touch(views);
  const auto nodes = numa::page_nodes(buf.data(), buf.bytes());
  ASSERT_FALSE(nodes.empty());
  for (int s : nodes) ASSERT_EQ(s, node);
  EXPECT_EQ(f[123], 0.0f);
  EXPECT_THROW(buf.at<float>(2, 1), Error);                    // misaligned
  EXPECT_THROW(buf.at<float>(0, buf.bytes() / 4 + 1), Error);  // past the end
}

TEST(HostSlab, LayoutIsAlignedDisjointAndInOrder) {
  const std::vector<std::size_t> sizes = {1, 0, 255, 256, 257, 4096, 3};
  const SlabLayout l = layout_slab(sizes);
  ASSERT_EQ(l.offsets.size(), sizes.size());
  std::size_t end = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(l.offsets[i] % kSlabViewAlignment, 0u) << i;
    EXPECT_GE(l.offsets[i], end) << "views must not overlap";
    end = l.offsets[i] + sizes[i];
  }
  EXPECT_EQ(l.total_bytes, end);
  EXPECT_EQ(l.offsets, (std::vector<std::size_t>{0, 256, 256, 512, 768, 1280, 5376}));
  EXPECT_THROW(layout_slab(sizes, 100), Error);
}

TEST(HostSlab, PlacedOnTheNodeAndPinnedOnlyWithADevice) {
  const numa::Topology t = numa::Topology::live();
  const int node = t.nodes().front().os_index;
  const std::vector<std::size_t> sizes = {std::size_t{3} << 20, 1000, std::size_t{1} << 20};
  HostSlab slab(sizes, node, PinMode::never);
  EXPECT_FALSE(slab.pinned());
  for (std::size_t i = 0; i < slab.views(); ++i) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(slab.view(i)) % kSlabViewAlignment, 0u);
    std::memset(slab.view(i), 0x5A, slab.view_bytes(i));
  }
  for (int s : numa::page_nodes(slab.buffer().data(), slab.buffer().bytes())) ASSERT_EQ(s, node);
  EXPECT_THROW(slab.view(3), Error);
  HostSlab maybe(sizes, node, PinMode::if_available);
  EXPECT_EQ(maybe.pinned(), cuda::device_count() > 0);
  if (cuda::device_count() == 0) {
    try {
      HostSlab must(sizes, node, PinMode::required);
      FAIL() << "required pinning without a device";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::not_supported);
    }
  }
}

}  // namespace
