// The gradient managers sharded over MPI processes (label mpi, run by ctest through
// mpirun with 2 and 4 processes): each rank holds an uneven shard of every parameter
// (rank 0's shard of parameter 0 empty) and drives a manager of each mode with the MPI
// communicator; its norms, clip coefficients and state must be the slices of the
// unsharded single-process run, which every rank also computes alone — also under a
// schedule over two groups (against the reference with each shard its own tensor),
// across a checkpoint saved per rank in one mode and loaded in another, and with
// speculated overlapped steps (a NaN on one rank only skips the step on every rank).
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "managers_cases.hpp"
#include "stepcore/comm_mpi.hpp"

namespace {

using namespace managers_cases;
using namespace std::chrono_literals;

std::unique_ptr<comm::Communicator> g_world;

TEST(ManagersMpi, ShardedRanksGiveTheUnshardedBits) {
  const int ranks = g_world->size(), rank = g_world->rank();
  // AdamW native: its update is element-wise; torch's tail form follows each shard's own end.
  constexpr AdamWFormula native = AdamWFormula::native;
  for (const Case& c : {Case{DType::bf16, AdamWConfig{}, 0.05f, Flow::rl, false, native},
                        Case{DType::f32, SignSgdConfig{}, 100.0f, Flow::sft, false},
                        Case{DType::bf16, AdamWConfig{}, {}, Flow::sft, false, native}}) {
    SCOPED_TRACE(c.label());
    const std::vector<StreamParam> model = stream_model(c.grad_dtype);
    const auto whole = run_mode(OffloadMode::none, c);
    const Sharding sh = shard_model(model, ranks);
    const auto r = static_cast<std::size_t>(rank);
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
      SCOPED_TRACE(std::string(offload_mode_name(mode)));
      const auto got = run_mode(mode, c, false, g_world.get(), &sh.shards[r], &sh.offsets[r]);
      expect_shard_of(got, whole, model, sh, rank,
                      manager_model::initial_slots(c.optimizer).size());
    }
  }
}

TEST(ManagersMpi, AScheduleOverTwoGroupsAndAResumeAcrossModesGiveTheReferenceBits) {
  const int ranks = g_world->size(), rank = g_world->rank();
  const auto r = static_cast<std::size_t>(rank);
  Case c{DType::bf16, AdamWConfig{}, 0.05f, Flow::sft, false};  // the torch formula
  c.schedule = true;
  c.steps = 10;
  const std::vector<StreamParam> model = stream_model(c.grad_dtype);
  const Sharding sh = shard_model(model, ranks);
  const auto want = run_reference(c, &sh);  // each shard updated as its own tensor
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    const auto got = run_mode(mode, c, false, g_world.get(), &sh.shards[r], &sh.offsets[r]);
    expect_shard_of(got, want, model, sh, rank, 2);
  }
  // Resume: 5 steps in mode full, each rank saves its own file; 5 more in mode none.
  long id = static_cast<long>(::getpid());
  MPI_Bcast(&id, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  const std::string path =
      "/tmp/stepcore-mpi-" + std::to_string(id) + "-rank-" + std::to_string(rank) + ".stepcore";
  auto run_span = [&](OffloadMode mode, int first, int count, bool save) {
    auto dev = make_device();
    Build b;
    b.mode = mode;
    b.comm = g_world.get();
    b.shard = &sh.shards[r];
    b.offsets = &sh.offsets[r];
    auto m = make_manager(b, c, *dev);
    if (!save) m->load_checkpoint(path);
    auto rec = run_stream(*m, *dev, stream_options(c, &sh.offsets[r], first, count));
    if (save) m->save_checkpoint(path);
    m->close();
    return rec;
  };
  const auto first = run_span(OffloadMode::full, 0, 5, true);
  const auto resumed = run_span(OffloadMode::none, 5, 5, false);
  std::remove(path.c_str());
  expect_shard_of(first, {want.begin(), want.begin() + 5}, model, sh, rank, 2);
  expect_shard_of(resumed, {want.begin() + 5, want.end()}, model, sh, rank, 2);
}

