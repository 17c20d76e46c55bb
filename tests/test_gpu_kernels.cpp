// GPU: the fused scale + norm kernel on the device against the reference, bit for bit,
// and its bad-input errors. Skips without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "optimizer_records.hpp"
#include "q8_configs.hpp"
#include "q8_sets.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/reference.hpp"

#if defined(STEPCORE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using namespace stepcore;
using test_support::adamw_tensor;
using test_support::sign_sgd_tensor;

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
      std::vector<OptimizerTensor> ht, dt;
      std::vector<void*> owned;
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::size_t n = sizes[k];
        void* dp = up(p[k].data(), n * 4);
        void* dm = up(m[k].data(), n * 4);
        void* dvv = up(v[k].data(), n * 4);
        void* dg = up(g[k].data(), g[k].size());
        void* dout = up(o[k].data(), n * 2);
        owned.insert(owned.end(), {dp, dm, dvv, dg, dout});
        dt.push_back(adamw_tensor({dp, n, DType::f32}, {dm, n, DType::f32}, {dvv, n, DType::f32},
                                  &dev_steps[k], {dg, n, gd}, {dout, n, DType::bf16}));
        ht.push_back(adamw_tensor({p[k].data(), n, DType::f32}, {m[k].data(), n, DType::f32},
                                  {v[k].data(), n, DType::f32}, &ref_steps[k], {g[k].data(), n, gd},
                                  {o[k].data(), n, DType::bf16}));
      }
      float* d_scalars = nullptr;
      ASSERT_EQ(cudaMalloc(&d_scalars, 2 * sizeof(float)), cudaSuccess);
      const float hs[2] = {scale, clip};
      ASSERT_EQ(cudaMemcpy(d_scalars, hs, sizeof hs, cudaMemcpyHostToDevice), cudaSuccess);
      const std::vector<double> bias = gpu::make_optimizer_table(cfg);
      auto* d_bias = static_cast<double*>(up(bias.data(), bias.size() * sizeof(double)));
      auto* d_steps = static_cast<float*>(up(dev_steps.data(), dev_steps.size() * 4));
      owned.insert(owned.end(), {d_bias, d_steps});
      for (std::size_t k = 0; k < dt.size(); ++k) dt[k].step = d_steps + k;
      gpu::optimizer_step(dt, cfg,
                          OptimizerDeviceArgs{d_scalars, d_scalars + 1, nullptr, nullptr, d_bias},
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
        cudaMemcpy(back.data(), dt[k].state[1].data, n * 4, cudaMemcpyDeviceToHost);
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

// Out of place on the device: even tensors read their old state from separate device
// buffers and write destinations pre-filled with NaN bytes, odd tensors step in place, in
// one call. The destinations (and in-place buffers) must hold the reference's in-place
// bits, the sources their input bits.
TEST(GpuKernels, OutOfPlaceAdamWAndSignSgdMatchTheReference) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
#if defined(STEPCORE_WITH_CUDA)
  const std::size_t c = gpu::kBlockElements;
  const std::vector<std::size_t> sizes = {1, 33, 1025, c - 1, 0, c + 1, 3 * c + 5};
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<void*> owned;
  auto alloc = [&](std::size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, bytes + 16), cudaSuccess);
    EXPECT_EQ(cudaMemset(d, 0xFF, bytes + 16), cudaSuccess);  // NaN garbage
    owned.push_back(d);
    return d;
  };
  auto up = [&](const void* h, std::size_t bytes) {
    void* d = alloc(bytes);
    EXPECT_EQ(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  };
  auto down = [](const void* d, std::size_t bytes) {
    std::vector<std::uint8_t> h(bytes);
    EXPECT_EQ(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  };
  auto bytes_of = [](const std::vector<float>& v) {
    std::vector<std::uint8_t> b(v.size() * 4);
    if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  for (int opt = 0; opt < 3; ++opt) {  // AdamW native, AdamW torch, SignSGD
    SCOPED_TRACE(opt == 0 ? "adamw native" : opt == 1 ? "adamw torch" : "sign_sgd");
    AdamWConfig cfg;
    cfg.formula = opt == 0 ? AdamWFormula::native : AdamWFormula::torch;
    cfg.weight_decay = 0.1;
    const SignSgdConfig scfg{1e-3, 0.05};
    const float scale = 1.0f / 3001.0f, clip = 0.61f;
    // Host state: the input (kept) and the reference's copy (stepped in place).
    std::vector<std::vector<float>> p, m, v;
    std::vector<std::vector<std::uint16_t>> g, o;
    std::vector<float> ref_steps;
    for (std::size_t n : sizes) {
      p.emplace_back(n);
      m.emplace_back(n);
      v.emplace_back(n);
      g.emplace_back(n);
      o.emplace_back(n);
      for (std::size_t i = 0; i < n; ++i) {
        p.back()[i] = nd(rng) * 0.05f;
        m.back()[i] = nd(rng) * 1e-3f;
        v.back()[i] = std::abs(nd(rng)) * 1e-6f;
        g.back()[i] = f32_to_bf16_bits(nd(rng) * 1e-2f);
      }
      ref_steps.push_back(2.0f);
    }
    auto rp = p, rm = m, rv = v;
    auto ro = o;
    std::vector<OptimizerTensor> ht, dt;
    std::vector<OptimizerTensor> hs, ds;
    const std::vector<float> dev_steps_init(sizes.size(), 2.0f);
    auto* d_steps = static_cast<float*>(up(dev_steps_init.data(), sizes.size() * 4));
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t n = sizes[k];
      ht.push_back(adamw_tensor({rp[k].data(), n, DType::f32}, {rm[k].data(), n, DType::f32},
                                {rv[k].data(), n, DType::f32}, &ref_steps[k],
                                {g[k].data(), n, DType::bf16}, {ro[k].data(), n, DType::bf16}));
      hs.push_back(sign_sgd_tensor(ht.back().param, ht.back().grad, ht.back().compute_param));
      OptimizerTensor d;
      d.param = {up(p[k].data(), n * 4), n, DType::f32};  // in place: the input
      d.state[0] = {up(m[k].data(), n * 4), n, DType::f32};
      d.state[1] = {up(v[k].data(), n * 4), n, DType::f32};
      d.step = d_steps + k;
      d.grad = {up(g[k].data(), n * 2), n, DType::bf16};
      d.compute_param = {alloc(n * 2), n, DType::bf16};
      if (k % 2 == 0) {  // out of place: the input becomes the sources
        d.param_src = d.param;
        d.state_src[0] = d.state[0];
        d.state_src[1] = d.state[1];
        d.param = {alloc(n * 4), n, DType::f32};
        d.state[0] = {alloc(n * 4), n, DType::f32};
        d.state[1] = {alloc(n * 4), n, DType::f32};
      }
      dt.push_back(d);
      OptimizerTensor sd = sign_sgd_tensor(d.param, d.grad, d.compute_param);
      sd.param_src = d.param_src;
      ds.push_back(sd);
    }
    if (opt < 2) {
      float* d_scalars = static_cast<float*>(alloc(2 * sizeof(float)));
      const float hsc[2] = {scale, clip};
      ASSERT_EQ(cudaMemcpy(d_scalars, hsc, sizeof hsc, cudaMemcpyHostToDevice), cudaSuccess);
      const std::vector<double> bias = gpu::make_optimizer_table(cfg);
      auto* d_bias = static_cast<double*>(up(bias.data(), bias.size() * sizeof(double)));
      gpu::optimizer_step(dt, cfg,
                          OptimizerDeviceArgs{d_scalars, d_scalars + 1, nullptr, nullptr, d_bias},
                          nullptr);
      reference::adamw_step(ht, cfg, GradientRead{scale, clip});
    } else {
      gpu::optimizer_step(ds, scfg, OptimizerDeviceArgs{}, nullptr);
      reference::sign_sgd_step(hs, scfg);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k) + (k % 2 == 0 ? " out of place" : " in place"));
      const std::size_t n = sizes[k];
      EXPECT_EQ(down(dt[k].param.data, n * 4), bytes_of(rp[k])) << "param";
      std::vector<std::uint16_t> ob(n);
      if (n != 0) std::memcpy(ob.data(), down(dt[k].compute_param.data, n * 2).data(), n * 2);
      EXPECT_EQ(ob, ro[k]) << "compute copy";
      if (k % 2 == 0)
        EXPECT_EQ(down(dt[k].param_src.data, n * 4), bytes_of(p[k])) << "param source";
      if (opt == 2) continue;  // SignSGD has no moments
      EXPECT_EQ(down(dt[k].state[0].data, n * 4), bytes_of(rm[k])) << "exp_avg";
      EXPECT_EQ(down(dt[k].state[1].data, n * 4), bytes_of(rv[k])) << "exp_avg_sq";
      if (k % 2 == 0) {
        EXPECT_EQ(down(dt[k].state_src[0].data, n * 4), bytes_of(m[k])) << "exp_avg source";
        EXPECT_EQ(down(dt[k].state_src[1].data, n * 4), bytes_of(v[k])) << "exp_avg_sq source";
      }
    }
    std::vector<float> dev_steps(sizes.size());
    ASSERT_EQ(cudaMemcpy(dev_steps.data(), d_steps, dev_steps.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    if (opt < 2) EXPECT_EQ(dev_steps, ref_steps);
    for (void* q : owned) cudaFree(q);
    owned.clear();
  }
#endif
}

// Block-wise 8-bit AdamW and Adam state (docs/numerics.md 8f) on the GPU: the kernels'
// 8-bit bodies (one thread per element, the block maximum in shared memory) against the
// reference after every step of five, boundary sizes and a tensor across a chunk.
template <class Config>
void q8_on_the_gpu(const Config& c) {
#if defined(STEPCORE_WITH_CUDA)
  using namespace stepcore::testing_support::q8;  // NOLINT: the shared 8-bit sets
  std::vector<TensorSpec> specs;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{257},
                        std::size_t{4097}, gpu::kBlockElements + 300})
    specs.push_back({n, DType::f32, n % 2 ? DType::bf16 : DType::f32, n == 4097});
  Q8Set want = make_set(specs, c);
  const int slots = want.slots;
  const std::string what = q8_config_name(c);
  Q8Set got = want;
  auto up = [](const void* src, std::size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, bytes > 0 ? bytes : 1), cudaSuccess);
    if (bytes > 0) EXPECT_EQ(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  };
  const std::vector<double> table = gpu::make_optimizer_table(OptimizerConfig{c});
  const std::vector<std::uint32_t> books = gpu::q8_codebooks();
  const float host_scalars[2] = {0.25f, 0.8f};
  auto* d_scalars = static_cast<float*>(up(host_scalars, sizeof host_scalars));
  auto* d_table = static_cast<double*>(up(table.data(), table.size() * sizeof(double)));
  auto* d_books = static_cast<std::uint32_t*>(up(books.data(), books.size() * 4));
  for (int s = 1; s <= 5; ++s) {
    fill_grads(want, s);
    fill_grads(got, s);
    auto wv = want.views();
    reference_step(wv, c, GradientRead{0.25f, 0.8f, false});
    // The set's arrays on the device, stepped, and copied back.
    std::vector<void*> owned;
    auto hv = got.views();
    std::vector<OptimizerTensor> dv = hv;
    for (std::size_t i = 0; i < hv.size(); ++i) {
      auto mirror = [&](const void* p, std::size_t bytes) {
        owned.push_back(up(p, bytes));
        return owned.back();
      };
      const std::size_t n = hv[i].param.numel;
      const std::size_t blocks = (n + kQ8BlockSize - 1) / kQ8BlockSize;
      dv[i].param.data = mirror(hv[i].param.data, hv[i].param.bytes());
      dv[i].grad.data = mirror(hv[i].grad.data, hv[i].grad.bytes());
      dv[i].step = static_cast<float*>(mirror(hv[i].step, sizeof(float)));
      if (hv[i].compute_param.data)
        dv[i].compute_param.data = mirror(hv[i].compute_param.data, hv[i].compute_param.bytes());
      for (int k = 0; k < slots; ++k)
        dv[i].q8[k] = Q8Slot{static_cast<std::uint8_t*>(mirror(hv[i].q8[k].codes, n)),
                             static_cast<float*>(mirror(hv[i].q8[k].absmax, blocks * 4))};
    }
    gpu::optimizer_step(
        dv, OptimizerConfig{c},
        OptimizerDeviceArgs{d_scalars, d_scalars + 1, nullptr, nullptr, d_table, d_books}, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (std::size_t i = 0; i < hv.size(); ++i) {
      auto down = [](void* host, const void* dev, std::size_t bytes) {
        if (bytes > 0) EXPECT_EQ(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      };
      const std::size_t n = hv[i].param.numel;
      const std::size_t blocks = (n + kQ8BlockSize - 1) / kQ8BlockSize;
      down(hv[i].param.data, dv[i].param.data, hv[i].param.bytes());
      down(hv[i].step, dv[i].step, sizeof(float));
      if (hv[i].compute_param.data)
        down(hv[i].compute_param.data, dv[i].compute_param.data, hv[i].compute_param.bytes());
      for (int k = 0; k < slots; ++k) {
        down(hv[i].q8[k].codes, dv[i].q8[k].codes, n);
        down(hv[i].q8[k].absmax, dv[i].q8[k].absmax, blocks * 4);
      }
    }
    for (void* p : owned) cudaFree(p);
    expect_same(got, want, what + " step " + std::to_string(s));
    if (::testing::Test::HasFatalFailure()) break;
  }
  for (void* p :
       {static_cast<void*>(d_scalars), static_cast<void*>(d_table), static_cast<void*>(d_books)})
    cudaFree(p);
#else
  (void)c;
#endif
}

TEST(GpuKernels, EightBitAdamWAndAdamMatchTheReference) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  for (const AdamWConfig& c : stepcore::testing_support::q8_adamw_configs()) {
    q8_on_the_gpu(c);
    if (HasFatalFailure()) return;
  }
  for (const AdamConfig& c : stepcore::testing_support::q8::adam_configs()) {
    q8_on_the_gpu(c);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
