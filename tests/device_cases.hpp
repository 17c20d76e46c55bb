// Device-interface cases shared by the host device (test_device.cpp) and the CUDA device
// (test_cuda_device.cpp): only stepcore::device calls, checked bit for bit against the
// reference (never against gpu::emulate, which the host device runs: that would compare
// the executor with itself) — every kernel entry point under two launch shapes, the
// generic optimizer step of every unit, the exact-norm fallback on a tie, copies ordered by events
// across queues, zero(), the compute queue waiting on a copy, allocation contracts and argument
// validation.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kernels/plans.hpp"
#include "kernels/testing.hpp"
#include "optimizer_records.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/managers.hpp"  // optimizer_counts_steps
#include "stepcore/reference.hpp"

namespace device_cases {

using namespace stepcore;
using device::Device;
using device::Event;
using device::Queue;

/// Device memory owned by a test (allocate/deallocate); uploads and downloads go through
/// the device's copy queues, after and before synchronizing every queue (on CUDA a copy
/// queue is not ordered after the compute stream's kernels otherwise).
class Buffer {
 public:
  Buffer(Device& d, std::size_t bytes) : dev_(&d), p_(d.allocate(bytes)) {}
  Buffer(Device& d, const void* host, std::size_t bytes) : Buffer(d, bytes) { upload(host, bytes); }
  ~Buffer() {
    if (p_ != nullptr) dev_->deallocate(p_);
  }
  Buffer(Buffer&& o) noexcept : dev_(o.dev_), p_(std::exchange(o.p_, nullptr)) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void upload(const void* host, std::size_t bytes) {
    dev_->synchronize();
    dev_->copy(Queue::h2d, p_, host, bytes);
    dev_->synchronize();
  }
  void download(void* host, std::size_t bytes) const {
    dev_->synchronize();
    dev_->copy(Queue::d2h, host, p_, bytes);
    dev_->synchronize();
  }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  Device* dev_;
  void* p_;
};

/// Host tensors with boundary sizes (an empty one in the middle) and their device twins.
struct Tensors {
  std::vector<std::vector<std::uint8_t>> host;
  std::vector<Buffer> dev;
  std::vector<TensorView> hv, dv;

