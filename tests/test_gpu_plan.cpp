// GPU launch plans and the CPU executor of the kernels' block bodies (no GPU needed):
// coverage of every element exactly once, launches split by block and tensor limits,
// and the fused scale + norm and accumulate bodies against the reference, bit for bit,
// for two different launch shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "expect_error.hpp"
#include "kernels/checked_plans.hpp"
#include "kernels/plans.hpp"
#include "optimizer_records.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;
using AdamWUnit = stepcore::detail::AdamW;
using SignSgdUnit = stepcore::detail::SignSgd;
using test_support::sign_sgd_tensor;

std::vector<std::size_t> sizes_with_empty() {
  const std::size_t c = gpu::kBlockElements;
  return {0, 1, 31, 32, 33, 1023, 1024, 1025, 0, c - 1, c, c + 1, 3 * c + 7, 0, 129};
}

/// Marks every element each plan task covers; all must be covered exactly once, in
/// tensor order, then chunk order.
TEST(GpuPlan, CoversEveryElementExactlyOnce) {
  const auto sizes = sizes_with_empty();
  std::vector<std::vector<float>> bufs;
  std::vector<TensorView> views;
  for (std::size_t n : sizes) {
    bufs.emplace_back(n);
    views.push_back({bufs.back().data(), n, DType::f32});
  }
  for (int max_blocks : {gpu::kMaxBlocksPerLaunch, 3, 1}) {
    for (int max_tensors : {gpu::kMaxTensorsPerLaunch, 2, 1}) {
      const gpu::LaunchPlan plan = gpu::make_plan(views, {}, max_blocks, max_tensors);
      std::vector<std::vector<int>> hits(sizes.size());
      for (std::size_t t = 0; t < sizes.size(); ++t) hits[t].assign(sizes[t], 0);
      std::uint32_t blocks = 0;
      const void* last_tensor = nullptr;
      std::uint64_t last_end = 0;
      for (const gpu::LaunchArgs& a : plan.launches) {
        ASSERT_LE(a.num_blocks, max_blocks);
        ASSERT_LE(a.num_tensors, max_tensors);
        ASSERT_EQ(a.first_block, blocks);
        for (int b = 0; b < a.num_blocks; ++b) {
          const gpu::BlockTask task = a.task(b);
          ASSERT_LT(task.tensor, a.num_tensors);
          const void* data = a.data[task.tensor];
          std::size_t t = 0;
          while (views[t].data != data || views[t].numel == 0) ++t;
          ASSERT_LE(task.end - task.begin, gpu::kBlockElements);
          ASSERT_LT(task.begin, task.end);
          if (data == last_tensor) ASSERT_EQ(task.begin, last_end) << "chunks in order";
          last_tensor = data;
          last_end = task.end;
          for (std::uint64_t i = task.begin; i < task.end; ++i) ++hits[t][i];
          ++blocks;
        }
      }
      EXPECT_EQ(blocks, plan.total_blocks);
      for (std::size_t t = 0; t < sizes.size(); ++t)
        for (std::size_t i = 0; i < sizes[t]; ++i)
          ASSERT_EQ(hits[t][i], 1) << "tensor " << t << " element " << i;
    }
  }
  EXPECT_THROW(gpu::make_plan(views, {}, 0), Error);
  EXPECT_THROW(gpu::make_plan(views, {}, gpu::kMaxBlocksPerLaunch + 1), Error);
}

TEST(GpuPlan, TensorsBeyond2To31ElementsUse64BitRanges) {
  // Nothing is executed: the plan is plain data over a fake pointer. 2^33 + 5 elements
  // are 131,073 chunks: more than one launch's 65,536 blocks.
  const std::uint64_t n = (std::uint64_t{1} << 33) + 5;
  const std::vector<TensorView> views{{reinterpret_cast<void*>(0x1000), n, DType::bf16}};
  const gpu::LaunchPlan plan = gpu::make_plan(views);
  std::uint64_t covered = 0, last_end = 0;
  for (const auto& a : plan.launches)
    for (int b = 0; b < a.num_blocks; ++b) {
      const gpu::BlockTask task = a.task(b);
      ASSERT_EQ(task.begin, last_end);
      last_end = task.end;
      covered += task.end - task.begin;
    }
  EXPECT_EQ(covered, n);
  EXPECT_EQ(last_end, n);
  EXPECT_EQ(plan.total_blocks, (n + gpu::kBlockElements - 1) / gpu::kBlockElements);
  EXPECT_EQ(plan.launches.size(), 3u);
  // 1 GiB of bf16 (the benchmark's size) is one launch of 8,192 blocks: enough to fill
  // any GPU, where the old plans capped a launch at 256.
  const std::vector<TensorView> gib{
      {reinterpret_cast<void*>(0x1000), std::uint64_t{1} << 29, DType::bf16}};
  const gpu::LaunchPlan one = gpu::make_plan(gib);
  ASSERT_EQ(one.launches.size(), 1u);
  EXPECT_EQ(one.launches[0].num_blocks, 8192);
}

/// Buffers and views over them; copies re-point the views at their own buffers.
struct Data {
  std::vector<std::vector<std::uint8_t>> bufs;
  std::vector<TensorView> views;
  Data() = default;
  Data(const Data& o) : bufs(o.bufs), views(o.views) {
    for (std::size_t k = 0; k < views.size(); ++k) views[k].data = bufs[k].data();
  }
  Data& operator=(const Data&) = delete;
};

Data make_data(DType d, std::uint32_t seed) {
  Data data;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::size_t n : sizes_with_empty()) {
    data.bufs.emplace_back(n * dtype_size(d) + 1);
    for (std::size_t i = 0; i < n; ++i) {
      const float x = nd(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
      if (d == DType::f32) std::memcpy(data.bufs.back().data() + 4 * i, &x, 4);
      const std::uint16_t h = d == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
      if (d != DType::f32) std::memcpy(data.bufs.back().data() + 2 * i, &h, 2);
    }
  }
  for (std::size_t k = 0; k < data.bufs.size(); ++k)
    data.views.push_back({data.bufs[k].data(), sizes_with_empty()[k], d});
  return data;
}

