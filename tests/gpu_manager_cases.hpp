// Shared by the device-resident gradient managers' tests (host device: test_gpu_manager,
// CUDA: test_gpu_manager_device): a small model, a deterministic gradient stream, a run
// through a manager of mode none (eager or lazy scale) or optimizer on any device, and
// the independent expectation computed with stepcore::reference alone.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "stepcore/comm.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/reference.hpp"

namespace gpu_manager_cases {

using namespace stepcore;

inline constexpr std::size_t kChunkElements = 5000;  // chunks {0-3}, {4}, {5}, {6}
inline constexpr int kSteps = 3;
inline constexpr int kMicroBatches = 3;
inline constexpr std::uint64_t kFingerprint = 0x5EED;

/// The whole model: sizes 0, 1, 33, 1025, 4097, 70000, 5; parameter 2 does not count
/// towards the norm, parameter 5 has f16 compute weights, parameter 6 none.
inline std::vector<ParamSpec> model(DType grad_dtype) {
  const std::size_t sizes[] = {0, 1, 33, 1025, 4097, 70000, 5};
  std::vector<ParamSpec> out;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    ParamSpec p;
    p.name = "p" + std::to_string(i);
    p.numel = sizes[i];
    p.grad_dtype = grad_dtype;
    p.compute_dtype = i == 5 ? DType::f16 : DType::bf16;
    p.has_compute_weights = i != 6;
    p.counts_toward_norm = i != 2;
    out.push_back(p);
  }
  return out;
}

/// An element of a gradient to replace by NaN.
struct Poison {
  int step = 0, micro = 0;
  std::size_t param = 0;
};

/// What one run does.
struct Scenario {
  DType grad_dtype = DType::bf16;
  std::string optimizer = "adamw";
  std::optional<float> max_norm;
  bool overlap = false;
  std::optional<Poison> poison;
  std::string label() const {
    return std::string(dtype_name(grad_dtype)) + " " + optimizer + " max_norm " +
           (max_norm ? std::to_string(*max_norm) : "none") + (overlap ? " overlap" : "") +
           (poison ? " poisoned" : "");
  }
};

/// Which slice [offset, offset + numel) of each whole parameter a rank holds.
struct Shard {
  std::vector<std::size_t> offset, numel;
};

inline OptimizerSpec optimizer_of(const std::string& name) {
  OptimizerSpec o;
  o.name = name;
  o.adamw.lr = 2e-3;
  o.adamw.weight_decay = 0.1;
  o.sign_sgd.lr = 1e-3;
  o.sign_sgd.weight_decay = 0.05;
  return o;
}

/// Parameter 1 gets no gradient in micro-batch 0, parameter 6 none in step 1.
inline bool has_gradient(int step, int micro, std::size_t i) {
  return !(i == 1 && micro == 0) && !(i == 6 && step == 1);
}

inline float step_scale(int step) { return 1.0f / static_cast<float>(1000 + 37 * step); }

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Element j of the whole parameter i's gradient in (step, micro): several binades.
inline float gradient_value(int step, int micro, std::size_t i, std::size_t j) {
  const std::uint64_t r = mix(
      mix(static_cast<std::uint64_t>(step) << 40 ^ static_cast<std::uint64_t>(micro) << 32 ^ i) ^
      j);
  const float u = static_cast<float>(r >> 40) * 0x1p-24f;
  return (2.0f * u - 1.0f) * std::ldexp(1.0f, -static_cast<int>((r >> 8) & 7));
}

inline float initial_master(std::size_t i, std::size_t j) {
  return 0.05f * gradient_value(-1, 0, i, j);
}

/// The gradient bytes of elements [offset, offset + n) of parameter i in (step, micro).
inline std::vector<std::uint8_t> gradient_bytes(const Scenario& sc, int step, int micro,
                                                std::size_t i, std::size_t offset, std::size_t n) {
  std::vector<std::uint8_t> out(n * dtype_size(sc.grad_dtype));
  for (std::size_t k = 0; k < n; ++k) {
    float x = gradient_value(step, micro, i, offset + k);
    if (sc.poison && sc.poison->step == step && sc.poison->micro == micro &&
        sc.poison->param == i && offset + k == 0)
      x = std::numeric_limits<float>::quiet_NaN();
    if (sc.grad_dtype == DType::f32) {
      std::memcpy(out.data() + 4 * k, &x, 4);
    } else {
      const std::uint16_t h =
          sc.grad_dtype == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
      std::memcpy(out.data() + 2 * k, &h, 2);
    }
  }
  return out;
}

