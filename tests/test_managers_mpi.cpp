// The gradient managers sharded over MPI processes (label mpi, run by ctest through
// mpirun with 2 and 4 processes): each rank holds an uneven shard of every parameter
// (rank 0's shard of parameter 0 empty) and drives a manager of each mode with the MPI
// communicator; its norms, clip coefficients and state must be the slices of the
// unsharded single-process run, which every rank also computes alone — also under a
// schedule over two groups (against the reference with each shard its own tensor) and
// across a checkpoint saved per rank in one mode and loaded in another.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

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
  for (const Case& c : {Case{DType::bf16, OptimizerKind::adamw, 0.05f, Flow::rl, false, native},
                        Case{DType::f32, OptimizerKind::sign_sgd, 100.0f, Flow::sft, false},
                        Case{DType::bf16, OptimizerKind::adamw, {}, Flow::sft, false, native}}) {
    SCOPED_TRACE(c.label());
    const std::vector<StreamParam> model = stream_model(c.grad_dtype);
    const auto whole = run_mode(OffloadMode::none, c);
    const Sharding sh = shard_model(model, ranks);
    const auto r = static_cast<std::size_t>(rank);
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
      SCOPED_TRACE(std::string(offload_mode_name(mode)));
      const auto got = run_mode(mode, c, false, g_world.get(), &sh.shards[r], &sh.offsets[r]);
      expect_shard_of(got, whole, model, sh, rank, c.optimizer == OptimizerKind::adamw);
    }
  }
}

TEST(ManagersMpi, AScheduleOverTwoGroupsAndAResumeAcrossModesGiveTheReferenceBits) {
  const int ranks = g_world->size(), rank = g_world->rank();
  const auto r = static_cast<std::size_t>(rank);
  Case c{DType::bf16, OptimizerKind::adamw, 0.05f, Flow::sft, false};  // the torch formula
  c.schedule = true;
  c.steps = 10;
  const std::vector<StreamParam> model = stream_model(c.grad_dtype);
  const Sharding sh = shard_model(model, ranks);
  const auto want = run_reference(c, &sh);  // each shard updated as its own tensor
  for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full}) {
    SCOPED_TRACE(std::string(offload_mode_name(mode)));
    const auto got = run_mode(mode, c, false, g_world.get(), &sh.shards[r], &sh.offsets[r]);
    expect_shard_of(got, want, model, sh, rank, true);
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
  expect_shard_of(first, {want.begin(), want.begin() + 5}, model, sh, rank, true);
  expect_shard_of(resumed, {want.begin() + 5, want.end()}, model, sh, rank, true);
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