TEST(GpuExecutor, ScaleAndNormMatchTheReferenceForTwoLaunchShapes) {
  std::uint32_t seed = 1;
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    for (float scale : {1.0f, 1.0f / 3000.0f, 7.5f}) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " scale " + std::to_string(scale));
      const Data input = make_data(d, seed++);
      Data expected = input;
      reference::scale_(expected.views, scale);
      std::vector<ConstTensorView> ev(expected.views.begin(), expected.views.end());
      const NormResult ref = finalize(reference::norm_partial(ev));
      struct Shape {
        int max_blocks, max_tensors, threads;
      };
      for (const Shape shape :
           {Shape{gpu::kMaxBlocksPerLaunch, gpu::kMaxTensorsPerLaunch, gpu::kBlockThreads},
            Shape{3, 2, 64}}) {
        Data got = input;
        const gpu::LaunchPlan plan =
            gpu::make_plan(got.views, {}, shape.max_blocks, shape.max_tensors);
        const NormPartial p = gpu::emulate::scale_and_norm_partial(plan, scale, shape.threads);
        for (std::size_t k = 0; k < got.bufs.size(); ++k)
          ASSERT_EQ(got.bufs[k], expected.bufs[k]) << "scaled tensor " << k;
        const NormResult r = finalize(p);
        ASSERT_FALSE(r.needs_exact);
        EXPECT_EQ(f32_bits(r.norm), f32_bits(ref.norm));
        EXPECT_EQ(f32_bits(r.max_abs), f32_bits(ref.max_abs));
        EXPECT_EQ(r.finite, ref.finite);
      }
    }
  }
}

TEST(GpuExecutor, ReadOnlyNormAndEagerClipMatchTheReference) {
  std::uint32_t seed = 90;
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    for (const GradientRead read :
         {GradientRead{}, GradientRead{1.0f / 3000.0f, 1.0f}, GradientRead{0.3f, 0.37f}}) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " scale " + std::to_string(read.scale) + " clip " +
                   std::to_string(read.clip));
      Data data = make_data(d, seed++);
      const Data before = data;
      std::vector<ConstTensorView> cv(data.views.begin(), data.views.end());
      const NormResult ref = finalize(reference::norm_partial(cv, read));
      const NormResult got =
          finalize(gpu::emulate::norm_partial(gpu::make_plan(data.views, {}, 7, 3), read, 64));
      ASSERT_FALSE(got.needs_exact);
      EXPECT_EQ(f32_bits(got.norm), f32_bits(ref.norm));
      EXPECT_EQ(f32_bits(got.max_abs), f32_bits(ref.max_abs));
      for (std::size_t k = 0; k < data.bufs.size(); ++k)
        ASSERT_EQ(data.bufs[k], before.bufs[k]) << "nothing written";
      // The eager clip: in place by the coefficient, like reference::scale_.
      Data expected = before;
      reference::scale_(expected.views, read.clip);
      gpu::emulate::scale_(gpu::make_plan(data.views), read.clip);
      for (std::size_t k = 0; k < data.bufs.size(); ++k)
        ASSERT_EQ(data.bufs[k], expected.bufs[k]) << k;
    }
  }
}

TEST(GpuExecutor, SignSgdMatchesTheReference) {
  std::uint32_t seed = 300;
  for (DType gd : {DType::f32, DType::bf16, DType::f16}) {
    for (int out : {0, 1, 2, 3}) {
      for (double wd : {0.0, 0.1}) {
        const Data grads = make_data(gd, seed++);
        const Data params = make_data(DType::f32, seed++);
        Data ref_p = params, got_p = params;
        std::vector<std::vector<std::uint8_t>> ref_o, got_o;
        for (const auto& v : params.views) {
          ref_o.emplace_back(v.numel * 4 + 1, 0xEE);
          got_o.emplace_back(v.numel * 4 + 1, 0xEE);
        }
        auto tensors = [&](Data& p, std::vector<std::vector<std::uint8_t>>& o) {
          std::vector<OptimizerTensor> t;
          for (std::size_t k = 0; k < p.views.size(); ++k) {
            OptimizerTensor s = sign_sgd_tensor(p.views[k], grads.views[k]);
            if (out) s.compute_param = {o[k].data(), p.views[k].numel, static_cast<DType>(out - 1)};
            t.push_back(s);
          }
          return t;
        };
        const SignSgdConfig cfg{1e-3, wd};
        auto rt = tensors(ref_p, ref_o);
        reference::sign_sgd_step(rt, cfg);
        auto gt = tensors(got_p, got_o);
        gpu::emulate::optimizer_step(gpu::make_optimizer_plan<SignSgdUnit>(gt, cfg, 4, 3),
                                     OptimizerDeviceArgs{}, 64);
        for (std::size_t k = 0; k < ref_p.bufs.size(); ++k) {
          ASSERT_EQ(got_p.bufs[k], ref_p.bufs[k]) << dtype_name(gd) << " tensor " << k;
          ASSERT_EQ(got_o[k], ref_o[k]) << "compute copy " << k;
        }
      }
    }
  }
}

TEST(GpuExecutor, FinalizeAndClipFlags) {
  auto run = [](const std::vector<float>& x, float max_norm, NormResult& r, float& clip) {
    std::vector<float> copy = x;
    const std::vector<TensorView> v{{copy.data(), copy.size(), DType::f32}};
    const NormPartial p = gpu::emulate::scale_and_norm_partial(gpu::make_plan(v), 1.0f);
    std::int32_t flag = -1;
    gpu::emulate::finalize_and_clip(p, max_norm, r, clip, flag);
    return flag;
  };
  NormResult r;
  float clip = -1.0f;
  // 3-4-12: the exact norm is 13; the reference's finalisation and torch's coefficient.
  EXPECT_EQ(run({3.0f, 4.0f, 12.0f}, 1.0f, r, clip), 0);
  EXPECT_EQ(r.norm, 13.0f);
  EXPECT_EQ(f32_bits(clip), f32_bits(clip_coefficient(13.0f, 1.0f)));
  EXPECT_EQ(run({3.0f, 4.0f, 12.0f}, 100.0f, r, clip), 0);
  EXPECT_EQ(clip, 1.0f);
  EXPECT_EQ(run({3.0f, std::nanf("")}, 1.0f, r, clip), 1);
  EXPECT_EQ(clip, 0.0f);
  EXPECT_EQ(run({3e38f, 3e38f}, 1.0f, r, clip), 1) << "a norm overflowing f32 is not finite";
  // A rounding tie (2^25 + 2, see test_cpu_engine) cannot be certified: flag 2.
  EXPECT_EQ(run({16777216.0f, 16777216.0f, 16777216.0f, 16777216.0f, 8192.0f, 8192.0f, 2.0f}, 1.0f,
                r, clip),
            2);
  EXPECT_TRUE(r.needs_exact);
  std::int32_t flag = 0;
  EXPECT_THROW(gpu::emulate::finalize_and_clip(NormPartial{}, -1.0f, r, clip, flag), Error);
}