/// One parameter's state: master, moments, compute weights (bytes).
struct ParamState {
  std::vector<float> master, exp_avg, exp_avg_sq;
  std::vector<std::uint8_t> compute;
  bool operator==(const ParamState& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() &&
             (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
    };
    return same(master, o.master) && same(exp_avg, o.exp_avg) && same(exp_avg_sq, o.exp_avg_sq) &&
           same(compute, o.compute);
  }
  /// Returns elements [off, off + n) of every array.
  ParamState slice(std::size_t off, std::size_t n, std::size_t compute_size) const {
    ParamState s;
    auto cut = [&](const std::vector<float>& v) {
      return v.empty() ? v : std::vector<float>(v.begin() + off, v.begin() + off + n);
    };
    s.master = cut(master);
    s.exp_avg = cut(exp_avg);
    s.exp_avg_sq = cut(exp_avg_sq);
    if (!compute.empty())
      s.compute.assign(compute.begin() + off * compute_size,
                       compute.begin() + (off + n) * compute_size);
    return s;
  }
};

/// Everything observable after one step.
struct StepOut {
  std::uint32_t norm_bits = 0;  // report().norm.norm (no overlap)
  bool norm_finite = true;
  std::uint32_t clip_bits = 0;  // report().clip_coefficient
  bool skipped = false;
  std::size_t chunks_skipped = 0;
  std::vector<ParamState> state;
};

/// Runs the stream through a manager of `mode` on `dev`; with `shard`, this rank's slices.
inline std::vector<StepOut> run_manager(device::Device& dev, const Scenario& sc, OffloadMode mode,
                                        bool lazy, comm::Communicator* comm = nullptr,
                                        const Shard* shard = nullptr) {
  ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer = optimizer_of(sc.optimizer);
  cfg.params = model(sc.grad_dtype);
  if (shard)
    for (std::size_t i = 0; i < cfg.params.size(); ++i) cfg.params[i].numel = shard->numel[i];
  cfg.chunk_elements = kChunkElements;
  cfg.device = &dev;
  cfg.comm = comm;
  cfg.layout_fingerprint = kFingerprint;
  cfg.lazy_gpu_scale = lazy;
  auto m = make_gradient_manager(cfg);
  const std::size_t n = cfg.params.size();
  auto offset = [&](std::size_t i) { return shard ? shard->offset[i] : std::size_t{0}; };
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<float> init(cfg.params[i].numel);
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, offset(i) + j);
    m->load_parameter(i, init);
  }
  const bool adamw = sc.optimizer == "adamw";
  std::vector<StepOut> out;
  for (int s = 0; s < kSteps; ++s) {
    m->begin_step(step_scale(s), sc.overlap);
    // The trainer's backward runs on its own queue (h2d stands in for its stream): each
    // write waits for the manager's release of the buffer and hands its event to
    // gradient_ready. No host synchronisation: the host sources live until the report.
    std::deque<std::vector<std::uint8_t>> sources;
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      m->begin_backward(mb + 1 == kMicroBatches);
      for (std::size_t i = n; i-- > 0;) {  // backward: last parameter first
        if (!has_gradient(s, mb, i)) continue;
        const TensorView g = m->gradient(i);
        sources.push_back(gradient_bytes(sc, s, mb, i, offset(i), g.numel));
        device::Event written;
        if (g.numel) {
          dev.wait(device::Queue::h2d, m->gradient_released(i));
          dev.copy(device::Queue::h2d, g.data, sources.back().data(), sources.back().size());
          written = dev.record(device::Queue::h2d);
        }
        m->gradient_ready(i, written);
      }
      m->finish_backward();
    }
    StepOut o;
    std::optional<float> clipped_norm;
    if (sc.max_norm) clipped_norm = m->clip_grad_norm(*sc.max_norm);
    m->step();
    const StepReport rep = m->report();
    o.norm_bits = std::bit_cast<std::uint32_t>(rep.norm.norm);
    o.norm_finite = rep.norm.finite;
    o.clip_bits = std::bit_cast<std::uint32_t>(rep.clip_coefficient);
    o.skipped = rep.skipped;
    o.chunks_skipped = rep.chunks_skipped;
    if (clipped_norm) {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(*clipped_norm), o.norm_bits) << "clip vs report";
      EXPECT_EQ(std::bit_cast<std::uint32_t>(step_scale(s) * rep.clip_coefficient),
                std::bit_cast<std::uint32_t>(m->effective_gradient_scale()));
    }
    for (std::size_t i = 0; i < n; ++i) {
      const ParamSpec& p = cfg.params[i];
      ParamState st;
      st.master.resize(p.numel);
      st.exp_avg.resize(adamw ? p.numel : 0);
      st.exp_avg_sq.resize(adamw ? p.numel : 0);
      st.compute.resize(p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0);
      m->read_parameter(i, st.master, st.exp_avg, st.exp_avg_sq, st.compute);
      o.state.push_back(std::move(st));
    }
    out.push_back(std::move(o));
  }
  m->close();
  return out;
}

