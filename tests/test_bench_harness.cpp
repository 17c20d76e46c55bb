// The GPU benchmark's body run on the host device at a small size: every kernel must
// validate against the reference and every timing phase must run, so a harness bug
// (such as a workspace sized for one tensor list and used for another) is found here,
// not on a scarce GPU machine.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>

#include "bench/gpu_harness.hpp"
#include "stepcore/device.hpp"
#include "stepcore/gpu.hpp"

namespace {

using namespace stepcore;

TEST(GpuBenchHarness, ValidatesAndTimesEveryKernelOnTheHostDevice) {
  const auto dev = device::make_host_device(32);
  int batches = 0;
  const bench::BestMs wall = [&](const std::function<void()>& fn, int reps, int batch) {
    double best = 1e30;
    ++batches;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < batch; ++k) fn();
      dev->synchronize();
      best = std::min(
          best,
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
              batch);
    }
    return best;
  };
  bench::GpuBenchOptions o;
  o.total_elements = 1;  // the model list's minimum: its embedding and one layer
  o.small_tensors = 2000;
  o.reps = 1;
  o.batch = 2;
  const bench::GpuBenchResult r = bench::run_gpu_bench(*dev, wall, o);
  ASSERT_EQ(r.failure, "");
  // The small-tensor list needs more blocks than the model list: one workspace must cover
  // both (the run used to throw here).
  EXPECT_GT(o.small_tensors, r.blocks);
  // norm, scale+norm, accumulate, then one row per optimizer of the table, in its order.
  const auto table = optimizer_table();
  ASSERT_EQ(r.rows.size(), 3u + table.size());
  for (std::size_t u = 0; u < table.size(); ++u) {
    const bench::GpuBenchRow& row = r.rows[3 + u];
    EXPECT_TRUE(row.optimizer) << row.name;
    EXPECT_EQ(row.name.rfind(std::string(table[u].name) + " ", 0), 0u) << row.name;
  }
  EXPECT_FALSE(r.rows[0].optimizer);
  EXPECT_GT(r.probe_ms, 0.0);
  EXPECT_EQ(batches, static_cast<int>(1 + r.rows.size()))
      << "the probe and every row, timed through best_ms";
  for (const bench::GpuBenchRow& row : r.rows) {
    EXPECT_GT(row.ms, 0.0) << row.name;
    EXPECT_GT(row.bytes, 0.0) << row.name;
    EXPECT_GT(row.host_us, 0.0) << row.name;
  }
}

}  // namespace
