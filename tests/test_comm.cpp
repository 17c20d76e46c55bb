// Unit: the global norm across ranks with the in-process communicator (threads of this
// process), so it runs wherever mpirun is missing. Every layout scenario of
// comm_cases.hpp with 1-4 ranks, f32 and bf16, against the single-process reference;
// the exact fallback on a rounding tie; non-finite values across ranks; layout
// disagreement, shards that do not add up, a failing rank, timeouts, a rank that
// leaves, abort, mismatched collectives; NormLayout validation and fingerprints.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <thread>

#include "comm_cases.hpp"
#include "expect_error.hpp"
#include "stepcore/comm_nccl.hpp"
#include "stepcore/error.hpp"

namespace {

using namespace comm_cases;
using test_support::expect_error;
using namespace std::chrono_literals;

/// Runs body(comm) on `size` threads, one per rank of a fresh in-process group;
/// an exception escaping a rank fails the test.
void run_group(int size, const std::function<void(Communicator&)>& body,
               std::chrono::milliseconds timeout = 60s) {
  auto group = comm::make_in_process_group(size, timeout);
  std::vector<std::thread> threads;
  std::mutex m;
  std::vector<std::string> errors;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(*group[r]);
      } catch (const std::exception& e) {
        std::lock_guard lock(m);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

// ---- every layout, every rank count, both dtypes -----------------------------------

class Layouts : public ::testing::TestWithParam<ScenarioParam> {};

TEST_P(Layouts, SameBitsAsTheSingleProcessReferenceOnEveryRank) {
  const auto all = scenarios();
  // Not a structured binding: clang before 16 (the tsan preset) cannot capture one.
  const auto& name = all[GetParam().index].first;
  const auto& scenario = all[GetParam().index].second;
  for (int size = 1; size <= 4; ++size) {
    SCOPED_TRACE(name + " with " + std::to_string(size) + " ranks");
    run_group(size, [&](Communicator& c) { check_scenario(c, scenario, GetParam().dtype); });
  }
}

INSTANTIATE_TEST_SUITE_P(InProcess, Layouts, ::testing::ValuesIn(all_params()),
                         [](const auto& info) {
                           return scenarios()[info.param.index].first + "_" +
                                  std::string(dtype_name(info.param.dtype));
                         });

TEST(GlobalNorm, ReferencePartialsGiveTheSameBits) {
  const Logical& l = logical_for(DType::f32);
  const auto s = scenarios();
  for (int size = 1; size <= 4; ++size) {
    run_group(size, [&](Communicator& c) {
      RankView rv = s[1].second(l, c.size(), c.rank());
      const NormResult r =
          comm::global_norm(c, rv.layout, [](std::span<const ConstTensorView> t, cpu::NormMode) {
            return reference::norm_partial(t);
          });
      EXPECT_TRUE(same_result(r, l.expected));
    });
  }
}

// ---- the exact fallback ------------------------------------------------------------

TEST(GlobalNorm, RoundingTieTakesTheExactPassOnEveryRank) {
  const float values[4] = {16777216.0f, 4096.0f, 4096.0f, 1.0f};
  const NormResult expected = finalize(reference::norm_partial({{const_view(values, 4)}}));
  ASSERT_EQ(expected.norm, 16777216.0f);
  for (int size = 1; size <= 4; ++size) {
    run_group(size, [&](Communicator& c) {
      const auto [r, exact_calls] = tie_norm(c);
      EXPECT_TRUE(same_result(r, expected)) << "rank " << c.rank();
      EXPECT_EQ(exact_calls, 1) << "rank " << c.rank();
    });
  }
}

TEST(GlobalNorm, RoundingTieWithTheEnginesFastPartials) {
  const float values[4] = {16777216.0f, 4096.0f, 4096.0f, 1.0f};
  const NormResult expected = finalize(reference::norm_partial({{const_view(values, 4)}}));
  for (int size = 1; size <= 4; ++size) {
    run_group(size, [&](Communicator& c) {
      const auto [b, e] = even_shard(4, c.size(), c.rank());
      const ConstTensorView v{e > b ? values + b : nullptr, e - b, DType::f32};
      NormLayout layout;
      layout.add(group("tie", 4, c.size()), {c.rank(), 0}, {&v, 1});
      EXPECT_TRUE(same_result(comm::global_norm(c, layout, engine()), expected));
    });
  }
}

// ---- non-finite values: found-inf and the inf-norm across ranks -----------------------

TEST(GlobalNorm, NonFiniteValuesOnOneRankReachEveryRank) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> with_inf(1000, 0.5f), with_nan(1000, 0.25f);
  with_inf[999] = -inf;
  with_inf[3] = 1e30f;
  with_nan[500] = nan;
  with_nan[501] = inf;
  for (const auto* data : {&with_inf, &with_nan}) {
    const NormResult expected =
        finalize(reference::norm_partial({{const_view(data->data(), data->size())}}));
    EXPECT_FALSE(expected.finite);
    for (int size = 1; size <= 4; ++size) {
      run_group(size, [&](Communicator& c) {
        const auto [b, e] = even_shard(data->size(), c.size(), c.rank());
        const ConstTensorView v{data->data() + b, e - b, DType::f32};
        NormLayout layout;
        layout.add(group("g", data->size(), c.size()), {c.rank(), 0}, {&v, 1});
        const NormResult r = comm::global_norm(c, layout, engine());
        EXPECT_TRUE(same_result(r, expected));
        EXPECT_FALSE(r.finite);
      });
    }
  }
}

TEST(GlobalNorm, InfNormIsTheMaximumOverRanks) {
  std::vector<float> v(4096);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::ldexp(1.0f, -static_cast<int>(i % 40));
  v[4000] = -3.5e12f;  // on the last rank for every rank count
  const NormResult expected = finalize(reference::norm_partial({{const_view(v.data(), v.size())}}));
  run_group(4, [&](Communicator& c) {
    const auto [b, e] = even_shard(v.size(), c.size(), c.rank());
    const ConstTensorView t{v.data() + b, e - b, DType::f32};
    NormLayout layout;
    layout.add(group("g", v.size(), c.size()), {c.rank(), 0}, {&t, 1});
    const NormResult r = comm::global_norm(c, layout, engine());
    EXPECT_EQ(r.max_abs, 3.5e12f);
    EXPECT_TRUE(same_result(r, expected));
  });
}

// ---- layouts that are wrong ----------------------------------------------------------

TEST(GlobalNorm, LayoutDisagreementIsAnErrorOnEveryRank) {
  const Logical& l = logical_for(DType::f32);
  for (int size = 2; size <= 4; ++size) {
    run_group(size, [&](Communicator& c) {
      NormLayout layout;
      const auto& x = l.tensors[12];
      const auto [b, e] = even_shard(x.numel, c.size(), c.rank());
      const ConstTensorView v = x.slice(b, e);
      // Rank 1 believes the group is one element larger.
      layout.add(group("g", x.numel + (c.rank() == 1 ? 1 : 0), c.size()), {c.rank(), 0}, {&v, 1});
      expect_error([&] { comm::validate_layout(c, layout); }, Errc::invalid_argument, "layout");
      expect_error([&] { comm::global_norm(c, layout, engine()); }, Errc::invalid_argument,
                   "layout");
      EXPECT_FALSE(c.failed());  // a layout error leaves the communicator usable
    });
  }
}

TEST(GlobalNorm, ADifferentGroupCountIsAnErrorOnEveryRank) {
  run_group(3, [&](Communicator& c) {
    NormLayout layout;
    layout.add_absent(group("a", 10, 1));
    if (c.rank() == 2) layout.add_absent(group("b", 10, 1));
    expect_error([&] { comm::validate_layout(c, layout); }, Errc::invalid_argument, "layout");
  });
}

TEST(GlobalNorm, ShardsThatDoNotAddUpAreAnErrorOnEveryRank) {
  const Logical& l = logical_for(DType::f32);
  const auto& x = l.tensors[13];
  // A dropped element, a shard counted twice, a replica index used twice.
  for (int variant = 0; variant < 3; ++variant) {
    run_group(3, [&](Communicator& c) {
      NormLayout layout;
      const auto shard_range = even_shard(x.numel, 3, c.rank());
      std::size_t b = shard_range.first, e = shard_range.second;
      if (variant == 0 && c.rank() == 0) --e;
      int shard = c.rank();
      if (variant == 1 && c.rank() == 2) {
        b = 0;
        e = 10;
        shard = 0;
      }
      const ConstTensorView v = x.slice(b, e);
      if (variant == 2) {
        const ConstTensorView whole = x.slice(0, x.numel);
        layout.add(group("g", x.numel, 1, 3), {0, c.rank() == 2 ? 1 : c.rank()}, {&whole, 1});
      } else {
        layout.add(group("g", x.numel, 3), {shard, 0}, {&v, 1});
      }
      expect_error([&] { comm::validate_layout(c, layout); }, Errc::invalid_argument, "layout");
    });
  }
}

TEST(GlobalNorm, AFailingRankIsAnErrorOnEveryRank) {
  run_group(3, [&](Communicator& c) {
    NormLayout layout;
    layout.add_absent(group("g", 0, 1));
    auto fn = [&](std::span<const ConstTensorView>, cpu::NormMode) -> NormPartial {
      if (c.rank() == 1) throw Error(Errc::unsupported_dtype, "grad", "test");
      return {};
    };
    expect_error([&] { comm::global_norm(c, layout, fn); }, Errc::unsupported_dtype,
                 c.rank() == 1 ? "grad" : "rank 1");
  });
}

// ---- peers that do not arrive ---------------------------------------------------------

TEST(InProcess, APeerThatNeverArrivesIsATimeoutOnEveryRank) {
  const auto timeout = 300ms;
  run_group(
      3,
      [&](Communicator& c) {
        NormLayout layout;
        layout.add_absent(group("g", 0, 1));
        if (c.rank() == 2) std::this_thread::sleep_for(3 * timeout);  // arrives late
        const auto start = std::chrono::steady_clock::now();
        expect_error([&] { comm::global_norm(c, layout, engine()); }, Errc::timeout, "");
        const auto waited = std::chrono::steady_clock::now() - start;
        if (c.rank() != 2) {
          // The first rank to arrive times out first and fails the group; a rank that
          // arrived a little later sees that a little before its own deadline.
          EXPECT_GE(waited, timeout - 100ms);
          EXPECT_LT(waited, timeout + 2s);
        } else {
          EXPECT_LT(waited, 1s);  // the group already failed: at once
        }
        EXPECT_TRUE(c.failed());
        expect_error([&] { c.synchronize(); }, Errc::timeout, "");
      },
      timeout);
}

TEST(InProcess, APeerThatLeavesIsAnErrorBeforeTheTimeout) {
  auto group = comm::make_in_process_group(3, 30s);
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::uint64_t x = 1;
      const auto start = std::chrono::steady_clock::now();
      try {
        group[r]->all_reduce(&x, 1, comm::Word::u64, comm::Op::sum);
      } catch (const Error& e) {
        if (e.code() == Errc::timeout) ++errors;
      }
      EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
    });
  }
  std::this_thread::sleep_for(100ms);
  group[2].reset();  // rank 2 leaves without joining
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 2);
}