/// The independent expectation over the whole model: stepcore::reference only.
inline std::vector<StepOut> run_reference(const Scenario& sc) {
  const std::vector<ParamSpec> params = model(sc.grad_dtype);
  const std::size_t n = params.size();
  const OptimizerSpec opt = optimizer_of(sc.optimizer);
  const bool adamw = sc.optimizer == "adamw";
  std::vector<ParamState> st(n);
  std::vector<std::vector<float>> acc(n);
  std::vector<float> steps(n, 0.0f);
  auto compute_view = [&](std::size_t i) {
    return params[i].has_compute_weights
               ? TensorView{st[i].compute.data(), params[i].numel, params[i].compute_dtype}
               : TensorView{};
  };
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t numel = params[i].numel;
    st[i].master.resize(numel);
    for (std::size_t j = 0; j < numel; ++j) st[i].master[j] = initial_master(i, j);
    if (adamw) {
      st[i].exp_avg.assign(numel, 0.0f);
      st[i].exp_avg_sq.assign(numel, 0.0f);
    }
    acc[i].assign(numel, 0.0f);
    if (params[i].has_compute_weights) {
      st[i].compute.resize(numel * dtype_size(params[i].compute_dtype));
      for (std::size_t j = 0; j < numel; ++j) {
        const std::uint16_t h = params[i].compute_dtype == DType::bf16
                                    ? f32_to_bf16_bits(st[i].master[j])
                                    : f32_to_f16_bits(st[i].master[j]);
        std::memcpy(st[i].compute.data() + 2 * j, &h, 2);
      }
    }
  }
  // Chunks: consecutive parameters up to kChunkElements, never split.
  std::vector<std::pair<std::size_t, std::size_t>> chunks;
  std::size_t elems = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (chunks.empty() || (elems != 0 && elems + params[i].numel > kChunkElements)) {
      chunks.push_back({i, i});
      elems = 0;
    }
    chunks.back().second = i + 1;
    elems += params[i].numel;
  }
  auto update = [&](std::size_t first, std::size_t last, GradientRead read) {
    if (adamw) {
      std::vector<AdamWTensor> t;
      for (std::size_t i = first; i < last; ++i)
        t.push_back({f32_view(st[i].master.data(), params[i].numel),
                     f32_view(st[i].exp_avg.data(), params[i].numel),
                     f32_view(st[i].exp_avg_sq.data(), params[i].numel), &steps[i],
                     const_view(acc[i].data(), params[i].numel), compute_view(i)});
      reference::adamw_step(t, opt.adamw, read);
    } else {
      std::vector<SignSgdTensor> t;
      for (std::size_t i = first; i < last; ++i)
        t.push_back({f32_view(st[i].master.data(), params[i].numel),
                     const_view(acc[i].data(), params[i].numel), compute_view(i)});
      reference::sign_sgd_step(t, opt.sign_sgd, read);
    }
  };
  auto norm = [&](std::size_t first, std::size_t last, float scale, bool counted_only) {
    std::vector<ConstTensorView> views;
    for (std::size_t i = first; i < last; ++i)
      if (!counted_only || params[i].counts_toward_norm)
        views.push_back(const_view(acc[i].data(), params[i].numel));
    return finalize(reference::norm_partial(views, GradientRead{scale, 1.0f}));
  };
  std::vector<StepOut> out;
  for (int s = 0; s < kSteps; ++s) {
    const float scale = step_scale(s);
    std::vector<bool> got(n, false);
    for (int mb = 0; mb < kMicroBatches; ++mb)
      for (std::size_t i = 0; i < n; ++i) {
        if (!has_gradient(s, mb, i)) continue;
        const std::vector<std::uint8_t> g = gradient_bytes(sc, s, mb, i, 0, params[i].numel);
        const AccumulatePair pair{f32_view(acc[i].data(), params[i].numel),
                                  ConstTensorView(g.data(), params[i].numel, sc.grad_dtype),
                                  !got[i]};
        reference::accumulate(std::span(&pair, 1));
        got[i] = true;
      }
    for (std::size_t i = 0; i < n; ++i)
      if (!got[i]) std::fill(acc[i].begin(), acc[i].end(), 0.0f);
    StepOut o;
    if (!sc.overlap) {
      const NormResult r = norm(0, n, scale, true);
      float clip = 1.0f;
      if (sc.max_norm) clip = r.finite ? clip_coefficient(r.norm, *sc.max_norm) : 0.0f;
      o.norm_bits = std::bit_cast<std::uint32_t>(r.norm);
      o.norm_finite = r.finite;
      o.clip_bits = std::bit_cast<std::uint32_t>(clip);
      o.skipped = !r.finite;
      if (r.finite) update(0, n, GradientRead{scale, clip});
    } else {
      o.norm_bits = std::bit_cast<std::uint32_t>(NormResult{}.norm);
      o.clip_bits = std::bit_cast<std::uint32_t>(1.0f);
      for (const auto& [first, last] : chunks) {
        if (norm(first, last, scale, false).finite)
          update(first, last, GradientRead{scale, 1.0f});
        else
          ++o.chunks_skipped;
      }
    }
    o.state = st;
    out.push_back(std::move(o));
  }
  return out;
}

