// MPI (label mpi, run by ctest through mpirun with 1, 2, 3 and 4 processes): every layout
// scenario of comm_cases.hpp, f32 and bf16, gives the single-process reference's bits on
// every rank; the exact fallback on a rounding tie; layout disagreement and a failing
// rank; and a rank that arrives after the timeout, which ends in Errc::timeout on every
// rank (the late one included) and still leaves MPI clean to finalise.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "comm_cases.hpp"
#include "expect_error.hpp"
#include "stepcore/comm_mpi.hpp"
#include "stepcore/error.hpp"

namespace {

using namespace comm_cases;
using test_support::expect_error;
using namespace std::chrono_literals;

/// The world communicator every test shares (created in main after MPI_Init).
std::unique_ptr<Communicator> g_world;

Communicator& world() { return *g_world; }

class Layouts : public ::testing::TestWithParam<ScenarioParam> {};

TEST_P(Layouts, SameBitsAsTheSingleProcessReferenceOnEveryRank) {
  const auto all = scenarios();
  check_scenario(world(), all[GetParam().index].second, GetParam().dtype);
}

INSTANTIATE_TEST_SUITE_P(Mpi, Layouts, ::testing::ValuesIn(all_params()), [](const auto& info) {
  return scenarios()[info.param.index].first + "_" + std::string(dtype_name(info.param.dtype));
});

TEST(MpiGlobalNorm, RoundingTieTakesTheExactPassOnEveryRank) {
  const float values[4] = {16777216.0f, 4096.0f, 4096.0f, 1.0f};
  const NormResult expected = finalize(reference::norm_partial({{const_view(values, 4)}}));
  const auto [r, exact_calls] = tie_norm(world());
  EXPECT_TRUE(same_result(r, expected));
  EXPECT_EQ(r.norm, 16777216.0f);
  EXPECT_EQ(exact_calls, 1);
}

TEST(MpiGlobalNorm, LayoutDisagreementIsAnErrorOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  NormLayout layout;
  layout.add_absent(group("g", world().rank() == 1 ? 11 : 10, 1));
  expect_error([&] { comm::validate_layout(world(), layout); }, Errc::invalid_argument, "layout");
  expect_error([&] { comm::global_norm(world(), layout, engine()); }, Errc::invalid_argument,
               "layout");
  EXPECT_FALSE(world().failed());
}

TEST(MpiGlobalNorm, AFailingRankIsAnErrorOnEveryRank) {
  const int bad = world().size() - 1;
  NormLayout layout;
  layout.add_absent(group("g", 0, 1));
  auto fn = [&](std::span<const ConstTensorView>, cpu::NormMode) -> NormPartial {
    if (world().rank() == bad) throw Error(Errc::unsupported_dtype, "grad", "test");
    return {};
  };
  expect_error([&] { comm::global_norm(world(), layout, fn); }, Errc::unsupported_dtype,
               world().rank() == bad ? "grad" : "rank " + std::to_string(bad));
}

TEST(MpiGlobalNorm, GenericAllReduce) {
  const int r = world().rank(), n = world().size();
  std::uint64_t s[2] = {static_cast<std::uint64_t>(r), 1};
  world().all_reduce(s, 2, comm::Word::u64, comm::Op::sum);
  EXPECT_EQ(s[0], static_cast<std::uint64_t>(n * (n - 1) / 2));
  EXPECT_EQ(s[1], static_cast<std::uint64_t>(n));
  float f = static_cast<float>(r);
  world().all_reduce(&f, 1, comm::Word::f32, comm::Op::max);
  EXPECT_EQ(f, static_cast<float>(n - 1));
}

// Uses its own communicator, which it leaves failed, and ends with MPI clean again.
TEST(MpiTimeout, ALateRankIsATimeoutOnEveryRank) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const auto timeout = 500ms;
  auto c = comm::make_mpi_communicator(MPI_COMM_WORLD, timeout);
  NormLayout layout;
  layout.add_absent(group("g", 0, 1));
  const bool late = c->rank() == n - 1;
  if (late) std::this_thread::sleep_for(3 * timeout);
  const auto start = std::chrono::steady_clock::now();
  expect_error([&] { comm::global_norm(*c, layout, engine()); }, Errc::timeout, "");
  const auto waited = std::chrono::steady_clock::now() - start;
  if (!late) {
    EXPECT_GE(waited, timeout);
    EXPECT_LT(waited, timeout + 3s);
  }
  EXPECT_TRUE(c->failed());
  // Later collectives fail at once, without touching MPI.
  std::uint64_t x = 0;
  expect_error([&] { c->all_reduce(&x, 1, comm::Word::u64, comm::Op::sum); }, Errc::timeout, "");
  // The late rank's arrival completed every pending request: MPI is clean again.
  MPI_Barrier(MPI_COMM_WORLD);
  c.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

/// Prints failed assertions of a rank other than 0 (whose default printer is removed).
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "rank %d: %s:%d: failure\n%s\n", rank_,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
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
  if (rank != 0) {  // one rank reports progress; failures on any rank still print
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  int result = 0;
  {
    g_world = comm::make_mpi_communicator(MPI_COMM_WORLD, 60s);
    result = RUN_ALL_TESTS();
    g_world.reset();
  }
  // Every rank's verdict decides the exit status of every rank.
  int any_failed = 0;
  MPI_Allreduce(&result, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank != 0 && result != 0) std::fprintf(stderr, "rank %d: tests failed\n", rank);
  MPI_Finalize();
  return any_failed;
}