TEST(GpuExecutor, NonFiniteValuesAreCounted) {
  std::vector<float> x(70000, 0.25f);
  x[5] = std::nanf("");
  x[66000] = -INFINITY;
  const std::vector<TensorView> v{{x.data(), x.size(), DType::f32}};
  const NormResult r = finalize(gpu::emulate::scale_and_norm_partial(gpu::make_plan(v), 1.0f));
  EXPECT_EQ(r.nan_count, 1u);
  EXPECT_EQ(r.inf_count, 1u);
  EXPECT_FALSE(r.finite);
  EXPECT_THROW(gpu::emulate::scale_and_norm_partial(gpu::make_plan(v), 1.0f, 8), Error)
      << "too few threads would break the certified error bound";
}

TEST(GpuExecutor, AccumulateMatchesTheReference) {
  std::uint32_t seed = 50;
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    for (bool copy : {false, true}) {
      const Data src = make_data(d, seed++);
      const Data acc_src = make_data(DType::f32, seed++);
      Data ref_acc = acc_src, got_acc = acc_src;
      std::vector<AccumulatePair> pairs;
      std::vector<ConstTensorView> sources;
      for (std::size_t k = 0; k < src.views.size(); ++k) {
        pairs.push_back({ref_acc.views[k], src.views[k], copy});
        sources.push_back(src.views[k]);
      }
      reference::accumulate(pairs);
      gpu::emulate::accumulate(gpu::make_plan(got_acc.views, sources, 5, 3), copy, 128);
      for (std::size_t k = 0; k < ref_acc.bufs.size(); ++k)
        ASSERT_EQ(got_acc.bufs[k], ref_acc.bufs[k]) << k;
    }
  }
}

TEST(GpuExecutor, AdamWMatchesTheReferenceForTwoLaunchShapes) {
  const auto sizes = sizes_with_empty();
  std::uint32_t seed = 200;
  for (DType gd : {DType::f32, DType::bf16, DType::f16}) {
    for (int out : {0, 1, 2, 3}) {
      for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch}) {
        SCOPED_TRACE(std::string(dtype_name(gd)) + " out " + std::to_string(out) +
                     (f == AdamWFormula::torch ? " torch" : " native"));
        AdamWConfig cfg;
        cfg.formula = f;
        cfg.weight_decay = out % 2 ? 0.1 : 0.0;
        cfg.beta1 = out == 3 ? 0.3 : 0.9;
        const std::vector<double> bias = gpu::make_optimizer_table(cfg);
        const float scale = 1.0f / 3001.0f, clip = out == 2 ? 0.37f : 1.0f;
        // One model, three copies: reference, and two launch shapes of the executor.
        const Data grads = make_data(gd, seed++);
        std::mt19937 rng(seed++);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        struct State {
          std::vector<std::vector<float>> p, m, v;
          std::vector<std::vector<std::uint8_t>> o;
          std::vector<float> steps;
        } base;
        for (std::size_t n : sizes) {
          base.p.emplace_back(n);
          base.m.emplace_back(n);
          base.v.emplace_back(n);
          for (std::size_t i = 0; i < n; ++i) {
            base.p.back()[i] = nd(rng) * 0.05f;
            base.m.back()[i] = nd(rng) * 1e-3f;
            base.v.back()[i] = std::abs(nd(rng)) * 1e-6f;
          }
          base.o.emplace_back(n * 4 + 1, 0xCD);
          base.steps.push_back(static_cast<float>(rng() % 4));
        }
        auto tensors = [&](State& st) {
          std::vector<OptimizerTensor> t;
          for (std::size_t k = 0; k < sizes.size(); ++k) {
            OptimizerTensor a;
            a.param = {st.p[k].data(), sizes[k], DType::f32};
            a.state[0] = {st.m[k].data(), sizes[k], DType::f32};
            a.state[1] = {st.v[k].data(), sizes[k], DType::f32};
            a.step = &st.steps[k];
            a.grad = grads.views[k];
            if (out) a.compute_param = {st.o[k].data(), sizes[k], static_cast<DType>(out - 1)};
            t.push_back(a);
          }
          return t;
        };
        State ref = base;
        auto rt = tensors(ref);
        reference::adamw_step(rt, cfg, GradientRead{scale, clip});
        {  // the CPU engine gives the reference's bits too: CPU = GPU executor = reference
          State eng = base;
          auto et = tensors(eng);
          cpu::Engine({.threads = 2}).step(et, cfg, GradientRead{scale, clip});
          for (std::size_t k = 0; k < sizes.size(); ++k) {
            if (sizes[k] != 0)
              ASSERT_EQ(std::memcmp(eng.p[k].data(), ref.p[k].data(), sizes[k] * 4), 0)
                  << "engine param " << k;
            ASSERT_EQ(eng.o[k], ref.o[k]) << "engine compute copy " << k;
          }
        }
        struct Shape {
          int max_blocks, max_tensors, threads;
        };
        for (const Shape shape :
             {Shape{gpu::kMaxOptimizerBlocksPerLaunch, gpu::kMaxOptimizerTensorsPerLaunch, 256},
              Shape{3, 2, 64}}) {
          State got = base;
          auto gt = tensors(got);
          const auto plan =
              gpu::make_optimizer_plan<AdamWUnit>(gt, cfg, shape.max_blocks, shape.max_tensors);
          gpu::emulate::optimizer_step(
              plan, OptimizerDeviceArgs{&scale, &clip, nullptr, nullptr, bias.data()},
              shape.threads);
          for (std::size_t k = 0; k < sizes.size(); ++k) {
            if (sizes[k] != 0) {  // memcmp on bits; empty vectors have no data pointer
              ASSERT_EQ(std::memcmp(got.p[k].data(), ref.p[k].data(), sizes[k] * 4), 0)
                  << "param " << k;
              ASSERT_EQ(std::memcmp(got.m[k].data(), ref.m[k].data(), sizes[k] * 4), 0)
                  << "exp_avg " << k;
              ASSERT_EQ(std::memcmp(got.v[k].data(), ref.v[k].data(), sizes[k] * 4), 0)
                  << "exp_avg_sq " << k;
            }
            ASSERT_EQ(got.o[k], ref.o[k]) << "compute copy " << k;
            ASSERT_EQ(got.steps[k], ref.steps[k]);
          }
        }
        // found-inf: nothing written by the kernels.
        State skipped = base;
        auto st = tensors(skipped);
        const auto plan = gpu::make_optimizer_plan<AdamWUnit>(st, cfg);
        const std::int32_t flag = 1;
        gpu::emulate::optimizer_step(
            plan, OptimizerDeviceArgs{&scale, &clip, &flag, nullptr, bias.data()});
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          ASSERT_EQ(skipped.p[k], base.p[k]);
          ASSERT_EQ(skipped.steps[k], base.steps[k]) << "a skipped step keeps its counter";
        }
      }
    }
  }
}