  Tensors(Device& d, DType t, std::uint32_t seed, float magnitude = 1.0f,
          bool non_negative = false) {
    const std::size_t c = gpu::kBlockElements;
    const std::vector<std::size_t> sizes = {1, 31, 33, 0, 127, 1025, c - 1, c, c + 1, 3 * c + 5};
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, magnitude);
    host.reserve(sizes.size());
    dev.reserve(sizes.size());
    for (std::size_t n : sizes) {
      host.emplace_back(n * dtype_size(t));
      for (std::size_t i = 0; i < n; ++i) {
        float x = nd(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 12) - 6);
        if (non_negative) x = std::abs(x);
        if (t == DType::f32) {
          std::memcpy(host.back().data() + 4 * i, &x, 4);
        } else {
          const std::uint16_t h = t == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
          std::memcpy(host.back().data() + 2 * i, &h, 2);
        }
      }
      dev.emplace_back(d, host.back().data(), host.back().size());
      hv.push_back({host.back().data(), n, t});
      dv.push_back({dev.back().as(), n, t});
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

template <class T>
T download(const Buffer& b) {
  T v;
  b.download(&v, sizeof v);
  return v;
}

/// Expects a device partial (fast: possibly approximate) to carry the reference partial's
/// bookkeeping and to finalise to the reference's result, bit for bit; an exact device
/// partial must be the reference's integer.
inline void expect_partial_of(const NormPartial& got, const NormPartial& ref, const char* what) {
  EXPECT_EQ(got.nan_count, ref.nan_count) << what;
  EXPECT_EQ(got.inf_count, ref.inf_count) << what;
  EXPECT_EQ(got.max_abs_bits, ref.max_abs_bits) << what;
  if (got.approximate == 0) EXPECT_TRUE(same_value(got, ref)) << what;
  const NormResult g = finalize(got), r = finalize(ref);
  ASSERT_FALSE(g.needs_exact) << what;
  EXPECT_EQ(f32_bits(g.norm), f32_bits(r.norm)) << what;
  EXPECT_EQ(f32_bits(g.max_abs), f32_bits(r.max_abs)) << what;
  EXPECT_EQ(g.finite, r.finite) << what;
}

/// Every kernel entry point against the reference, under two launch shapes, on a device
/// with `threads` threads per block (emulated on the host device).
inline void kernels_match_reference(Device& dev, int threads) {
  std::uint32_t seed = 11;
  for (const auto& [blocks, tensors] :
       {std::pair{gpu::kMaxBlocksPerLaunch, gpu::kMaxTensorsPerLaunch}, std::pair{3, 2}}) {
    const gpu::testing::ScopedLaunchLimits limits(blocks, tensors);
    for (DType d : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " max_blocks " + std::to_string(blocks) +
                   " threads " + std::to_string(threads));
      Tensors g(dev, d, seed++);
      const std::size_t ws = dev.norm_workspace_bytes(g.dv);
      ASSERT_EQ(ws, gpu::scale_and_norm_workspace_bytes(g.hv));
      Buffer d_ws(dev, ws), d_partial(dev, sizeof(NormPartial)), d_flag(dev, 4);

      // Read-only norm with a lazy scale and clip: the reference's partial and norm.
      const GradientRead read{0.3f, 0.37f};
      dev.norm_partial(g.dev_const(), read, d_partial.as<NormPartial>(), d_ws.as(), ws);
      const NormPartial got_read = download<NormPartial>(d_partial);
      const NormPartial ref_read = reference::norm_partial(g.host_const(), read);
      expect_partial_of(got_read, ref_read, "norm_partial");

      // The exact pass (flag 2) equals the reference partial digit for digit; with the
      // flag clear it writes a zero partial.
      const std::int32_t two = gpu::kFoundInfNeedsExact, zero = 0;
      d_flag.upload(&two, 4);
      dev.exact_norm_partial_if_needed(g.dev_const(), read, d_flag.as<std::int32_t>(),
                                       d_partial.as<NormPartial>(), d_ws.as(), ws);
      const NormPartial exact = download<NormPartial>(d_partial);
      EXPECT_EQ(exact.approximate, 0u);
      EXPECT_EQ(std::memcmp(exact.digits, ref_read.digits, sizeof exact.digits), 0);
      EXPECT_TRUE(same_value(exact, ref_read));
      d_flag.upload(&zero, 4);
      dev.exact_norm_partial_if_needed(g.dev_const(), read, d_flag.as<std::int32_t>(),
                                       d_partial.as<NormPartial>(), d_ws.as(), ws);
      EXPECT_TRUE(same_value(download<NormPartial>(d_partial), NormPartial{}));

      // Fused scale + norm in place: the reference's scaled bytes, its partial and norm of
      // them.
      const float scale = 1.0f / 3001.0f;
      dev.scale_and_norm_partial(g.dv, scale, d_partial.as<NormPartial>(), d_ws.as(), ws);
      const NormPartial got_scaled = download<NormPartial>(d_partial);
      reference::scale_(g.hv, scale);
      g.expect_equal("scaled");
      const NormPartial ref_scaled_partial = reference::norm_partial(g.host_const());
      expect_partial_of(got_scaled, ref_scaled_partial, "scale_and_norm_partial");
      const NormResult ref_scaled = finalize(ref_scaled_partial);

      // finalize_and_clip: the reference's norm and its clip coefficient, through the
      // pointers; certified, so the flag says neither found-inf nor needs-exact.
      Buffer d_result(dev, sizeof(NormResult)), d_clip(dev, 4);
      for (float max_norm : {1e-3f, 1e6f}) {
        dev.finalize_and_clip(d_partial.as<NormPartial>(), max_norm, d_result.as<NormResult>(),
                              d_clip.as<float>(), d_flag.as<std::int32_t>());
        const float want_clip = clip_coefficient(ref_scaled.norm, max_norm);
        const NormResult r = download<NormResult>(d_result);
        EXPECT_EQ(f32_bits(r.norm), f32_bits(ref_scaled.norm));
        EXPECT_EQ(f32_bits(r.max_abs), f32_bits(ref_scaled.max_abs));
        EXPECT_EQ(r.finite, ref_scaled.finite);
        EXPECT_FALSE(r.needs_exact);
        EXPECT_EQ(f32_bits(download<float>(d_clip)), f32_bits(want_clip));
        EXPECT_EQ(download<std::int32_t>(d_flag), gpu::kFoundInfNone);
        // With the flag clear, the exact finalisation leaves all three unchanged.
        const NormPartial junk{};
        Buffer d_junk(dev, &junk, sizeof junk);
        dev.finalize_exact_and_clip(d_junk.as<NormPartial>(), max_norm, d_result.as<NormResult>(),
                                    d_clip.as<float>(), d_flag.as<std::int32_t>());
        EXPECT_EQ(f32_bits(download<NormResult>(d_result).norm), f32_bits(ref_scaled.norm));
        EXPECT_EQ(f32_bits(download<float>(d_clip)), f32_bits(want_clip));
      }

      // Accumulate into f32 accumulators (add, then copy).
      for (bool copy : {false, true}) {
        Tensors acc(dev, DType::f32, seed++);
        std::vector<AccumulatePair> hp, dp;
        for (std::size_t k = 0; k < acc.hv.size(); ++k) {
          hp.push_back({acc.hv[k], g.hv[k], copy});
          dp.push_back({acc.dv[k], g.dv[k], copy});
        }
        dev.accumulate(dp);
        reference::accumulate(hp);
        acc.expect_equal(copy ? "accumulate (copy)" : "accumulate");
      }

      // SignSGD with a bf16 compute copy; then skipped on found-inf.
      {
        Tensors param(dev, DType::f32, seed++), out(dev, DType::bf16, seed++);
        std::vector<OptimizerTensor> hs, ds;
        for (std::size_t k = 0; k < param.hv.size(); ++k) {
          hs.push_back(test_support::sign_sgd_tensor(param.hv[k], g.hv[k], out.hv[k]));
          ds.push_back(test_support::sign_sgd_tensor(param.dv[k], g.dv[k], out.dv[k]));
        }
        const SignSgdConfig sc{1e-3, 0.1};
        d_flag.upload(&zero, 4);
        const OptimizerDeviceArgs sargs{nullptr, nullptr, d_flag.as<std::int32_t>(), nullptr};
        dev.optimizer_step(ds, sc, sargs);
        reference::sign_sgd_step(hs, sc);
        param.expect_equal("sign_sgd param");
        out.expect_equal("sign_sgd compute copy");
        const std::int32_t one = gpu::kFoundInfNonFinite;
        d_flag.upload(&one, 4);
        dev.optimizer_step(ds, sc, sargs);
        param.expect_equal("sign_sgd skipped on found-inf");
      }

      // AdamW with the lazy read R(R(g*scale)*clip), scale and clip in device memory;
      // then skipped on found-inf (nothing written, the device step counters kept).
      {
        Tensors param(dev, DType::f32, seed++, 0.05f), out(dev, DType::bf16, seed++);
        Tensors m(dev, DType::f32, seed++, 1e-3f), v(dev, DType::f32, seed++, 1e-3f, true);
        std::vector<float> host_steps(g.hv.size(), 3.0f), dev_steps(g.hv.size());
        Buffer d_steps(dev, host_steps.data(), 4 * host_steps.size());
        std::vector<OptimizerTensor> ht, dt;
        for (std::size_t k = 0; k < g.hv.size(); ++k) {
          ht.push_back(test_support::adamw_tensor(param.hv[k], m.hv[k], v.hv[k], &host_steps[k],
                                                  g.hv[k], out.hv[k]));
          dt.push_back(test_support::adamw_tensor(param.dv[k], m.dv[k], v.dv[k],
                                                  d_steps.as<float>() + k, g.dv[k], out.dv[k]));
        }
        AdamWConfig cfg;
        cfg.weight_decay = 0.1;
        const std::vector<double> bias = gpu::make_optimizer_table(cfg);
        Buffer d_bias(dev, bias.data(), bias.size() * sizeof(double));
        const float a_scale = 1.0f / 7.0f, a_clip = 0.61f;
        Buffer d_scale(dev, &a_scale, 4), d_aclip(dev, &a_clip, 4);
        const OptimizerDeviceArgs args{d_scale.as<float>(), d_aclip.as<float>(),
                                       d_flag.as<std::int32_t>(), nullptr, d_bias.as<double>()};
        d_flag.upload(&zero, 4);
        dev.optimizer_step(dt, cfg, args);
        reference::adamw_step(ht, cfg, GradientRead{a_scale, a_clip});
        d_steps.download(dev_steps.data(), 4 * dev_steps.size());
        EXPECT_EQ(std::memcmp(host_steps.data(), dev_steps.data(), 4 * host_steps.size()), 0);
        param.expect_equal("adamw param");
        m.expect_equal("adamw exp_avg");
        v.expect_equal("adamw exp_avg_sq");
        out.expect_equal("adamw compute copy");
        const std::int32_t one = gpu::kFoundInfNonFinite;
        d_flag.upload(&one, 4);
        dev.optimizer_step(dt, cfg, args);
        d_steps.download(dev_steps.data(), 4 * dev_steps.size());
        EXPECT_EQ(std::memcmp(host_steps.data(), dev_steps.data(), 4 * host_steps.size()), 0)
            << "a skipped step leaves the device counters as they were";
        param.expect_equal("adamw skipped on found-inf");
        m.expect_equal("adamw exp_avg skipped on found-inf");
      }
    }
  }
}

/// Device::optimizer_step of every optimizer unit (one configuration each, its options
/// on) against the reference, bit for bit after each of four steps: lr and weight decay
/// changed between steps in device memory, the gradient read lazily through a device
/// scale and clip, then a found-inf step that writes nothing and keeps the counters.
inline void every_optimizer_unit_matches_the_reference(Device& dev) {
  std::vector<std::pair<const char*, OptimizerConfig>> configs;
  AdamWConfig w;
  w.amsgrad = w.maximize = true;
  configs.push_back({"adamw torch amsgrad maximize", w});
  w = AdamWConfig{};
  w.formula = AdamWFormula::native;
  configs.push_back({"adamw native", w});
  AdamConfig a;
  a.amsgrad = true;
  a.weight_decay = 0.05;
  configs.push_back({"adam amsgrad weight decay", a});
  SgdConfig s;
  s.momentum = 0.9;
  s.nesterov = true;
  s.weight_decay = 0.01;
  configs.push_back({"sgd nesterov", s});
  s = SgdConfig{};
  s.maximize = true;
  configs.push_back({"sgd momentum 0 maximize", s});
  AdagradConfig ad;
  ad.lr_decay = 0.1;
  ad.weight_decay = 0.01;
  ad.initial_accumulator_value = 0.25;
  configs.push_back({"adagrad", ad});
  SignSgdConfig sg;
  sg.weight_decay = 0.1;
  configs.push_back({"sign_sgd", sg});
  LionConfig li;
  li.lr = 3e-3;
  li.weight_decay = 0.1;
  configs.push_back({"lion weight decay", li});
  std::uint32_t seed = 900;
  for (const auto& [name, config] : configs) {
    SCOPED_TRACE(name);
    const bool counter = optimizer_counts_steps(config);
    const int slots = std::visit(
        [](const auto& c) -> int {
          using C = std::decay_t<decltype(c)>;
          if constexpr (std::is_same_v<C, AdamWConfig> || std::is_same_v<C, AdamConfig>)
            return c.amsgrad ? 3 : 2;
          else if constexpr (std::is_same_v<C, SgdConfig>)
            return c.momentum != 0.0 ? 1 : 0;
          else if constexpr (std::is_same_v<C, AdagradConfig> || std::is_same_v<C, LionConfig>)
            return 1;
          else
            return 0;
        },
        config);
    Tensors g(dev, DType::bf16, seed++), param(dev, DType::f32, seed++, 0.05f);
    Tensors out(dev, DType::f16, seed++);
    std::vector<Tensors> state;
    state.reserve(3);
    for (int k = 0; k < slots; ++k) state.emplace_back(dev, DType::f32, seed++, 1e-3f, k > 0);
    std::vector<float> host_steps(g.hv.size(), 2.0f), dev_steps(g.hv.size());
    Buffer d_steps(dev, host_steps.data(), 4 * host_steps.size());
    std::vector<OptimizerTensor> ht(g.hv.size()), dt(g.hv.size());
    for (std::size_t k = 0; k < g.hv.size(); ++k) {
      ht[k].param = param.hv[k];
      dt[k].param = param.dv[k];
      for (int sl = 0; sl < slots; ++sl) {
        ht[k].state[sl] = state[static_cast<std::size_t>(sl)].hv[k];
        dt[k].state[sl] = state[static_cast<std::size_t>(sl)].dv[k];
      }
      if (counter) {
        ht[k].step = &host_steps[k];
        dt[k].step = d_steps.as<float>() + k;
      }
      ht[k].grad = g.hv[k];
      dt[k].grad = g.dv[k];
      ht[k].compute_param = out.hv[k];
      dt[k].compute_param = out.dv[k];
    }
    const std::vector<double> table = gpu::make_optimizer_table(config);
    Buffer d_table(dev, 8 * table.size() + 8);
    if (!table.empty()) d_table.upload(table.data(), 8 * table.size());
    const float scale = 1.0f / 3.0f, clip = 0.7f;
    const std::int32_t zero = 0, one = gpu::kFoundInfNonFinite;
    Buffer d_scale(dev, &scale, 4), d_clip(dev, &clip, 4), d_flag(dev, &zero, 4);
    Buffer d_hyper(dev, sizeof(StepHyper));
    OptimizerDeviceArgs args;
    args.scale = d_scale.as<float>();
    args.clip = d_clip.as<float>();
    args.found_inf = d_flag.as<std::int32_t>();
    args.hyper = d_hyper.as<StepHyper>();
    args.table = table.empty() ? nullptr : d_table.as<double>();
    for (int step = 0; step < 4; ++step) {
      OptimizerConfig c = config;
      StepHyper h{};
      std::visit(
          [&](auto& x) {
            x.lr = x.lr * (1.0 + 0.5 * step);
            x.weight_decay = x.weight_decay * (step % 2 == 0 ? 1.0 : 0.5);
            h = StepHyper{x.lr, x.weight_decay};
          },
          c);
      d_hyper.upload(&h, sizeof h);
      const bool skip = step == 3;
      d_flag.upload(skip ? &one : &zero, 4);
      dev.optimizer_step(dt, config, args);  // the lr and weight decay come from d_hyper
      dev.synchronize();
      if (!skip) {
        reference::optimizer_step(ht, c, GradientRead{scale, clip});
      }
      const std::string at = " after step " + std::to_string(step);
      param.expect_equal(("param" + at).c_str());
      for (const Tensors& t : state) t.expect_equal(("state" + at).c_str());
      out.expect_equal(("compute copy" + at).c_str());
      d_steps.download(dev_steps.data(), 4 * dev_steps.size());
      EXPECT_EQ(std::memcmp(host_steps.data(), dev_steps.data(), 4 * host_steps.size()), 0)
          << "counters" << at;
    }
  }
}

/// Squares summing to (2^25 + 2)^2, the midpoint of two floats: finalize_and_clip asks
/// for the exact pass, which resolves the tie to even.
inline void exact_fallback_resolves_a_tie(Device& dev) {
  const std::vector<float> x = {16777216.0f, 16777216.0f, 16777216.0f, 16777216.0f,
                                8192.0f,     8192.0f,     2.0f};
  Buffer d_x(dev, x.data(), x.size() * 4);
  const std::vector<TensorView> dv{{d_x.as<float>(), 3, DType::f32},
                                   {d_x.as<float>() + 3, 0, DType::f32},
                                   {d_x.as<float>() + 3, 4, DType::f32}};
  const std::vector<ConstTensorView> cv(dv.begin(), dv.end());
  const std::size_t ws = dev.norm_workspace_bytes(dv);
  Buffer d_ws(dev, ws), d_partial(dev, sizeof(NormPartial)), d_exact(dev, sizeof(NormPartial));
  Buffer d_result(dev, sizeof(NormResult)), d_clip(dev, 4), d_flag(dev, 4);
  dev.scale_and_norm_partial(dv, 1.0f, d_partial.as<NormPartial>(), d_ws.as(), ws);
  dev.finalize_and_clip(d_partial.as<NormPartial>(), 1.0f, d_result.as<NormResult>(),
                        d_clip.as<float>(), d_flag.as<std::int32_t>());
  ASSERT_EQ(download<std::int32_t>(d_flag), gpu::kFoundInfNeedsExact);
  dev.exact_norm_partial_if_needed(cv, {}, d_flag.as<std::int32_t>(), d_exact.as<NormPartial>(),
                                   d_ws.as(), ws);
  dev.finalize_exact_and_clip(d_exact.as<NormPartial>(), 1.0f, d_result.as<NormResult>(),
                              d_clip.as<float>(), d_flag.as<std::int32_t>());
  EXPECT_EQ(download<std::int32_t>(d_flag), gpu::kFoundInfNone);
  EXPECT_EQ(f32_bits(download<NormResult>(d_result).norm), f32_bits(33554432.0f))
      << "ties to even: 2^25";
  EXPECT_EQ(f32_bits(download<float>(d_clip)), f32_bits((1.0f / (33554432.0f + 1e-6f)) * 1.0f));
}

/// Fills `n` words with a pattern distinct per `k`.
inline std::vector<std::uint32_t> pattern(std::size_t n, std::uint32_t k) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = k * 0x9e3779b9u + static_cast<std::uint32_t>(i);
  return v;
}

