// GPU launch plans and the CPU executor of the kernels' block bodies (no GPU needed):
// coverage of every element exactly once, launches split by block and tensor limits,
// and the fused scale + norm and accumulate bodies against the reference, bit for bit,
// for two different launch shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "stepcore/convert.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;

std::vector<std::size_t> sizes_with_empty() {
  const std::size_t c = gpu::kChunkElements;
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
          const gpu::BlockTask& task = a.tasks[b];
          ASSERT_LT(task.tensor, a.num_tensors);
          const void* data = a.data[task.tensor];
          std::size_t t = 0;
          while (views[t].data != data || views[t].numel == 0) ++t;
          ASSERT_LE(task.end - task.begin, gpu::kChunkElements);
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
  // Nothing is executed: the plan is plain data over a fake pointer.
  const std::uint64_t n = (std::uint64_t{1} << 31) + 5;
  const std::vector<TensorView> views{{reinterpret_cast<void*>(0x1000), n, DType::bf16}};
  const gpu::LaunchPlan plan = gpu::make_plan(views);
  std::uint64_t covered = 0, last_end = 0;
  for (const auto& a : plan.launches)
    for (int b = 0; b < a.num_blocks; ++b) {
      ASSERT_EQ(a.tasks[b].begin, last_end);
      last_end = a.tasks[b].end;
      covered += a.tasks[b].end - a.tasks[b].begin;
    }
  EXPECT_EQ(covered, n);
  EXPECT_EQ(last_end, n);
  EXPECT_EQ(plan.total_blocks, (n + gpu::kChunkElements - 1) / gpu::kChunkElements);
  EXPECT_GT(plan.launches.size(), 1u);
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
      gpu::emulate::scale(gpu::make_plan(data.views), read.clip);
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
          std::vector<SignSgdTensor> t;
          for (std::size_t k = 0; k < p.views.size(); ++k) {
            SignSgdTensor s{p.views[k], grads.views[k], {}};
            if (out) s.compute_param = {o[k].data(), p.views[k].numel, static_cast<DType>(out - 1)};
            t.push_back(s);
          }
          return t;
        };
        const SignSgdConfig cfg{1e-3, wd};
        auto rt = tensors(ref_p, ref_o);
        reference::sign_sgd_step(rt, cfg);
        auto gt = tensors(got_p, got_o);
        gpu::emulate::sign_sgd(gpu::make_sign_sgd_plan(gt, cfg, 4, 3), nullptr, 64);
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
          std::vector<AdamWTensor> t;
          for (std::size_t k = 0; k < sizes.size(); ++k) {
            AdamWTensor a;
            a.param = {st.p[k].data(), sizes[k], DType::f32};
            a.exp_avg = {st.m[k].data(), sizes[k], DType::f32};
            a.exp_avg_sq = {st.v[k].data(), sizes[k], DType::f32};
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
        struct Shape {
          int max_blocks, max_tensors, threads;
        };
        for (const Shape shape :
             {Shape{gpu::kMaxAdamWBlocksPerLaunch, gpu::kMaxAdamWTensorsPerLaunch, 256},
              Shape{3, 2, 64}}) {
          State got = base;
          auto gt = tensors(got);
          const auto launches = gpu::make_adamw_plan(gt, cfg, shape.max_blocks, shape.max_tensors);
          gpu::emulate::adamw(launches, &scale, &clip, nullptr, shape.threads);
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
        const auto launches = gpu::make_adamw_plan(st, cfg);
        const std::int32_t flag = 1;
        gpu::emulate::adamw(launches, &scale, &clip, &flag);
        for (std::size_t k = 0; k < sizes.size(); ++k) ASSERT_EQ(skipped.p[k], base.p[k]);
      }
    }
  }
}

}  // namespace
