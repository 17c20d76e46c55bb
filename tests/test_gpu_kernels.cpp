// GPU: the fused scale + norm kernel on the device against the reference, bit for bit,
// and its bad-input errors. Skips without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "stepcore/convert.hpp"
#include "stepcore/cuda.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/reference.hpp"

#if defined(STEPCORE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using namespace stepcore;

TEST(GpuKernels, ScaleAndNormMatchTheReference) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
#if defined(STEPCORE_WITH_CUDA)
  const std::size_t c = gpu::kBlockElements;
  const std::vector<std::size_t> sizes = {0, 1, 33, 1025, c - 1, c, c + 1, 0, 5 * c + 3, 4000000};
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1e-2f);
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    for (float scale : {1.0f, 1.0f / 4096.0f, 1.0f / 3001.0f}) {
      std::vector<std::vector<std::uint8_t>> host;
      std::vector<TensorView> hv, dv;
      std::vector<void*> dptr;
      for (std::size_t n : sizes) {
        host.emplace_back(n * dtype_size(d));
        for (std::size_t i = 0; i < n; ++i) {
          const float x = nd(rng);
          if (d == DType::f32)
            std::memcpy(host.back().data() + 4 * i, &x, 4);
          else {
            const std::uint16_t h = d == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
            std::memcpy(host.back().data() + 2 * i, &h, 2);
          }
        }
        void* p = nullptr;
        ASSERT_EQ(cudaMalloc(&p, host.back().size() + 1), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(p, host.back().data(), host.back().size(), cudaMemcpyHostToDevice),
                  cudaSuccess);
        dptr.push_back(p);
        dv.push_back({p, n, d});
        hv.push_back({host.back().data(), n, d});
      }
      reference::scale_(hv, scale);
      std::vector<ConstTensorView> cv(hv.begin(), hv.end());
      const NormResult ref = finalize(reference::norm_partial(cv));
      const std::size_t ws = gpu::scale_and_norm_workspace_bytes(dv);
      void* d_ws = nullptr;
      NormPartial* d_partial = nullptr;
      ASSERT_EQ(cudaMalloc(&d_ws, ws + 1), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_partial, sizeof(NormPartial)), cudaSuccess);
      gpu::scale_and_norm_partial(dv, scale, d_partial, d_ws, ws, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      NormPartial p;
      ASSERT_EQ(cudaMemcpy(&p, d_partial, sizeof p, cudaMemcpyDeviceToHost), cudaSuccess);
      NormResult r = finalize(p);
      ASSERT_FALSE(r.needs_exact);
      {  // the device's finalisation and clip coefficient give the host's bits
        NormResult* d_result = nullptr;
        float* d_clip = nullptr;
        std::int32_t* d_flag = nullptr;
        ASSERT_EQ(cudaMalloc(&d_result, sizeof(NormResult)), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_clip, sizeof(float)), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_flag, sizeof(std::int32_t)), cudaSuccess);
        gpu::finalize_and_clip(d_partial, 0.5f, d_result, d_clip, d_flag, nullptr);
        NormResult dr;
        float dclip = 0.0f;
        std::int32_t dflag = -1;
        ASSERT_EQ(cudaMemcpy(&dr, d_result, sizeof dr, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(&dclip, d_clip, sizeof dclip, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(&dflag, d_flag, sizeof dflag, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(f32_bits(dr.norm), f32_bits(r.norm));
        EXPECT_EQ(dflag, 0);
        EXPECT_EQ(f32_bits(dclip), f32_bits(clip_coefficient(r.norm, 0.5f)));
        cudaFree(d_result);
        cudaFree(d_clip);
        cudaFree(d_flag);
      }
      EXPECT_EQ(f32_bits(r.norm), f32_bits(ref.norm)) << dtype_name(d) << " scale " << scale;
      EXPECT_EQ(f32_bits(r.max_abs), f32_bits(ref.max_abs));
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        std::vector<std::uint8_t> back(host[k].size());
        ASSERT_EQ(cudaMemcpy(back.data(), dptr[k], back.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(back, host[k]) << "scaled tensor " << k;
      }
      // Bad input: a workspace too small and a host pointer, each before any write.
      EXPECT_THROW(gpu::scale_and_norm_partial(dv, scale, d_partial, d_ws, ws - 1, nullptr), Error);
      std::vector<TensorView> bad = dv;
      bad.back().data = host.back().data();
      EXPECT_THROW(gpu::scale_and_norm_partial(bad, scale, d_partial, d_ws, ws, nullptr), Error);
      cudaFree(d_ws);
      cudaFree(d_partial);
      for (void* q : dptr) cudaFree(q);
    }
  }
#endif
}

TEST(GpuKernels, AdamWWithLazyScaleAndClipMatchesTheReference) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
#if defined(STEPCORE_WITH_CUDA)
  const std::size_t c = gpu::kBlockElements;
  const std::vector<std::size_t> sizes = {1, 7, 33, c - 1, c + 1, 0, 3 * c + 5, 1000003};
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch}) {
    for (DType gd : {DType::f32, DType::bf16}) {
      AdamWConfig cfg;
      cfg.formula = f;
      const float scale = 1.0f / 3001.0f, clip = 0.61f;
      std::vector<std::vector<float>> p, m, v;
      std::vector<std::vector<std::uint8_t>> g;
      std::vector<std::vector<std::uint16_t>> o;
      std::vector<float> ref_steps, dev_steps;
      for (std::size_t n : sizes) {
        p.emplace_back(n);
        m.emplace_back(n);
        v.emplace_back(n);
        g.emplace_back(n * dtype_size(gd));
        o.emplace_back(n);
        for (std::size_t i = 0; i < n; ++i) {
          p.back()[i] = nd(rng) * 0.05f;
          m.back()[i] = nd(rng) * 1e-3f;
          v.back()[i] = std::abs(nd(rng)) * 1e-6f;
          const float x = nd(rng) * 1e-2f;
          if (gd == DType::f32)
            std::memcpy(g.back().data() + 4 * i, &x, 4);
          else {
            const std::uint16_t h = f32_to_bf16_bits(x);
            std::memcpy(g.back().data() + 2 * i, &h, 2);
          }
        }
        ref_steps.push_back(2.0f);
        dev_steps.push_back(2.0f);
      }
      // Device copies.
      auto up = [](const void* h, std::size_t bytes) {
        void* d = nullptr;
        EXPECT_EQ(cudaMalloc(&d, bytes + 1), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), cudaSuccess);
        return d;
      };
      std::vector<AdamWTensor> ht, dt;
      std::vector<void*> owned;
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::size_t n = sizes[k];
        void* dp = up(p[k].data(), n * 4);
        void* dm = up(m[k].data(), n * 4);
        void* dvv = up(v[k].data(), n * 4);
        void* dg = up(g[k].data(), g[k].size());
        void* dout = up(o[k].data(), n * 2);
        owned.insert(owned.end(), {dp, dm, dvv, dg, dout});
        dt.push_back({{dp, n, DType::f32},
                      {dm, n, DType::f32},
                      {dvv, n, DType::f32},
                      &dev_steps[k],
                      {dg, n, gd},
                      {dout, n, DType::bf16}});
        ht.push_back({{p[k].data(), n, DType::f32},
                      {m[k].data(), n, DType::f32},
                      {v[k].data(), n, DType::f32},
                      &ref_steps[k],
                      {g[k].data(), n, gd},
                      {o[k].data(), n, DType::bf16}});
      }
      float* d_scalars = nullptr;
      ASSERT_EQ(cudaMalloc(&d_scalars, 2 * sizeof(float)), cudaSuccess);
      const float hs[2] = {scale, clip};
      ASSERT_EQ(cudaMemcpy(d_scalars, hs, sizeof hs, cudaMemcpyHostToDevice), cudaSuccess);
      const std::vector<double> bias = gpu::make_adamw_bias_table(cfg);
      auto* d_bias = static_cast<double*>(up(bias.data(), bias.size() * sizeof(double)));
      auto* d_steps = static_cast<float*>(up(dev_steps.data(), dev_steps.size() * 4));
      owned.insert(owned.end(), {d_bias, d_steps});
      for (std::size_t k = 0; k < dt.size(); ++k) dt[k].step = d_steps + k;
      gpu::adamw_step(dt, cfg, AdamWDeviceArgs{d_scalars, d_scalars + 1, nullptr, nullptr, d_bias},
                      nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dev_steps.data(), d_steps, dev_steps.size() * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
      reference::adamw_step(ht, cfg, GradientRead{scale, clip});
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::size_t n = sizes[k];
        std::vector<float> back(n);
        std::vector<std::uint16_t> ob(n);
        cudaMemcpy(back.data(), dt[k].param.data, n * 4, cudaMemcpyDeviceToHost);
        ASSERT_EQ(std::memcmp(back.data(), p[k].data(), n * 4), 0) << "param " << k;
        cudaMemcpy(back.data(), dt[k].exp_avg_sq.data, n * 4, cudaMemcpyDeviceToHost);
        ASSERT_EQ(std::memcmp(back.data(), v[k].data(), n * 4), 0) << "exp_avg_sq " << k;
        cudaMemcpy(ob.data(), dt[k].compute_param.data, n * 2, cudaMemcpyDeviceToHost);
        ASSERT_EQ(ob, o[k]) << "compute copy " << k;
        ASSERT_EQ(dev_steps[k], ref_steps[k]);
      }
      for (void* q : owned) cudaFree(q);
      cudaFree(d_scalars);
    }
  }
#endif
}

}  // namespace