/// A long chain through one host staging buffer: d2h copies D_k into it, h2d waits for
/// that copy and copies it on to E_k, d2h waits for that before overwriting the staging
/// buffer. Every E_k must hold D_k's bytes.
inline void copies_are_ordered_by_events(Device& dev) {
  constexpr std::size_t kWords = std::size_t{1} << 18;  // 1 MiB
  constexpr std::uint32_t kBuffers = 6;
  constexpr int kRounds = 3;
  std::vector<Buffer> src, dst;
  for (std::uint32_t k = 0; k < kBuffers; ++k) {
    const std::vector<std::uint32_t> p = pattern(kWords, k);
    src.emplace_back(dev, p.data(), 4 * kWords);
    dst.emplace_back(dev, 4 * kWords);
  }
  void* staging = dev.allocate_host(4 * kWords);
  Event last;
  for (int round = 0; round < kRounds; ++round) {
    for (std::uint32_t k = 0; k < kBuffers; ++k) {
      dev.copy(Queue::d2h, staging, src[k].as(), 4 * kWords);
      const Event copied = dev.record(Queue::d2h);
      dev.wait(Queue::h2d, copied);
      dev.copy(Queue::h2d, dst[k].as(), staging, 4 * kWords);
      last = dev.record(Queue::h2d);
      dev.wait(Queue::d2h, last);
    }
  }
  dev.synchronize(last);
  EXPECT_TRUE(last.complete());
  for (std::uint32_t k = 0; k < kBuffers; ++k) {
    std::vector<std::uint32_t> back(kWords);
    dst[k].download(back.data(), 4 * kWords);
    EXPECT_TRUE(back == pattern(kWords, k)) << "buffer " << k;
  }
  dev.synchronize(Event{});  // an empty event is complete
  dev.deallocate_host(staging);
}