TEST(InProcess, AbortWakesEveryPeer) {
  run_group(3, [&](Communicator& c) {
    std::uint64_t x = 1;
    if (c.rank() == 0) {
      std::this_thread::sleep_for(100ms);
      c.abort();
    }
    expect_error([&] { c.all_reduce(&x, 1, comm::Word::u64, comm::Op::sum); }, Errc::timeout, "");
  });
}

TEST(InProcess, MismatchedCollectivesAreAnError) {
  run_group(2, [&](Communicator& c) {
    std::uint64_t x[2] = {1, 2};
    if (c.rank() == 1) std::this_thread::sleep_for(50ms);  // rank 0 describes the collective
    expect_error([&] { c.all_reduce(x, c.rank() + 1, comm::Word::u64, comm::Op::sum); },
                 Errc::invalid_argument, "");
  });
}

// ---- the generic all-reduce and the partial reduction -----------------------------------

TEST(InProcess, GenericAllReduce) {
  run_group(4, [&](Communicator& c) {
    const int r = c.rank();
    std::uint32_t a[2] = {static_cast<std::uint32_t>(r), 7};
    c.all_reduce(a, 2, comm::Word::u32, comm::Op::sum);
    EXPECT_EQ(a[0], 6u);
    EXPECT_EQ(a[1], 28u);
    std::uint64_t b = 10 + r;
    c.all_reduce(&b, 1, comm::Word::u64, comm::Op::min);
    EXPECT_EQ(b, 10u);
    double d = -r;
    c.all_reduce(&d, 1, comm::Word::f64, comm::Op::max);
    EXPECT_EQ(d, 0.0);
    // f32 sums are combined in rank order: ((x0 + x1) + x2) + x3.
    const float xs[4] = {1.0f, 1e8f, -1e8f, 3.0f};
    float f = xs[r];
    c.all_reduce(&f, 1, comm::Word::f32, comm::Op::sum);
    float expected = xs[0];
    for (int i = 1; i < 4; ++i) expected = expected + xs[i];
    EXPECT_EQ(std::bit_cast<std::uint32_t>(f), std::bit_cast<std::uint32_t>(expected));
    c.all_reduce(nullptr, 0, comm::Word::f32, comm::Op::sum);
    expect_error([&] { c.all_reduce(nullptr, 1, comm::Word::f32, comm::Op::sum); },
                 Errc::null_pointer, "data");
  });
}