// Out-of-place steps through the block bodies: the old state loaded from sources, the
// new one stored to destinations pre-filled with NaN garbage. Every tensor out of place
// (all pointers 16-byte aligned: the grouped path), then a mix in one call of in-place,
// out-of-place, param-only and explicitly in-place (source = destination) tensors whose
// destinations are misaligned every other time (the one-element path). The expectation:
// the reference stepping a copy of the sources in place; the sources stay bit for bit.
TEST(GpuExecutor, OutOfPlaceStepsGiveTheInPlaceBitsAndLeaveTheSourcesIntact) {
  enum class Source { in_place, separate, param_only, self };
  const auto sizes = sizes_with_empty();
  const std::uint32_t garbage[] = {0x7FC0DEADu, 0xFFBADBADu, 0x7F800001u, 0xFFFFFFFFu};
  struct State {
    std::vector<std::vector<float>> p, m, v;
    std::vector<std::vector<std::uint8_t>> o;
    std::vector<float> steps;
  };
  struct Layout {
    std::vector<Source> modes;
    std::vector<std::size_t> offset;  // of each destination, in floats
  } all, mixed;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    all.modes.push_back(Source::separate);
    all.offset.push_back(0);
    mixed.modes.push_back(static_cast<Source>(k % 4));
    mixed.offset.push_back((k / 4) % 2);
  }
  std::uint32_t seed = 700;
  for (DType gd : {DType::bf16, DType::f16, DType::f32}) {
    for (int out : {0, 1 + static_cast<int>(DType::bf16), 1 + static_cast<int>(DType::f32)}) {
      for (int opt = 0; opt < 3; ++opt) {  // AdamW native, AdamW torch, SignSGD
        const bool adamw = opt < 2;
        SCOPED_TRACE(std::string(dtype_name(gd)) + " out " + std::to_string(out) +
                     (opt == 0   ? " adamw native"
                      : opt == 1 ? " adamw torch"
                                 : " sign_sgd"));
        AdamWConfig cfg;
        cfg.formula = opt == 0 ? AdamWFormula::native : AdamWFormula::torch;
        cfg.weight_decay = seed % 2 ? 0.1 : 0.0;
        cfg.beta1 = seed % 3 == 0 ? 0.3 : 0.9;
        const SignSgdConfig scfg{1e-3, seed % 2 ? 0.05 : 0.0};
        const std::vector<double> bias = gpu::make_optimizer_table(cfg);
        const float scale = 1.0f / 3001.0f, clip = seed % 4 == 1 ? 0.37f : 1.0f;
        const Data grads = make_data(gd, seed++);
        std::mt19937 rng(seed++);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        State base;
        for (std::size_t n : sizes) {
          base.p.emplace_back(n);
          base.m.emplace_back(n);
          base.v.emplace_back(n);
          for (std::size_t i = 0; i < n; ++i) {
            base.p.back()[i] = nd(rng) * 0.05f;
            base.m.back()[i] = nd(rng) * 1e-3f;
            base.v.back()[i] = std::abs(nd(rng)) * 1e-6f;
          }
          base.o.emplace_back(n * 4 + 1, 0xCD);
          base.steps.push_back(static_cast<float>(rng() % 4));
        }
        auto tensors = [&](State& st) {
          std::vector<OptimizerTensor> t;
          for (std::size_t k = 0; k < sizes.size(); ++k) {
            OptimizerTensor a;
            a.param = {st.p[k].data(), sizes[k], DType::f32};
            a.state[0] = {st.m[k].data(), sizes[k], DType::f32};
            a.state[1] = {st.v[k].data(), sizes[k], DType::f32};
            a.step = &st.steps[k];
            a.grad = grads.views[k];
            if (out) a.compute_param = {st.o[k].data(), sizes[k], static_cast<DType>(out - 1)};
            t.push_back(a);
          }
          return t;
        };
        auto sgd = [](const std::vector<OptimizerTensor>& t) {
          std::vector<OptimizerTensor> s;
          for (const OptimizerTensor& a : t)
            s.push_back(sign_sgd_tensor(a.param, a.grad, a.compute_param));
          return s;
        };
        State ref = base;
        if (adamw) {
          auto rt = tensors(ref);
          reference::adamw_step(rt, cfg, GradientRead{scale, clip});
        } else {
          reference::sign_sgd_step(sgd(tensors(ref)), scfg);
        }
        struct Shape {
          int max_blocks, max_tensors, threads;
        };
        for (const Layout* layout : {&all, &mixed}) {
          for (const Shape shape :
               {Shape{gpu::kMaxOptimizerBlocksPerLaunch, gpu::kMaxOptimizerTensorsPerLaunch, 256},
                Shape{3, 2, 64}}) {
            SCOPED_TRACE(std::string(layout == &all ? "all out of place" : "mixed") + " threads " +
                         std::to_string(shape.threads));
            // Destinations: garbage, one spare element for the misaligned start.
            std::vector<std::vector<float>> dst[3];
            for (auto& d : dst)
              for (std::size_t n : sizes) {
                d.emplace_back(n + 1);
                for (std::size_t i = 0; i <= n; ++i) d.back()[i] = f32_from_bits(garbage[i % 4]);
              }
            const auto fresh = dst[0];  // the garbage of every tensor (all three alike)
            State got = base;
            auto t = tensors(got);
            for (std::size_t k = 0; k < t.size(); ++k) {
              const Source mode = layout->modes[k];
              auto move = [&](TensorView& to, ConstTensorView& from, std::vector<float>& d) {
                from = to;
                to = {d.data() + layout->offset[k], sizes[k], DType::f32};
              };
              if (mode == Source::self) {
                t[k].param_src = t[k].param;
                t[k].state_src[0] = t[k].state[0];
                t[k].state_src[1] = t[k].state[1];
              }
              if (mode == Source::separate || mode == Source::param_only)
                move(t[k].param, t[k].param_src, dst[0][k]);
              if (mode == Source::separate) {
                move(t[k].state[0], t[k].state_src[0], dst[1][k]);
                move(t[k].state[1], t[k].state_src[1], dst[2][k]);
              }
            }
            if (adamw) {
              gpu::emulate::optimizer_step(
                  gpu::make_optimizer_plan<AdamWUnit>(t, cfg, shape.max_blocks, shape.max_tensors),
                  OptimizerDeviceArgs{&scale, &clip, nullptr, nullptr, bias.data()}, shape.threads);
            } else {
              std::vector<OptimizerTensor> st = sgd(t);
              for (std::size_t k = 0; k < t.size(); ++k) st[k].param_src = t[k].param_src;
              gpu::emulate::optimizer_step(gpu::make_optimizer_plan<SignSgdUnit>(
                                               st, scfg, shape.max_blocks, shape.max_tensors),
                                           OptimizerDeviceArgs{}, shape.threads);
            }
            for (std::size_t k = 0; k < sizes.size(); ++k) {
              const std::size_t n = sizes[k], off = layout->offset[k];
              const Source mode = layout->modes[k];
              const bool moved[3] = {mode == Source::separate || mode == Source::param_only,
                                     adamw && mode == Source::separate,
                                     adamw && mode == Source::separate};
              const std::vector<float>* own[3] = {&got.p[k], &got.m[k], &got.v[k]};
              const std::vector<float>* in[3] = {&base.p[k], &base.m[k], &base.v[k]};
              const std::vector<float>* want[3] = {&ref.p[k], &ref.m[k], &ref.v[k]};
              for (int b = 0; b < 3; ++b) {
                SCOPED_TRACE("tensor " + std::to_string(k) + " buffer " + std::to_string(b) +
                             " mode " + std::to_string(static_cast<int>(mode)));
                // A destination: the reference's bits where it was written, garbage around
                // them (and everywhere when unused).
                std::vector<float> d_want = fresh[k];
                if (moved[b]) std::copy(want[b]->begin(), want[b]->end(), d_want.begin() + off);
                ASSERT_EQ(std::memcmp(dst[b][k].data(), d_want.data(), (n + 1) * 4), 0);
                // The model's own buffer: the input where it was a source, else the result.
                if (n != 0)
                  ASSERT_EQ(
                      std::memcmp(own[b]->data(), (moved[b] ? in[b] : want[b])->data(), n * 4), 0);
              }
              ASSERT_EQ(got.o[k], ref.o[k]) << "compute copy " << k;
              ASSERT_EQ(got.steps[k], ref.steps[k]);
            }
          }
        }
      }
    }
  }
}