/// Expects `got` (a rank's run, `shard` of the model, or the whole) to equal `want`.
inline void expect_same(const std::vector<StepOut>& got, const std::vector<StepOut>& want,
                        const std::string& what, const Shard* shard = nullptr,
                        DType grad_dtype = DType::bf16) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const std::vector<ParamSpec> params = model(grad_dtype);
  for (std::size_t s = 0; s < got.size(); ++s) {
    EXPECT_EQ(got[s].norm_bits, want[s].norm_bits) << what << " step " << s << ": norm";
    EXPECT_EQ(got[s].norm_finite, want[s].norm_finite) << what << " step " << s;
    EXPECT_EQ(got[s].clip_bits, want[s].clip_bits) << what << " step " << s << ": clip";
    EXPECT_EQ(got[s].skipped, want[s].skipped) << what << " step " << s;
    EXPECT_EQ(got[s].chunks_skipped, want[s].chunks_skipped) << what << " step " << s;
    ASSERT_EQ(got[s].state.size(), want[s].state.size()) << what;
    for (std::size_t i = 0; i < got[s].state.size(); ++i) {
      const ParamState w = shard ? want[s].state[i].slice(shard->offset[i], shard->numel[i],
                                                          dtype_size(params[i].compute_dtype))
                                 : want[s].state[i];
      ASSERT_TRUE(got[s].state[i] == w)
          << what << " step " << s << " parameter " << i << ": state bits differ";
    }
  }
}

/// Every scenario of the differential test.
inline std::vector<Scenario> all_scenarios() {
  std::vector<Scenario> out;
  for (DType d : {DType::bf16, DType::f32})
    for (const char* opt : {"adamw", "sign_sgd"}) {
      for (std::optional<float> mn :
           {std::optional<float>{}, std::optional<float>{0.05f}, std::optional<float>{100.0f}})
        out.push_back({d, opt, mn, false, {}});
      out.push_back({d, opt, {}, true, {}});
    }
  return out;
}

/// The three device-resident variants: {mode, lazy, label}.
struct Variant {
  OffloadMode mode;
  bool lazy;
  const char* label;
};
inline constexpr Variant kVariants[] = {{OffloadMode::none, false, "none (eager)"},
                                        {OffloadMode::none, true, "none (lazy)"},
                                        {OffloadMode::optimizer, false, "optimizer"}};

/// The differential test body on devices from `make_device`.
template <class MakeDevice>
void differential(MakeDevice make_device) {
  for (const Scenario& sc : all_scenarios()) {
    SCOPED_TRACE(sc.label());
    const auto want = run_reference(sc);
    ASSERT_FALSE(want[0].state[5] == want[2].state[5]) << "the stream must change the state";
    if (sc.max_norm && *sc.max_norm < 1.0f)
      ASSERT_LT(std::bit_cast<float>(want[0].clip_bits), 1.0f) << "0.05 must clip";
    for (const Variant& v : kVariants) {
      auto dev = make_device();
      expect_same(run_manager(*dev, sc, v.mode, v.lazy), want, v.label, nullptr, sc.grad_dtype);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

/// Non-finite gradients (a NaN in parameter 4, step 1, micro-batch 1): the step (or with
/// overlap, only chunk 1) is skipped and reported; counters do not advance (step 2 still
/// matches the reference, which skips without advancing).
template <class MakeDevice>
void non_finite(MakeDevice make_device) {
  for (std::optional<float> mn : {std::optional<float>{}, std::optional<float>{0.5f}})
    for (bool overlap : {false, true}) {
      if (overlap && mn) continue;
      for (const char* opt : {"adamw", "sign_sgd"}) {
        const Scenario sc{DType::bf16, opt, mn, overlap, Poison{1, 1, 4}};
        SCOPED_TRACE(sc.label());
        const auto want = run_reference(sc);
        if (!overlap) {
          ASSERT_TRUE(want[1].skipped);
          ASSERT_TRUE(want[1].state == want[0].state);
        } else {
          ASSERT_EQ(want[1].chunks_skipped, 1u);
          ASSERT_TRUE(want[1].state[4] == want[0].state[4]);
          ASSERT_FALSE(want[1].state[5] == want[0].state[5]);
        }
        for (const Variant& v : kVariants) {
          auto dev = make_device();
          expect_same(run_manager(*dev, sc, v.mode, v.lazy), want, v.label);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
}

}  // namespace gpu_manager_cases