/// zero() on every queue, on device and host memory; allocations are zero-filled and
/// 256-byte aligned.
inline void zero_on_every_queue(Device& dev) {
  constexpr std::size_t kBytes = 10000;
  for (Queue q : {Queue::compute, Queue::d2h, Queue::h2d}) {
    Buffer b(dev, kBytes);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.as()) % 256, 0u);
    std::vector<std::uint8_t> back(kBytes, 7);
    b.download(back.data(), kBytes);
    EXPECT_EQ(back, std::vector<std::uint8_t>(kBytes, 0)) << "allocate() zero-fills";
    const std::vector<std::uint8_t> ones(kBytes, 0xff);
    b.upload(ones.data(), kBytes);
    dev.zero(q, b.as<std::uint8_t>() + 100, 5000);
    const Event e = dev.record(q);
    dev.synchronize(e);
    b.download(back.data(), kBytes);
    for (std::size_t i = 0; i < kBytes; ++i)
      ASSERT_EQ(back[i], i >= 100 && i < 5100 ? 0 : 0xff) << "byte " << i;

    auto* h = static_cast<std::uint8_t*>(dev.allocate_host(kBytes, 0));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(h) % 256, 0u);
    for (std::size_t i = 0; i < kBytes; ++i) ASSERT_EQ(h[i], 0) << "allocate_host() zero-fills";
    std::memset(h, 0xff, kBytes);
    dev.zero(q, h + 1, kBytes - 2);
    dev.synchronize();
    EXPECT_EQ(h[0], 0xff);
    EXPECT_EQ(h[kBytes - 1], 0xff);
    for (std::size_t i = 1; i + 1 < kBytes; ++i) ASSERT_EQ(h[i], 0) << "host byte " << i;
    dev.deallocate_host(h);
  }
  dev.deallocate(nullptr);
  dev.deallocate_host(nullptr);
}

