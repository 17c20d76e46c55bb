// The norm's reduction of block partials (kernels/plans.hpp's reduce_plan and
// slice_bounds, the one slice plan of the CUDA reduction and the CPU executor): the
// slices cover every block count from 1 to 2^32 exactly once, and the executor, which
// runs the same plan, gives the reference's bits past the slice cap (262,144 blocks)
// and under any slicing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "kernels/plans.hpp"
#include "kernels/testing.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;
using test_support::expect_error;

std::uint32_t f32_bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// Walks every slice of the first pass over `blocks` partials: slice 0 starts at 0, each
// slice is non-empty and starts where the previous ended, the last ends at `blocks`
// (so every partial is read exactly once), and the plan keeps its limits. Returns the
// first violation, or "" (no gtest macro per slice: a billion of them would be slow).
std::string walk_slices(std::uint64_t blocks) {
  const gpu::ReducePlan plan = gpu::reduce_plan(blocks);
  const auto where = " at " + std::to_string(blocks) + " blocks";
  if (plan.slices < 1 || plan.slices > gpu::kMaxReduceSlices) return "slice count" + where;
  if ((plan.slices == 1) != (blocks <= gpu::kPartialsPerSlice)) return "one pass" + where;
  std::uint64_t next = 0;
  for (std::uint32_t s = 0; s < plan.slices; ++s) {
    const gpu::SliceBounds b = gpu::slice_bounds(blocks, plan.per_slice, s);
    if (b.begin != next) return "slice " + std::to_string(s) + " starts elsewhere" + where;
    if (b.end <= b.begin) return "slice " + std::to_string(s) + " is empty" + where;
    next = b.end;
  }
  if (next != blocks) return "the last slice ends at " + std::to_string(next) + where;
  const gpu::SliceBounds past = gpu::slice_bounds(blocks, plan.per_slice, plan.slices);
  if (past.begin != past.end) return "a slice past the plan is not empty" + where;
  return "";
}

// Every block count from 1 to 2^32 (the block indices are 32-bit) is covered exactly
// once. Below 2^19 counts every slice of every count is walked. Above, the counts fall
// into classes of equal per_slice p, c in (128 (p - 1), 128 p]: the slices of a count
// are [s p, (s + 1) p) cut at c (slice_bounds, walked in full for the sampled counts),
// so they cover [0, c) exactly once iff (slices - 1) p < c <= slices p, an interval
// condition in c for fixed p and slices; checking it with the plan at both ends of every
// class (33 M classes) proves it for every count of the class.
TEST(GpuReducePlan, SlicesCoverEveryBlockCountUpTo2To32ExactlyOnce) {
  constexpr std::uint64_t kExhaustive = std::uint64_t{1} << 19;
  constexpr std::uint64_t kTop = std::uint64_t{1} << 32;
  for (std::uint64_t c = 1; c <= kExhaustive; ++c) {
    const std::string bad = walk_slices(c);
    ASSERT_EQ(bad, "");
  }
  const std::uint64_t cap = gpu::kMaxReduceSlices;
  ASSERT_EQ(kExhaustive % cap, 0u);
  for (std::uint64_t p = kExhaustive / cap + 1; p <= kTop / cap; ++p) {
    const std::uint64_t lo = cap * (p - 1) + 1, hi = cap * p;
    const gpu::ReducePlan a = gpu::reduce_plan(lo), b = gpu::reduce_plan(hi);
    if (a.per_slice != p || b.per_slice != p || a.slices != b.slices ||
        a.slices > gpu::kMaxReduceSlices || !((a.slices - 1) * p < lo && hi <= a.slices * p))
      FAIL() << "class of per_slice " << p << ": counts " << lo << ".." << hi << " give per_slice "
             << a.per_slice << "/" << b.per_slice << ", slices " << a.slices << "/" << b.slices;
  }
  // Every slice walked at the class boundaries of interest and at random counts.
  std::vector<std::uint64_t> counts = {kTop, kTop - 1, 262144, 262145, 300000};
  for (int e = 19; e < 32; ++e)
    for (std::int64_t d : {-1, 0, 1, 127, 128, 129})
      counts.push_back((std::uint64_t{1} << e) + static_cast<std::uint64_t>(d));
  std::mt19937_64 rng(40);
  for (int i = 0; i < 2000; ++i) counts.push_back(kExhaustive + rng() % (kTop - kExhaustive) + 1);
  for (std::uint64_t c : counts) ASSERT_EQ(walk_slices(c), "");
  // The plan is the documented one: the cap is reached at 2^18 blocks, then the slices grow.
  EXPECT_EQ(gpu::reduce_plan(262144).per_slice, gpu::kPartialsPerSlice);
  EXPECT_EQ(gpu::reduce_plan(262145).per_slice, gpu::kPartialsPerSlice + 1);
  EXPECT_EQ(gpu::reduce_plan(300000).slices, gpu::kMaxReduceSlices);
  EXPECT_EQ(gpu::reduce_plan(kTop).per_slice, kTop / gpu::kMaxReduceSlices);
}

// The block indices are 32-bit: a plan of 2^32 blocks or more (2^48 elements) is refused,
// naming the tensors, before anything is built (nothing is read: the views are never used).
TEST(GpuReducePlan, APlanOfMoreThan2To32MinusOneBlocksIsRefused) {
  float x = 0.0f;
  const std::size_t per_block = gpu::kBlockElements;
  const std::vector<TensorView> one{{&x, (std::size_t{1} << 32) * per_block + 1, DType::bf16}};
  expect_error([&] { (void)gpu::make_plan(one); }, Errc::out_of_range, "tensors");
  const std::vector<TensorView> two{{&x, (std::size_t{1} << 31) * per_block, DType::bf16},
                                    {&x, (std::size_t{1} << 31) * per_block, DType::bf16}};
  expect_error([&] { (void)gpu::make_plan(two); }, Errc::out_of_range, "tensors");
}

