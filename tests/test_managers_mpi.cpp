// The gradient managers sharded over MPI processes (label mpi, run by ctest through
// mpirun with 2 and 4 processes): each rank holds an uneven shard of every parameter
// (rank 0's shard of parameter 0 empty) and drives a manager of each mode with the MPI
// communicator; its norms, clip coefficients and state must be the slices of the
// unsharded single-process run, which every rank also computes alone.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>

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
