// GPU: every multi-tensor kernel on the device against the reference, bit for bit, under
// two launch shapes; the exact norm fallback resolving a rounding tie on the device; a
// whole step (scale + norm, finalisation, exact fallback, lazy-clip AdamW) captured in a
// CUDA graph. Skips without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/plans.hpp"
#include "kernels/testing.hpp"
#include "optimizer_records.hpp"
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

#define SKIP_WITHOUT_DEVICE() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

#if defined(STEPCORE_WITH_CUDA)

/// Device memory owned by a test; freed on scope exit.
class DeviceBytes {
 public:
  explicit DeviceBytes(std::size_t bytes) {
    EXPECT_EQ(cudaMalloc(&p_, bytes + 16), cudaSuccess);
    EXPECT_EQ(cudaMemset(p_, 0, bytes + 16), cudaSuccess);
  }
  DeviceBytes(const void* host, std::size_t bytes) : DeviceBytes(bytes) { upload(host, bytes); }
  ~DeviceBytes() { cudaFree(p_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  DeviceBytes(DeviceBytes&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  void upload(const void* host, std::size_t bytes) {
    EXPECT_EQ(cudaMemcpy(p_, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void download(void* host, std::size_t bytes) const {
    EXPECT_EQ(cudaMemcpy(host, p_, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

/// Host tensors with boundary sizes (an empty one in the middle) and their device twins.
struct Tensors {
  std::vector<std::vector<std::uint8_t>> host;
  std::vector<DeviceBytes> dev;
  std::vector<TensorView> hv, dv;

  Tensors(DType d, std::uint32_t seed, float magnitude = 1.0f) {
    const std::size_t c = gpu::kBlockElements;
    const std::vector<std::size_t> sizes = {1, 31, 33, 0, 127, 1025, c - 1, c, c + 1, 3 * c + 5};
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, magnitude);
    host.reserve(sizes.size());
    dev.reserve(sizes.size());
    for (std::size_t n : sizes) {
      host.emplace_back(n * dtype_size(d));
      for (std::size_t i = 0; i < n; ++i) {
        const float x = nd(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 12) - 6);
        if (d == DType::f32) {
          std::memcpy(host.back().data() + 4 * i, &x, 4);
        } else {
          const std::uint16_t h = d == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
          std::memcpy(host.back().data() + 2 * i, &h, 2);
        }
      }
      dev.emplace_back(host.back().data(), host.back().size());
      hv.push_back({host.back().data(), n, d});
      dv.push_back({dev.back().as<void>(), n, d});
    }
  }
  /// Expects the device tensors to hold the host tensors' bytes.
  void expect_equal(const char* what) const {
    for (std::size_t k = 0; k < host.size(); ++k) {
      std::vector<std::uint8_t> back(host[k].size());
      dev[k].download(back.data(), back.size());
      EXPECT_EQ(back, host[k]) << what << " tensor " << k;
    }
  }
  std::vector<ConstTensorView> host_const() const { return {hv.begin(), hv.end()}; }
  std::vector<ConstTensorView> dev_const() const { return {dv.begin(), dv.end()}; }
};

NormPartial download_partial(const DeviceBytes& d) {
  NormPartial p;
  d.download(&p, sizeof p);
  return p;
}

TEST(GpuSteps, EveryKernelMatchesTheReferenceUnderTwoLaunchShapes) {
  SKIP_WITHOUT_DEVICE();
  std::uint32_t seed = 7;
  for (const auto& [blocks, tensors] :
       {std::pair{gpu::kMaxBlocksPerLaunch, gpu::kMaxTensorsPerLaunch}, std::pair{3, 2}}) {
    const gpu::testing::ScopedLaunchLimits limits(blocks, tensors);
    for (DType d : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " max_blocks " + std::to_string(blocks));
      Tensors g(d, seed++);
      const std::size_t ws = gpu::scale_and_norm_workspace_bytes(g.dv);
      DeviceBytes d_ws(ws), d_partial(sizeof(NormPartial)), d_flag(sizeof(std::int32_t));

      // Read-only norm with a lazy scale and clip.
      const GradientRead read{0.3f, 0.37f};
      gpu::norm_partial(g.dev_const(), read, d_partial.as<NormPartial>(), d_ws.as<void>(), ws,
                        nullptr);
      const NormPartial ref_read = reference::norm_partial(g.host_const(), read);
      const NormResult r = finalize(download_partial(d_partial));
      ASSERT_FALSE(r.needs_exact);
      EXPECT_EQ(f32_bits(r.norm), f32_bits(finalize(ref_read).norm));

      // The exact pass (flag forced to 2) equals the reference partial digit for digit.
      const std::int32_t two = gpu::kFoundInfNeedsExact;
      d_flag.upload(&two, sizeof two);
      gpu::exact_norm_partial_if_needed(g.dev_const(), read, d_flag.as<std::int32_t>(),
                                        d_partial.as<NormPartial>(), d_ws.as<void>(), ws, nullptr);
      const NormPartial exact = download_partial(d_partial);
      EXPECT_EQ(exact.approximate, 0u);
      EXPECT_EQ(std::memcmp(exact.digits, ref_read.digits, sizeof exact.digits), 0);
      EXPECT_TRUE(same_value(exact, ref_read));
      // ... and is a no-op writing a zero partial when the flag is clear.
      const std::int32_t zero = 0;
      d_flag.upload(&zero, sizeof zero);
      gpu::exact_norm_partial_if_needed(g.dev_const(), read, d_flag.as<std::int32_t>(),
                                        d_partial.as<NormPartial>(), d_ws.as<void>(), ws, nullptr);
      EXPECT_TRUE(same_value(download_partial(d_partial), NormPartial{}));

      // Fused scale + norm, in place.
      const float scale = 1.0f / 3001.0f;
      gpu::scale_and_norm_partial(g.dv, scale, d_partial.as<NormPartial>(), d_ws.as<void>(), ws,
                                  nullptr);
      reference::scale_(g.hv, scale);
      g.expect_equal("scaled");
      EXPECT_EQ(f32_bits(finalize(download_partial(d_partial)).norm),
                f32_bits(finalize(reference::norm_partial(g.host_const())).norm));

      // Eager clip by a device scalar.
      const float clip = 0.61f;
      DeviceBytes d_clip(&clip, sizeof clip);
      gpu::scale_(g.dv, d_clip.as<float>(), nullptr);
      reference::scale_(g.hv, clip);
      g.expect_equal("clipped");

      // Accumulate into f32 accumulators (add, then copy).
      for (bool copy : {false, true}) {
        Tensors acc(DType::f32, seed++);
        std::vector<AccumulatePair> hp, dp;
        for (std::size_t k = 0; k < acc.hv.size(); ++k) {
          hp.push_back({acc.hv[k], g.hv[k], copy});
          dp.push_back({acc.dv[k], g.dv[k], copy});
        }
        gpu::accumulate(dp, nullptr);
        reference::accumulate(hp);
        acc.expect_equal(copy ? "accumulate (copy)" : "accumulate");
      }

      // SignSGD with a bf16 compute copy.
      Tensors param(DType::f32, seed++), out(DType::bf16, seed++);
      std::vector<OptimizerTensor> hs, ds;
      for (std::size_t k = 0; k < param.hv.size(); ++k) {
        hs.push_back(sign_sgd_tensor(param.hv[k], g.hv[k], out.hv[k]));
        ds.push_back(sign_sgd_tensor(param.dv[k], g.dv[k], out.dv[k]));
      }
      const SignSgdConfig sc{1e-3, 0.1};
      gpu::optimizer_step(ds, sc, OptimizerDeviceArgs{}, nullptr);
      reference::sign_sgd_step(hs, sc);
      param.expect_equal("sign_sgd param");
      out.expect_equal("sign_sgd compute copy");
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
  }
}

TEST(GpuSteps, ExactFallbackOnTheDeviceResolvesATie) {
  SKIP_WITHOUT_DEVICE();
  // Squares summing to (2^25 + 2)^2: the midpoint of the floats 2^25 and 2^25 + 4.
  const std::vector<float> x = {16777216.0f, 16777216.0f, 16777216.0f, 16777216.0f,
                                8192.0f,     8192.0f,     2.0f};
  DeviceBytes d_x(x.data(), x.size() * 4);
  const std::vector<TensorView> dv{{d_x.as<float>(), 3, DType::f32},
                                   {d_x.as<float>() + 3, 0, DType::f32},
                                   {d_x.as<float>() + 3, 4, DType::f32}};
  const std::vector<ConstTensorView> cv(dv.begin(), dv.end());
  const std::size_t ws = gpu::scale_and_norm_workspace_bytes(dv);
  DeviceBytes d_ws(ws), d_partial(sizeof(NormPartial)), d_exact(sizeof(NormPartial));
  DeviceBytes d_result(sizeof(NormResult)), d_clip(4), d_flag(4);
  gpu::scale_and_norm_partial(dv, 1.0f, d_partial.as<NormPartial>(), d_ws.as<void>(), ws, nullptr);
  gpu::finalize_and_clip(d_partial.as<NormPartial>(), 1.0f, d_result.as<NormResult>(),
                         d_clip.as<float>(), d_flag.as<std::int32_t>(), nullptr);
  std::int32_t flag = -1;
  d_flag.download(&flag, 4);
  ASSERT_EQ(flag, gpu::kFoundInfNeedsExact);
  gpu::exact_norm_partial_if_needed(cv, {}, d_flag.as<std::int32_t>(), d_exact.as<NormPartial>(),
                                    d_ws.as<void>(), ws, nullptr);
  gpu::finalize_exact_and_clip(d_exact.as<NormPartial>(), 1.0f, d_result.as<NormResult>(),
                               d_clip.as<float>(), d_flag.as<std::int32_t>(), nullptr);
  NormResult r;
  float clip = 0.0f;
  d_result.download(&r, sizeof r);
  d_clip.download(&clip, 4);
  d_flag.download(&flag, 4);
  EXPECT_EQ(flag, gpu::kFoundInfNone);
  EXPECT_EQ(f32_bits(r.norm), f32_bits(33554432.0f)) << "ties to even: 2^25";
  EXPECT_EQ(f32_bits(clip), f32_bits((1.0f / (33554432.0f + 1e-6f)) * 1.0f));
}

// More block partials than one reduction slice takes (kPartialsPerSlice): 5,000 small
// tensors, one block each, reduced in three slices and then the slices: the finalised
// norm and the counts equal the reference's, with NaN, Inf and the largest value in
// different slices.
TEST(GpuSteps, ASlicedPartialReductionGivesTheReferenceNorm) {
  SKIP_WITHOUT_DEVICE();
  const std::size_t n = 5000, each = 3;
  std::vector<float> host(n * each);
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& x : host) x = nd(rng);
  host[7] = 1e30f;                    // the max, slice 0
  host[2100 * each] = std::nanf("");  // slice 1
  host[4500 * each + 1] = -INFINITY;  // slice 2
  DeviceBytes d_data(host.data(), host.size() * 4);
  std::vector<ConstTensorView> dv, hv;
  for (std::size_t k = 0; k < n; ++k) {
    dv.push_back({d_data.as<float>() + k * each, each, DType::f32});
    hv.push_back({host.data() + k * each, each, DType::f32});
  }
  std::vector<TensorView> views;
  for (const auto& v : dv) views.push_back({const_cast<void*>(v.data), v.numel, v.dtype});
  ASSERT_GT(gpu::reduce_slices(n), 1u);
  const std::size_t ws = gpu::scale_and_norm_workspace_bytes(views);
  DeviceBytes d_ws(ws), d_partial(sizeof(NormPartial));
  gpu::norm_partial(dv, GradientRead{}, d_partial.as<NormPartial>(), d_ws.as<void>(), ws, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  NormPartial got;
  d_partial.download(&got, sizeof got);
  const NormPartial ref = reference::norm_partial(hv);
  EXPECT_EQ(got.nan_count, 1u);
  EXPECT_EQ(got.inf_count, 1u);
  EXPECT_EQ(got.max_abs_bits, ref.max_abs_bits);
  host[2100 * each] = 0.0f;  // finite values only: the norm itself
  host[4500 * each + 1] = 0.0f;
  d_data.upload(host.data(), host.size() * 4);
  gpu::norm_partial(dv, GradientRead{}, d_partial.as<NormPartial>(), d_ws.as<void>(), ws, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d_partial.download(&got, sizeof got);
  EXPECT_EQ(f32_bits(finalize(got).norm), f32_bits(finalize(reference::norm_partial(hv)).norm));
}

// A whole step captured once and replayed three times, with a new gradient scale and lr
// written to device memory before each replay: every replay must be the next step (its
// counter, its bias corrections, its scale, its clip, its lr), bit for bit the eager
// reference's three steps.
TEST(GpuSteps, AStepCapturedInACudaGraphReplaysTheNextStepWithTheCurrentScaleAndLearningRate) {
  SKIP_WITHOUT_DEVICE();
  const float scales[] = {1.0f / 4099.0f, 4.0f, 0.25f};
  const float max_norm = 0.05f;
  Tensors g(DType::bf16, 99, 4.0f), param(DType::f32, 100, 0.05f), out(DType::bf16, 101);
  Tensors m(DType::f32, 102, 1e-3f), v(DType::f32, 103, 1e-3f);
  for (auto* t : {&v}) {  // second moments are non-negative
    for (std::size_t k = 0; k < t->host.size(); ++k) {
      auto* f = reinterpret_cast<float*>(t->host[k].data());
      for (std::size_t i = 0; i < t->hv[k].numel; ++i) f[i] = std::abs(f[i]);
      t->dev[k].upload(t->host[k].data(), t->host[k].size());
    }
  }
  std::vector<float> host_steps(g.hv.size(), 3.0f), dev_steps = host_steps;
  DeviceBytes d_steps(dev_steps.data(), dev_steps.size() * 4);
  std::vector<OptimizerTensor> ht, dt;
  for (std::size_t k = 0; k < g.hv.size(); ++k) {
    ht.push_back(adamw_tensor(param.hv[k], m.hv[k], v.hv[k], &host_steps[k], g.hv[k], out.hv[k]));
    dt.push_back(
        adamw_tensor(param.dv[k], m.dv[k], v.dv[k], d_steps.as<float>() + k, g.dv[k], out.dv[k]));
  }
  const std::vector<ConstTensorView> gc = g.dev_const();
  const std::size_t ws = gpu::scale_and_norm_workspace_bytes(g.dv);
  DeviceBytes d_ws(ws), d_partial(sizeof(NormPartial)), d_exact(sizeof(NormPartial));
  DeviceBytes d_result(sizeof(NormResult)), d_clip(4), d_flag(4);
  const float one = 1.0f;
  DeviceBytes d_one(&one, 4), d_scale(&scales[0], 4);
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  const std::vector<double> bias = gpu::make_optimizer_table(cfg);
  DeviceBytes d_bias(bias.data(), bias.size() * sizeof(double));
  StepHyper hyper{cfg.lr, cfg.weight_decay};
  DeviceBytes d_hyper(&hyper, sizeof hyper);

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  gpu::scale_and_norm_partial(g.dv, d_scale.as<float>(), d_partial.as<NormPartial>(),
                              d_ws.as<void>(), ws, stream);
  gpu::finalize_and_clip(d_partial.as<NormPartial>(), max_norm, d_result.as<NormResult>(),
                         d_clip.as<float>(), d_flag.as<std::int32_t>(), stream);
  gpu::exact_norm_partial_if_needed(gc, DeviceGradientRead{d_one.as<float>(), d_one.as<float>()},
                                    d_flag.as<std::int32_t>(), d_exact.as<NormPartial>(),
                                    d_ws.as<void>(), ws, stream);
  gpu::finalize_exact_and_clip(d_exact.as<NormPartial>(), max_norm, d_result.as<NormResult>(),
                               d_clip.as<float>(), d_flag.as<std::int32_t>(), stream);
  gpu::optimizer_step(
      dt, cfg,
      OptimizerDeviceArgs{d_one.as<float>(), d_clip.as<float>(), d_flag.as<std::int32_t>(),
                          d_hyper.as<StepHyper>(), d_bias.as<double>()},
      stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess)
      << "a launcher synchronised or used a capture-unsafe call";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  const double lrs[] = {1e-3, 3e-4, 2e-3};
  for (int r = 0; r < 3; ++r) {
    hyper.lr = lrs[r];
    ASSERT_EQ(
        cudaMemcpyAsync(d_hyper.as<void>(), &hyper, sizeof hyper, cudaMemcpyHostToDevice, stream),
        cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(d_scale.as<void>(), &scales[r], sizeof(float), cudaMemcpyHostToDevice,
                              stream),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

    // The eager reference: scale in place, exact norm, torch's coefficient, AdamW.
    reference::scale_(g.hv, scales[r]);
    const NormResult ref = finalize(reference::norm_partial(g.host_const()));
    ASSERT_TRUE(ref.finite);
    const float coef = (1.0f / (ref.norm + 1e-6f)) * max_norm;
    const float clip = coef < 1.0f ? coef : 1.0f;
    AdamWConfig step_cfg = cfg;
    step_cfg.lr = lrs[r];
    reference::adamw_step(ht, step_cfg, GradientRead{1.0f, clip});
    float dev_clip = 0.0f;
    d_clip.download(&dev_clip, 4);
    EXPECT_EQ(f32_bits(dev_clip), f32_bits(clip)) << "replay " << r;
    d_steps.download(dev_steps.data(), dev_steps.size() * 4);
    EXPECT_EQ(dev_steps, host_steps) << "replay " << r << ": the counters advance on the device";
    g.expect_equal("scaled gradient");
    param.expect_equal("param");
    m.expect_equal("exp_avg");
    v.expect_equal("exp_avg_sq");
    out.expect_equal("compute copy");
  }
  EXPECT_EQ(host_steps[0], 6.0f);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

#else

TEST(GpuSteps, EveryKernelMatchesTheReferenceUnderTwoLaunchShapes) { SKIP_WITHOUT_DEVICE(); }

#endif

}  // namespace