// Values of one-element tensors (one block each): `n` of them, seeded, plus the
// reference's partial of them.
struct OneElementBlocks {
  std::vector<float> values;
  std::vector<TensorView> views;
  std::vector<ConstTensorView> cviews;
  explicit OneElementBlocks(std::size_t n, std::uint32_t seed) : values(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& x : values) x = nd(rng);
    views.reserve(n);
    cviews.reserve(n);
    for (float& x : values) {
      views.push_back({&x, 1, DType::f32});
      cviews.push_back({&x, 1, DType::f32});
    }
  }
};

// Each field of the executor's partial equals the reference's (the digits: one square
// per block, so the block's binary64 sum is exact and the digits are the exact ones).
void expect_reference_partial(const NormPartial& got, const NormPartial& ref) {
  for (int k = 0; k < kNormDigits; ++k) EXPECT_EQ(got.digits[k], ref.digits[k]) << "digit " << k;
  EXPECT_EQ(got.nan_count, ref.nan_count);
  EXPECT_EQ(got.inf_count, ref.inf_count);
  EXPECT_EQ(got.max_abs_bits, ref.max_abs_bits);
}

// 300,000 blocks: 128 slices of 2,344 partials. The NaN, the Inf and the largest value sit
// past block 262,144 (128 slices of 2,048), where a capped slicing stops reading; the
// executor runs the device's slice plan and must count them, then give the reference's
// norm once they are gone.
TEST(GpuReducePlan, TheExecutorPastTheSliceCapGivesTheReferenceBits) {
  constexpr std::size_t kBlocks = 300000;
  OneElementBlocks in(kBlocks, 41);
  in.values[262144] = 1e30f;
  in.values[290000] = std::nanf("");
  in.values[kBlocks - 1] = -INFINITY;
  const gpu::LaunchPlan plan = gpu::make_plan(in.views);
  ASSERT_EQ(plan.total_blocks, kBlocks);
  ASSERT_EQ(gpu::reduce_plan(kBlocks).slices, gpu::kMaxReduceSlices);
  ASSERT_GT(gpu::kMaxReduceSlices * gpu::kPartialsPerSlice, 262143u);
  ASSERT_LT(gpu::kMaxReduceSlices * gpu::kPartialsPerSlice, kBlocks);
  const NormPartial got = gpu::emulate::norm_partial(plan, GradientRead{}, 32);
  const NormPartial ref = reference::norm_partial(in.cviews);
  expect_reference_partial(got, ref);
  EXPECT_EQ(got.nan_count, 1u);
  EXPECT_EQ(got.inf_count, 1u);
  EXPECT_EQ(got.max_abs_bits, f32_bits(1e30f));
  EXPECT_FALSE(finalize(got).finite) << "found-inf must see the NaN";
  in.values[290000] = 0.5f;
  in.values[kBlocks - 1] = -3.0f;
  const NormPartial finite = gpu::emulate::norm_partial(plan, GradientRead{}, 32);
  const NormPartial finite_ref = reference::norm_partial(in.cviews);
  expect_reference_partial(finite, finite_ref);
  const NormResult r = finalize(finite), rr = finalize(finite_ref);
  ASSERT_TRUE(r.finite);
  EXPECT_EQ(f32_bits(r.norm), f32_bits(rr.norm));
  EXPECT_EQ(f32_bits(r.max_abs), f32_bits(rr.max_abs));
}

// The executor under other reduction limits (the test hook): many slices, uneven last
// slices, slices grown past their minimum: the same partial, field for field, as the
// default one pass and the reference, with a NaN in the last block counted.
TEST(GpuReducePlan, EverySlicingGivesTheSameBits) {
  for (std::size_t n : {1u, 2u, 7u, 64u, 1000u, 4099u}) {
    OneElementBlocks in(n, static_cast<std::uint32_t>(n));
    in.values[n - 1] = std::nanf("");
    const gpu::LaunchPlan plan = gpu::make_plan(in.views, {}, 5, 3);  // many launches
    const NormPartial ref = reference::norm_partial(in.cviews);
    const NormPartial one = gpu::emulate::norm_partial(plan, GradientRead{}, 32);
    expect_reference_partial(one, ref);
    struct Limits {
      std::uint64_t min_per_slice, max_slices;
    };
    for (const Limits lim : {Limits{1, 2}, Limits{1, 128}, Limits{3, 5}, Limits{2048, 2},
                             Limits{7, 3}, Limits{64, 128}}) {
      SCOPED_TRACE(std::to_string(n) + " blocks, slices of at least " +
                   std::to_string(lim.min_per_slice) + ", at most " +
                   std::to_string(lim.max_slices) + " of them");
      const gpu::testing::ScopedReduceSlicing slicing(lim.min_per_slice, lim.max_slices);
      const NormPartial got = gpu::emulate::norm_partial(plan, GradientRead{}, 32);
      expect_reference_partial(got, ref);
      EXPECT_EQ(got.nan_count, 1u);
      EXPECT_EQ(got.approximate, one.approximate);
    }
  }
  expect_error([] { gpu::testing::ScopedReduceSlicing s(0, 8); }, Errc::out_of_range,
               "min_per_slice");
  expect_error([] { gpu::testing::ScopedReduceSlicing s(4, 1); }, Errc::out_of_range, "max_slices");
}

}  // namespace