// A plan is built once and replayed, as a captured CUDA graph is: each replay must take
// the step its device counter is at and the lr in device memory at replay time, and a
// replay with found-inf must leave everything, counters included, as it was (no
// rollback). Both formulas, aligned and misaligned tensors (the 16-byte and the
// one-element paths), against the reference stepping with each replay's lr.
TEST(GpuExecutor, AReplayedAdamWPlanTakesEachStepsCounterAndLearningRate) {
  const std::vector<std::size_t> sizes{1, 33, 1025, gpu::kBlockElements + 7};
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch}) {
    for (std::size_t offset : {std::size_t{0}, std::size_t{1}}) {
      SCOPED_TRACE(std::string(f == AdamWFormula::torch ? "torch" : "native") + " offset " +
                   std::to_string(offset));
      AdamWConfig cfg;
      cfg.formula = f;
      cfg.weight_decay = 0.05;
      const std::vector<double> bias = gpu::make_optimizer_table(cfg);
      std::mt19937 rng(17);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      struct State {
        std::vector<std::vector<float>> p, m, v;
        std::vector<std::vector<std::uint16_t>> g, o;
        std::vector<float> steps;
      } ref, got;
      for (std::size_t n : sizes) {
        ref.p.emplace_back(n + offset);
        ref.m.emplace_back(n + offset);
        ref.v.emplace_back(n + offset);
        ref.g.emplace_back(n + offset);
        ref.o.emplace_back(n + offset);
        for (std::size_t i = 0; i < n + offset; ++i) {
          ref.p.back()[i] = nd(rng) * 0.05f;
          ref.g.back()[i] = f32_to_bf16_bits(nd(rng));
        }
        ref.steps.push_back(0.0f);
      }
      got = ref;
      auto tensors = [&](State& st) {
        std::vector<OptimizerTensor> t;
        for (std::size_t k = 0; k < sizes.size(); ++k)
          t.push_back({{st.p[k].data() + offset, sizes[k], DType::f32},
                       {TensorView{st.m[k].data() + offset, sizes[k], DType::f32},
                        TensorView{st.v[k].data() + offset, sizes[k], DType::f32}},
                       &st.steps[k],
                       {st.g[k].data() + offset, sizes[k], DType::bf16},
                       {st.o[k].data() + offset, sizes[k], DType::bf16}});
        return t;
      };
      auto gt = tensors(got);
      const gpu::OptimizerPlan<AdamWUnit> plan =
          gpu::make_optimizer_plan<AdamWUnit>(gt, cfg, 3, 2);  // built once
      const float scale = 0.25f, clip = 1.0f;
      StepHyper hyper{};  // "device memory" the replays read
      std::int32_t found_inf = 0;
      const double lrs[] = {1e-3, 4e-4, 7e-3, 2e-3};
      const std::int32_t flags[] = {0, 0, 1, 0};
      for (int r = 0; r < 4; ++r) {
        hyper = StepHyper{lrs[r], cfg.weight_decay};
        found_inf = flags[r];
        gpu::emulate::optimizer_step(
            plan, OptimizerDeviceArgs{&scale, &clip, &found_inf, &hyper, bias.data()});
        if (flags[r] == 0) {
          AdamWConfig step_cfg = cfg;
          step_cfg.lr = lrs[r];
          auto rt = tensors(ref);
          reference::adamw_step(rt, step_cfg, GradientRead{scale, clip});
        }
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          ASSERT_EQ(got.steps[k], ref.steps[k]) << "replay " << r << " tensor " << k;
          ASSERT_EQ(std::memcmp(got.p[k].data(), ref.p[k].data(), got.p[k].size() * 4), 0)
              << "replay " << r << " param " << k;
          ASSERT_EQ(std::memcmp(got.m[k].data(), ref.m[k].data(), got.m[k].size() * 4), 0);
          ASSERT_EQ(std::memcmp(got.v[k].data(), ref.v[k].data(), got.v[k].size() * 4), 0);
          ASSERT_EQ(got.o[k], ref.o[k]) << "replay " << r << " compute copy " << k;
        }
      }
      EXPECT_EQ(got.steps[0], 3.0f) << "three steps taken, one skipped";
    }
  }
}