TEST(InProcess, ReducedPartialIsTheMergeAndAnAgreeingCheckIsUnchanged) {
  const Logical& l = logical_for(DType::f32);
  std::vector<NormPartial> parts(3);
  NormPartial merged;
  for (int r = 0; r < 3; ++r) {
    const auto& x = l.tensors[14 + r];
    parts[r] = reference::norm_partial({{x.slice(0, x.numel)}});
    merge(merged, parts[r]);
  }
  run_group(3, [&](Communicator& c) {
    NormPartial p = parts[c.rank()];
    comm::LayoutCheck check = comm::make_layout_check(0x1234);
    const comm::LayoutCheck before = check;
    c.all_reduce_partial(&p, &check);
    EXPECT_TRUE(same_value(p, merged));
    EXPECT_EQ(std::memcmp(&check, &before, sizeof check), 0);
    EXPECT_NO_THROW(comm::check_reduced(check, 0x1234));
    c.all_reduce_partial(&p, nullptr);  // no check: still collective
  });
}

// ---- NormLayout: validation and fingerprints -----------------------------------------

TEST(NormLayout, InvalidGroupsAreRejectedAndNothingIsAdded) {
  float x[8] = {};
  const ConstTensorView v = const_view(x, 8);
  const ConstTensorView null_view{nullptr, 3, DType::f32};
  const ConstTensorView f64_like{x, 2, static_cast<DType>(200)};
  NormLayout layout;
  layout.add(group("a", 8, 2), {1, 0}, {&v, 1});
  const auto fp = layout.fingerprint();
  auto expect_rejected = [&](auto&& f, Errc code) {
    try {
      f();
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
    }
    EXPECT_EQ(layout.group_count(), 1u);
    EXPECT_EQ(layout.fingerprint(), fp);
    EXPECT_EQ(layout.counted_tensors().size(), 1u);
  };
  expect_rejected([&] { layout.add(group("", 8, 1), {0, 0}, {&v, 1}); }, Errc::invalid_argument);
  expect_rejected([&] { layout.add(group("a", 8, 1), {0, 0}, {&v, 1}); }, Errc::invalid_argument);
  expect_rejected([&] { layout.add_absent(group("a", 8, 1)); }, Errc::invalid_argument);
  expect_rejected([&] { layout.add(group("b", 8, 0), {0, 0}, {&v, 1}); }, Errc::out_of_range);
  expect_rejected([&] { layout.add(group("b", 8, 1, 0), {0, 0}, {&v, 1}); }, Errc::out_of_range);
  expect_rejected([&] { layout.add(group("b", 8, 2), {2, 0}, {&v, 1}); }, Errc::out_of_range);
  expect_rejected([&] { layout.add(group("b", 8, 2), {-1, 0}, {&v, 1}); }, Errc::out_of_range);
  expect_rejected([&] { layout.add(group("b", 8, 2, 2), {0, 2}, {&v, 1}); }, Errc::out_of_range);
  expect_rejected([&] { layout.add(group("b", 7, 1), {0, 0}, {&v, 1}); }, Errc::size_mismatch);
  expect_rejected(
      [&] {
        layout.add(group("b", 8, 1), {0, 0}, {&null_view, 1});
      },
      Errc::null_pointer);
  expect_rejected(
      [&] {
        layout.add(group("b", 8, 1), {0, 0}, {&f64_like, 1});
      },
      Errc::unsupported_dtype);
}