/// The compute queue waits on an h2d copy before a kernel reads it, and d2h waits on the
/// compute queue before reading what the kernel wrote.
inline void compute_waits_for_copies(Device& dev) {
  constexpr std::size_t kN = std::size_t{1} << 22;  // 16 MiB of f32
  auto* h_in = static_cast<float*>(dev.allocate_host(4 * kN));
  auto* h_out = static_cast<float*>(dev.allocate_host(4 * kN));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::size_t i = 0; i < kN; ++i) h_in[i] = nd(rng);
  std::vector<float> ref(h_in, h_in + kN);
  Buffer d_g(dev, 4 * kN);
  const std::vector<TensorView> dv{{d_g.as(), kN, DType::f32}};
  const std::size_t ws = dev.norm_workspace_bytes(dv);
  Buffer d_ws(dev, ws), d_partial(dev, sizeof(NormPartial));

  dev.copy(Queue::h2d, d_g.as(), h_in, 4 * kN);
  dev.wait(Queue::compute, dev.record(Queue::h2d));
  const float scale = 1.0f / 3.0f;
  dev.scale_and_norm_partial(dv, scale, d_partial.as<NormPartial>(), d_ws.as(), ws);
  dev.wait(Queue::d2h, dev.record(Queue::compute));
  dev.copy(Queue::d2h, h_out, d_g.as(), 4 * kN);
  const Event done = dev.record(Queue::d2h);
  dev.synchronize(done);

  const std::vector<TensorView> hv{{ref.data(), kN, DType::f32}};
  reference::scale_(hv, scale);
  EXPECT_EQ(std::memcmp(h_out, ref.data(), 4 * kN), 0);
  const std::vector<ConstTensorView> cv(hv.begin(), hv.end());
  EXPECT_EQ(f32_bits(finalize(download<NormPartial>(d_partial)).norm),
            f32_bits(finalize(reference::norm_partial(cv)).norm));
  dev.deallocate_host(h_in);
  dev.deallocate_host(h_out);
}