// Speculated overlapped steps (docs/managers.md, "With overlap"): 20 steps mixing
// unclipped, clipped (rolled back) and non-finite steps, a NaN in step 4 on the last rank
// only and one in step 9 on every rank, speculating always and auto in every mode: every
// rank holds its slice of the unsharded serial (non-overlapped) run, a NaN on one rank
// leaves every parameter on every rank unchanged and every rank skipped, and the ranks
// speculate, commit and roll back together.
TEST(ManagersMpi, SpeculatedStepsGiveTheSlicesOfTheSerialRunAndANanOnOneRankSkipsAll) {
  const int ranks = g_world->size(), rank = g_world->rank();
  const auto r = static_cast<std::size_t>(rank);
  const std::vector<std::size_t> sizes(8, 1531);
  constexpr int kSpecSteps = 20;
  Case c{DType::bf16, AdamWConfig{}, {}, Flow::sft, false, AdamWFormula::native};
  c.steps = kSpecSteps;
  c.sizes = sizes;
  c.chunk = 700;
  c.max_norm_of = [](int s) -> std::optional<float> {
    switch (s % 4) {
      case 1:
        return 1e6f;  // does not clip: speculated chunks commit
      case 2:
        return 1e-5f;  // clips: they roll back
      default:
        return std::nullopt;
    }
  };
  c.poisons = {{4, 2, 3, ranks - 1}, {9, 0, 2, -1}, {14, 2, 6, ranks - 1}};
  const std::vector<StreamParam> model = case_model(c);
  const Sharding sh = shard_model(model, ranks);
  ASSERT_GT(sh.shards[static_cast<std::size_t>(ranks - 1)][3].numel, 0u);
  // The unsharded serial run every rank computes alone, every NaN in it.
  Case whole_case = c;
  for (Poison& p : whole_case.poisons) p.rank = -1;
  const auto whole = run_mode(OffloadMode::none, whole_case);
  for (int s : {4, 9, 14}) {
    ASSERT_TRUE(whole[static_cast<std::size_t>(s)].skipped) << "step " << s;
    ASSERT_TRUE(whole[static_cast<std::size_t>(s)].state ==
                whole[static_cast<std::size_t>(s - 1)].state);
  }
  for (Speculation policy : {Speculation::always, Speculation::automatic})
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
      SCOPED_TRACE(std::string(offload_mode_name(mode)) + " " +
                   std::string(speculation_name(policy)));
      Case o = c;
      o.overlap = true;
      o.speculation = policy;
      const auto counts = run_reference(o);  // where the policy speculates and commits
      const auto got = run_mode(mode, o, false, g_world.get(), &sh.shards[r], &sh.offsets[r]);
      expect_shard_of(got, whole, model, sh, rank, 2);
      ASSERT_EQ(got.size(), whole.size());
      std::size_t speculated = 0;
      for (std::size_t s = 0; s < got.size(); ++s) {
        EXPECT_EQ(got[s].report_norm_bits, whole[s].report_norm_bits) << "step " << s;
        EXPECT_EQ(got[s].clip_bits, whole[s].clip_bits) << "step " << s;
        if (s == 4 || s == 9 || s == 14) {
          EXPECT_TRUE(got[s].skipped) << "step " << s;
          EXPECT_TRUE(got[s].state == got[s - 1].state) << "step " << s << " changed a parameter";
        }
        EXPECT_EQ(got[s].speculated > 0, counts[s].speculated > 0) << "step " << s;
        EXPECT_EQ(got[s].committed, counts[s].committed > 0 ? got[s].speculated : 0u);
        EXPECT_EQ(got[s].rolled_back, counts[s].rolled_back > 0 ? got[s].speculated : 0u);
        speculated += got[s].speculated;
      }
      EXPECT_GT(speculated, 0u);
    }
}

/// Prints failures of a non-zero rank with its rank number.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "rank %d: %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  int result = 0;
  {
    g_world = stepcore::comm::make_mpi_communicator(MPI_COMM_WORLD, 120s);
    result = RUN_ALL_TESTS();
    g_world.reset();
  }
  int any_failed = 0;
  MPI_Allreduce(&result, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