// One step "captured" once and replayed, as a CUDA graph is: the plans and every
// launch's arguments are built once and kept by value (what a graph's kernel nodes hold),
// then each replay runs them after new gradients, a new gradient scale and a new lr were
// written to "device memory" (the norm then gives a new clip coefficient). Eager (scale in
// place, then AdamW with scale 1) and lazy (the read applies scale and clip) sequences,
// against eager reference steps with each replay's values, bit for bit: a scale captured
// as a kernel argument would give the first replay's norm, clip and update every time.
TEST(GpuExecutor, AReplayedStepReadsEachReplaysScaleLearningRateAndClip) {
  const std::vector<std::size_t> sizes{1, 33, 1025, gpu::kBlockElements + 7};
  const float scales[] = {1.0f / 4099.0f, 1.0f / 37.0f, 1.0f / 1000.0f, 0.75f};
  const double lrs[] = {1e-3, 3e-4, 2e-3, 5e-4};
  const float max_norm = 1.0f;
  for (bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "lazy");
    AdamWConfig cfg;
    cfg.weight_decay = 0.1;
    const std::vector<double> bias = gpu::make_optimizer_table(cfg);
    struct State {
      std::vector<std::vector<float>> p, m, v;
      std::vector<std::vector<std::uint16_t>> g;
      std::vector<float> steps;
    } ref, got;
    std::mt19937 rng(23);
    std::normal_distribution<float> nd(0.0f, 4.0f);
    for (std::size_t n : sizes) {
      ref.p.emplace_back(n);
      ref.m.emplace_back(n);
      ref.v.emplace_back(n);
      ref.g.emplace_back(n);
      for (float& x : ref.p.back()) x = nd(rng) * 0.01f;
      ref.steps.push_back(0.0f);
    }
    got = ref;
    auto grads = [&](State& st) {
      std::vector<TensorView> t;
      for (std::size_t k = 0; k < sizes.size(); ++k)
        t.push_back({st.g[k].data(), sizes[k], DType::bf16});
      return t;
    };
    auto tensors = [&](State& st) {
      std::vector<OptimizerTensor> t;
      for (std::size_t k = 0; k < sizes.size(); ++k)
        t.push_back({f32_view(st.p[k].data(), sizes[k]),
                     {f32_view(st.m[k].data(), sizes[k]), f32_view(st.v[k].data(), sizes[k])},
                     &st.steps[k],
                     {st.g[k].data(), sizes[k], DType::bf16},
                     {}});
      return t;
    };

    // "Device memory" the replays read and write.
    float scale = 0.0f, clip = 0.0f;
    const float one = 1.0f;
    std::int32_t flag = 0;
    StepHyper hyper{};
    NormPartial partial, exact;
    NormResult result;

    // The capture: plans (several launches each) and by-value arguments, built once.
    const std::vector<TensorView> gv = grads(got);
    const gpu::LaunchPlan norm_plan = gpu::make_plan(gv, {}, 3, 2);
    const gpu::OptimizerPlan<AdamWUnit> adamw_plan =
        gpu::make_optimizer_plan<AdamWUnit>(tensors(got), cfg, 3, 2);
    const DeviceGradientRead read{eager ? &one : &scale, &one};
    const OptimizerDeviceArgs d{eager ? &one : &scale, &clip, &flag, &hyper, bias.data()};
    std::vector<std::function<void()>> graph;
    if (eager)
      graph.emplace_back([&partial, norm_plan, d_scale = &scale] {
        partial = gpu::emulate::scale_and_norm_partial(norm_plan, d_scale);
      });
    else
      graph.emplace_back(
          [&partial, norm_plan, read] { partial = gpu::emulate::norm_partial(norm_plan, read); });
    graph.emplace_back(
        [&, max_norm] { gpu::emulate::finalize_and_clip(partial, max_norm, result, clip, flag); });
    graph.emplace_back([&exact, &flag, norm_plan, read] {
      exact = gpu::emulate::exact_norm_partial_if_needed(norm_plan, read, flag);
    });
    graph.emplace_back([&, max_norm] {
      gpu::emulate::finalize_exact_and_clip(exact, max_norm, result, clip, flag);
    });
    graph.emplace_back([adamw_plan, d] { gpu::emulate::optimizer_step(adamw_plan, d); });

    std::vector<float> clips;
    for (int r = 0; r < 4; ++r) {
      // Backward writes new gradients; the trainer writes the step's scale and lr.
      for (std::size_t k = 0; k < sizes.size(); ++k)
        for (std::uint16_t& x : ref.g[k]) x = f32_to_bf16_bits(nd(rng));
      got.g = ref.g;
      scale = scales[r];
      hyper = StepHyper{lrs[r], cfg.weight_decay};
      for (const auto& node : graph) node();

      // The eager reference step with this replay's values.
      std::vector<TensorView> rg = grads(ref);
      std::vector<ConstTensorView> rc(rg.begin(), rg.end());
      GradientRead norm_read{scales[r], 1.0f};
      if (eager) {
        reference::scale_(rg, scales[r]);
        norm_read = GradientRead{};
      }
      const NormResult n = finalize(reference::norm_partial(rc, norm_read));
      ASSERT_TRUE(n.finite);
      const float coef = (1.0f / (n.norm + 1e-6f)) * max_norm;
      const float want_clip = coef < 1.0f ? coef : 1.0f;
      AdamWConfig step_cfg = cfg;
      step_cfg.lr = lrs[r];
      reference::adamw_step(tensors(ref), step_cfg,
                            GradientRead{eager ? 1.0f : scales[r], want_clip});

      ASSERT_EQ(flag, gpu::kFoundInfNone) << "replay " << r;
      ASSERT_EQ(f32_bits(result.norm), f32_bits(n.norm)) << "replay " << r;
      ASSERT_EQ(f32_bits(clip), f32_bits(want_clip)) << "replay " << r;
      clips.push_back(clip);
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        ASSERT_EQ(got.g[k], ref.g[k]) << "replay " << r << " gradient " << k;
        ASSERT_EQ(got.steps[k], ref.steps[k]) << "replay " << r << " tensor " << k;
        ASSERT_EQ(std::memcmp(got.p[k].data(), ref.p[k].data(), sizes[k] * 4), 0)
            << "replay " << r << " param " << k;
        ASSERT_EQ(std::memcmp(got.m[k].data(), ref.m[k].data(), sizes[k] * 4), 0);
        ASSERT_EQ(std::memcmp(got.v[k].data(), ref.v[k].data(), sizes[k] * 4), 0);
      }
    }
    // The replays really differ: an unclipped step and three different clipped ones.
    EXPECT_EQ(clips[0], 1.0f);
    EXPECT_LT(clips[1], 1.0f);
    EXPECT_LT(clips[2], 1.0f);
    EXPECT_NE(clips[1], clips[2]);
    EXPECT_NE(clips[2], clips[3]);
    EXPECT_EQ(got.steps[0], 4.0f);
  }
}