TEST(NormLayout, FingerprintCoversTheGlobalDescriptionOnly) {
  float x[8] = {};
  const ConstTensorView v = const_view(x, 8), w = const_view(x, 3);
  NormLayout a, b, c, d, e;
  a.add(group("dense", 8, 2, 2), {0, 0}, {&v, 1});
  a.add_absent(group("expert.0", 100, 1));
  // Another rank: other placement, other tensors, the same description.
  b.add(group("dense", 8, 2, 2), {1, 1}, {&w, 1});
  b.add(group("expert.0", 100, 1), {0, 0}, {});
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  EXPECT_EQ(a.counted_tensors().size(), 1u);
  EXPECT_EQ(b.counted_tensors().size(), 0u);  // replica 1 does not count
  c.add_absent(group("expert.0", 100, 1));
  c.add_absent(group("dense", 8, 2, 2));
  EXPECT_NE(a.fingerprint(), c.fingerprint());  // order matters
  d.add_absent(group("dense", 8, 2, 1));
  d.add_absent(group("expert.0", 100, 1));
  EXPECT_NE(a.fingerprint(), d.fingerprint());
  e.add_absent(group("dense", 8, 2, 2));
  EXPECT_NE(a.fingerprint(), e.fingerprint());
}

TEST(Factories, ArgumentsAndBuildFlags) {
  expect_error([] { comm::make_in_process_group(0); }, Errc::out_of_range, "size");
  expect_error([] { comm::make_in_process_group(2, 0ms); }, Errc::out_of_range, "timeout");
  auto g = comm::make_in_process_group(1);
  EXPECT_EQ(g[0]->name(), "in_process");
  EXPECT_EQ(g[0]->memory(), comm::MemorySpace::host);
  expect_error([&] { g[0]->set_timeout(-1ms); }, Errc::out_of_range, "timeout");
  g[0]->set_timeout(5s);
  EXPECT_EQ(g[0]->timeout(), 5s);
  if (!comm::built_with_nccl()) {
    expect_error([] { comm::nccl_unique_id(); }, Errc::not_supported, "");
  } else {
    expect_error([] { comm::make_nccl_communicator(nullptr, nullptr); }, Errc::null_pointer,
                 "comm");
  }
}

}  // namespace