template <class F>
Errc error_code(F&& f, std::string* argument = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (argument != nullptr) *argument = e.argument();
    return e.code();
  }
  ADD_FAILURE() << "no stepcore::Error was thrown";
  return Errc::internal;
}

/// Bad arguments get a stepcore::Error naming them, before anything is written.
inline void validation(Device& dev) {
  std::vector<float> x(1000, 1.0f);
  Buffer d_x(dev, x.data(), 4 * x.size());
  const std::vector<TensorView> dv{{d_x.as(), x.size(), DType::f32}};
  const std::size_t ws = dev.norm_workspace_bytes(dv);
  ASSERT_GT(ws, 0u);
  Buffer d_ws(dev, ws), d_partial(dev, sizeof(NormPartial));
  NormPartial sentinel{};
  sentinel.nan_count = 12345;
  d_partial.upload(&sentinel, sizeof sentinel);

  std::string arg;
  EXPECT_EQ(error_code(
                [&] {
                  dev.scale_and_norm_partial(dv, 0.5f, d_partial.as<NormPartial>(), d_ws.as(),
                                             ws - 1);
                },
                &arg),
            Errc::out_of_range);
  EXPECT_EQ(arg, "workspace_bytes");
  const std::vector<ConstTensorView> cv(dv.begin(), dv.end());
  EXPECT_EQ(
      error_code([&] { dev.norm_partial(cv, {}, d_partial.as<NormPartial>(), d_ws.as(), 0); }),
      Errc::out_of_range);
  // A host pointer where device memory is needed.
  std::vector<float> host_x(1000, 1.0f);
  const std::vector<TensorView> hv{{host_x.data(), host_x.size(), DType::f32}};
  EXPECT_EQ(error_code([&] {
              dev.scale_and_norm_partial(hv, 0.5f, d_partial.as<NormPartial>(), d_ws.as(), ws);
            }),
            Errc::invalid_argument);
  EXPECT_EQ(error_code([&] {
              dev.scale_and_norm_partial(dv, -1.0f, d_partial.as<NormPartial>(), d_ws.as(), ws);
            }),
            Errc::invalid_argument);  // finite but negative (docs/numerics.md section 9)
  // A device reads in the gradient's dtype: an f32-rounded read is refused, by name.
  EXPECT_EQ(error_code(
                [&] {
                  dev.norm_partial(cv, GradientRead{0.5f, 1.0f, true}, d_partial.as<NormPartial>(),
                                   d_ws.as(), ws);
                },
                &arg),
            Errc::invalid_argument);
  EXPECT_EQ(arg, "read.as_f32");
  dev.synchronize();
  EXPECT_EQ(download<NormPartial>(d_partial).nan_count, 12345u) << "nothing was written";
  std::vector<float> back(x.size());
  d_x.download(back.data(), 4 * back.size());
  EXPECT_EQ(back, x) << "nothing was scaled";

  // Copies: past the end of an allocation, overlapping, null, a bad queue.
  EXPECT_EQ(error_code([&] { dev.copy(Queue::h2d, d_x.as(), x.data(), 4 * x.size() + 4); }, &arg),
            Errc::out_of_range);
  EXPECT_EQ(arg, "dst");
  EXPECT_EQ(
      error_code([&] { dev.copy(Queue::d2h, back.data(), d_x.as<float>() + 1, 4 * 1000); }, &arg),
      Errc::out_of_range);
  EXPECT_EQ(arg, "src");
  EXPECT_EQ(error_code([&] { dev.copy(Queue::compute, d_x.as<float>() + 1, d_x.as(), 8); }),
            Errc::overlap);
  EXPECT_EQ(error_code([&] { dev.copy(Queue::h2d, nullptr, x.data(), 4); }), Errc::null_pointer);
  EXPECT_EQ(error_code([&] { dev.zero(Queue::h2d, d_x.as<float>() + 999, 8); }),
            Errc::out_of_range);
  EXPECT_EQ(error_code([&] { dev.zero(static_cast<Queue>(7), d_x.as(), 4); }),
            Errc::invalid_argument);
  EXPECT_EQ(error_code([&] { dev.allocate_host(16, -2); }), Errc::invalid_argument);
  dev.copy(Queue::h2d, d_x.as(), x.data(), 0);  // nothing to do
  dev.synchronize();
}

}  // namespace device_cases