// The same for SignSGD: the lr of each replay is read when it runs.
TEST(GpuExecutor, AReplayedSignSgdPlanTakesEachReplaysLearningRate) {
  std::vector<float> p_ref(1031), p_got;
  std::vector<float> g(1031);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::size_t i = 0; i < g.size(); ++i) {
    p_ref[i] = nd(rng);
    g[i] = nd(rng);
  }
  p_got = p_ref;
  const SignSgdConfig cfg{1e-3, 0.1};
  const std::vector<OptimizerTensor> gt{
      sign_sgd_tensor(f32_view(p_got.data(), p_got.size()), const_view(g.data(), g.size()))};
  const auto plan = gpu::make_optimizer_plan<SignSgdUnit>(gt, cfg);
  for (double lr : {1e-3, 3e-2, 5e-4}) {
    const StepHyper hyper{lr, 0.1};
    gpu::emulate::optimizer_step(plan, OptimizerDeviceArgs{nullptr, nullptr, nullptr, &hyper});
    const std::vector<OptimizerTensor> rt{
        sign_sgd_tensor(f32_view(p_ref.data(), p_ref.size()), const_view(g.data(), g.size()))};
    reference::sign_sgd_step(rt, SignSgdConfig{lr, 0.1});
    ASSERT_EQ(std::memcmp(p_got.data(), p_ref.data(), p_ref.size() * 4), 0) << "lr " << lr;
  }
}

// The bias table holds exactly the host's corrections, and every step past its end has a
// correction of exactly 1 (checked well past it).
TEST(GpuPlan, TheBiasTableHoldsTheHostsCorrectionsAndEndsWhereTheyReachOne) {
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch}) {
    for (double beta2 : {0.999, 0.95, 0.0}) {
      AdamWConfig cfg;
      cfg.formula = f;
      cfg.beta2 = beta2;
      const std::vector<double> table = gpu::make_optimizer_table(cfg);
      const auto len1 = static_cast<std::size_t>(table[0]);
      const auto len2 = static_cast<std::size_t>(table[1]);
      ASSERT_EQ(table.size(), 2 + len1 + len2);
      for (std::size_t t = 1; t <= std::max(len1, len2) + 2000; ++t) {
        // The independent expectation: 1 - beta^t with the formula's betas, in binary64.
        const bool native = f == AdamWFormula::native;
        const double b1 = native ? static_cast<float>(cfg.beta1) : cfg.beta1;
        const double b2 = native ? static_cast<float>(cfg.beta2) : cfg.beta2;
        const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
        const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
        ASSERT_EQ(t <= len1 ? table[2 + t - 1] : 1.0, bc1) << "t " << t;
        ASSERT_EQ(t <= len2 ? table[2 + len1 + t - 1] : 1.0, bc2) << "t " << t;
      }
      if (beta2 == 0.999) EXPECT_GT(len2, 30000u);
      if (beta2 == 0.0) EXPECT_EQ(len2, 0u);
    }
  }
  AdamWConfig near_one;
  near_one.beta2 = 1.0 - 1e-7;
  try {
    (void)gpu::make_optimizer_table(near_one);
    ADD_FAILURE() << "a beta this close to 1 needs more than 2^22 table entries";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::not_supported);
    EXPECT_EQ(e.argument(), "config.beta2");
  }
}

// The exact fallback's partial equals the reference's exact partial digit for digit
// (not only after rounding), for every dtype, two launch shapes and a scaled read.
TEST(GpuExecutor, ExactPassEqualsTheReferencePartial) {
  std::uint32_t seed = 300;
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    for (const GradientRead read : {GradientRead{}, GradientRead{0.3f, 0.37f}}) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " scale " + std::to_string(read.scale));
      Data data = make_data(d, seed++);
      const std::vector<ConstTensorView> cv(data.views.begin(), data.views.end());
      const NormPartial ref = reference::norm_partial(cv, read);
      ASSERT_EQ(ref.approximate, 0u);
      for (const auto& [max_blocks, threads] :
           {std::pair{gpu::kMaxBlocksPerLaunch, 256}, std::pair{5, 32}}) {
        const gpu::LaunchPlan plan = gpu::make_plan(data.views, {}, max_blocks, 3);
        const NormPartial p = gpu::emulate::exact_norm_partial_if_needed(
            plan, read, gpu::kFoundInfNeedsExact, threads);
        EXPECT_EQ(p.approximate, 0u);
        EXPECT_TRUE(same_value(p, ref));
        EXPECT_EQ(std::memcmp(p.digits, ref.digits, sizeof p.digits), 0)
            << "both normalised: the digits must be identical";
        // Without the flag the pass is a no-op returning the zero partial.
        for (std::int32_t flag : {gpu::kFoundInfNone, gpu::kFoundInfNonFinite}) {
          const NormPartial z =
              gpu::emulate::exact_norm_partial_if_needed(plan, read, flag, threads);
          EXPECT_TRUE(same_value(z, NormPartial{}));
        }
      }
    }
  }
}

// A norm whose exact value is a rounding tie: the fast pass cannot certify it (flag 2),
// the exact pass resolves it to round-half-even, as the reference does.
TEST(GpuExecutor, ExactFallbackResolvesATie) {
  // Squares summing to (2^25 + 2)^2: sqrt(S) = 2^25 + 2 exactly, the midpoint of the
  // floats 2^25 and 2^25 + 4.
  std::vector<float> x = {16777216.0f, 16777216.0f, 16777216.0f, 16777216.0f,
                          8192.0f,     8192.0f,     2.0f};
  // Independent expectation: 4 * 2^48 + 2 * 2^26 + 4 = 2^50 + 2^27 + 4 = (2^25 + 2)^2.
  const double s = 4.0 * std::ldexp(1.0, 48) + 2.0 * std::ldexp(1.0, 26) + 4.0;
  ASSERT_EQ(s, (std::ldexp(1.0, 25) + 2.0) * (std::ldexp(1.0, 25) + 2.0));
  const float expected = 33554432.0f;  // 2^25 + 2 ties to the even float 2^25
  for (float max_norm : {1.0f, 1e9f}) {
    std::vector<float> g = x;
    // Spread over three tensors with an empty one in the middle.
    const std::vector<TensorView> v{
        {g.data(), 3, DType::f32}, {g.data() + 3, 0, DType::f32}, {g.data() + 3, 4, DType::f32}};
    const gpu::LaunchPlan plan = gpu::make_plan(v);
    const NormPartial fast = gpu::emulate::scale_and_norm_partial(plan, 1.0f);
    NormResult r;
    float clip = -1.0f;
    std::int32_t flag = -1;
    gpu::emulate::finalize_and_clip(fast, max_norm, r, clip, flag);
    ASSERT_EQ(flag, gpu::kFoundInfNeedsExact);
    const NormPartial exact = gpu::emulate::exact_norm_partial_if_needed(plan, {}, flag);
    gpu::emulate::finalize_exact_and_clip(exact, max_norm, r, clip, flag);
    EXPECT_EQ(flag, gpu::kFoundInfNone);
    EXPECT_FALSE(r.needs_exact);
    EXPECT_EQ(f32_bits(r.norm), f32_bits(expected));
    const float coef = (1.0f / (expected + 1e-6f)) * max_norm;  // torch's clip_grad_norm_
    const float want_clip = coef < 1.0f ? coef : 1.0f;
    EXPECT_EQ(f32_bits(clip), f32_bits(want_clip));
    // A flag other than 2 leaves the fast pass's results alone.
    NormResult kept = r;
    float kept_clip = clip;
    std::int32_t none = gpu::kFoundInfNone;
    gpu::emulate::finalize_exact_and_clip(NormPartial{}, max_norm, kept, kept_clip, none);
    EXPECT_EQ(f32_bits(kept.norm), f32_bits(r.norm));
    EXPECT_EQ(f32_bits(kept_clip), f32_bits(clip));
  }
}

// The CUDA entry points check everything that needs no device (shapes, workspace size,
// null pointers) before any CUDA call, so these errors are the same with or without a
// device; pointers the runtime cannot vouch for are refused. Nothing is written.
TEST(GpuApi, BadInputIsRefusedBeforeAnythingIsWritten) {
  if (!cuda::built_with_cuda()) GTEST_SKIP() << cuda::unavailable_reason();
  std::vector<float> g(100, 0.5f);
  const std::vector<float> before = g;
  const std::vector<TensorView> v{{g.data(), g.size(), DType::f32}};
  NormPartial partial;
  partial.digits[0] = 77;  // a canary: must stay
  alignas(64) unsigned char ws[sizeof(NormPartial)];
  auto expect_error = [&](auto&& call, Errc code, const std::string& argument) {
    test_support::expect_error(call, code, argument);
    EXPECT_EQ(std::memcmp(g.data(), before.data(), g.size() * sizeof(float)), 0);
    EXPECT_EQ(partial.digits[0], 77u);
  };
  ASSERT_EQ(gpu::scale_and_norm_workspace_bytes(v), sizeof(NormPartial));
  expect_error([&] { gpu::scale_and_norm_partial(v, 0.5f, &partial, ws, 10, nullptr); },
               Errc::out_of_range, "workspace_bytes");
  expect_error([&] { gpu::scale_and_norm_partial(v, 0.5f, nullptr, ws, sizeof ws, nullptr); },
               Errc::null_pointer, "d_partial");
  expect_error([&] { gpu::scale_and_norm_partial(v, NAN, &partial, ws, sizeof ws, nullptr); },
               Errc::non_finite, "scale");
  // Host memory where device memory is needed (with or without a device).
  expect_error([&] { gpu::scale_and_norm_partial(v, 0.5f, &partial, ws, sizeof ws, nullptr); },
               Errc::invalid_argument, "d_partial");
  const std::vector<TensorView> bad_dtype{{g.data(), g.size(), static_cast<DType>(9)}};
  expect_error(
      [&] { gpu::scale_and_norm_partial(bad_dtype, 0.5f, &partial, ws, 1 << 20, nullptr); },
      Errc::unsupported_dtype, "tensors[0]");
  // AdamW: a size mismatch is found before the device pointers are looked at.
  std::vector<float> p(100), m(50), vv(100);
  float step = 0.0f;
  const std::vector<OptimizerTensor> adamw{{f32_view(p.data(), 100),
                                            {f32_view(m.data(), 50), f32_view(vv.data(), 100)},
                                            &step,
                                            const_view(g.data(), 100),
                                            {}}};
  float scale = 1.0f, clip = 1.0f;
  const std::vector<double> bias = gpu::make_optimizer_table(AdamWConfig{});
  expect_error(
      [&] {
        gpu::optimizer_step(adamw, AdamWConfig{},
                            OptimizerDeviceArgs{&scale, &clip, nullptr, nullptr, bias.data()},
                            nullptr);
      },
      Errc::size_mismatch, "tensors[0].exp_avg");
  EXPECT_EQ(step, 0.0f) << "the step counter must not advance on an error";
  expect_error([&] { gpu::finalize_and_clip(&partial, -1.0f, nullptr, nullptr, nullptr, nullptr); },
               Errc::invalid_argument, "max_norm");
}

// The launchers' pointer rule (check_pointer_device), decided on what the runtime says
// of a pointer: memory of the launch's device or managed memory passes; another device's
// memory, host memory and a pointer the runtime does not know are refused naming the
// argument, another device's saying which devices.
TEST(GpuPlan, APointerOfAnotherDeviceIsRefusedNamingTheArgument) {
  using gpu::detail::check_pointer_device;
  using gpu::detail::PointerInfo;
  const stepcore::detail::Arg name{"tensors", 3, "grad"};
  EXPECT_NO_THROW(check_pointer_device({PointerInfo::device, 1}, 1, name));
  EXPECT_NO_THROW(check_pointer_device({PointerInfo::managed, 0}, 1, name));
  EXPECT_NO_THROW(check_pointer_device({PointerInfo::managed, -1}, 0, name));
  for (int pointer_device : {0, 2}) {
    try {
      check_pointer_device({PointerInfo::device, pointer_device}, 1, name);
      ADD_FAILURE() << "device " << pointer_device << " memory on a launch on device 1";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_EQ(e.argument(), "tensors[3].grad");
      EXPECT_NE(std::string(e.what()).find("device memory of CUDA device " +
                                           std::to_string(pointer_device) +
                                           ", but the launch runs on device 1"),
                std::string::npos)
          << e.what();
    }
  }
  test_support::expect_error(
      [&] {
        check_pointer_device({PointerInfo::host, -1}, 0, name);
      },
      Errc::invalid_argument, "tensors[3].grad");
  test_support::expect_error(
      [&] {
        check_pointer_device({PointerInfo::unknown, -1}, 0, name);
      },
      Errc::invalid_argument, "tensors[3].grad");
  test_support::expect_error(
      [&] {
        check_pointer_device({PointerInfo::device, 0}, -1, stepcore::detail::Arg{"d_x"});
      },
      Errc::invalid_argument, "d_x");
}

}  // namespace
