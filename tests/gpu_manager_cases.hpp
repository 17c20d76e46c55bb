// Shared by the device-resident gradient managers' tests (host device: test_gpu_manager,
// CUDA: test_gpu_manager_device): a small model, a deterministic gradient stream, a run
// through a manager of mode none (eager or lazy scale) or optimizer on any device, and
// the independent expectation: the stream through manager_model (stepcore::reference).
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

#include "manager_model.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/managers.hpp"

namespace gpu_manager_cases {

using namespace stepcore;
using manager_model::ParamState;

inline constexpr std::size_t kManagerChunkElements = 5000;  // chunks {0-3}, {4}, {5}, {6}
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
  OptimizerConfig optimizer = AdamWConfig{};
  std::optional<float> max_norm;
  bool overlap = false;
  std::optional<Poison> poison;
  AdamWFormula formula = AdamWConfig{}.formula;
  std::string label() const {
    return std::string(dtype_name(grad_dtype)) + " " + std::string(optimizer_name(optimizer)) +
           (formula == AdamWFormula::native ? " (native)" : "") + " max_norm " +
           (max_norm ? std::to_string(*max_norm) : "none") + (overlap ? " overlap" : "") +
           (poison ? " poisoned" : "");
  }
};

/// Which slice [offset, offset + numel) of each whole parameter a rank holds.
struct Shard {
  std::vector<std::size_t> offset, numel;
};

/// Returns `kind` with AdamW's lr 2e-3, weight decay 0.1 and `formula`, or SignSGD's lr
/// 1e-3 and weight decay 0.05 (the others: lr 1e-3, weight decay 0.05).
inline OptimizerConfig optimizer_of(OptimizerConfig kind,
                                    AdamWFormula formula = AdamWConfig{}.formula) {
  std::visit(
      [](auto& c) {
        c.lr = 1e-3;
        c.weight_decay = 0.05;
      },
      kind);
  if (auto* a = std::get_if<AdamWConfig>(&kind)) {
    a->formula = formula;
    a->lr = 2e-3;
    a->weight_decay = 0.1;
  }
  return kind;
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

/// Everything observable after one step.
struct StepOut {
  std::uint32_t norm_bits = 0;  // report().norm.norm
  bool norm_finite = true;
  std::uint32_t clip_bits = 0;  // report().clip_coefficient
  bool skipped = false;
  std::size_t speculated = 0, committed = 0, rolled_back = 0;  // report()'s counts
  std::vector<ParamState> state;
};

/// Runs the stream through a manager of `mode` on `dev`; with `shard`, this rank's slices.
inline std::vector<StepOut> run_manager(device::Device& dev, const Scenario& sc, OffloadMode mode,
                                        bool lazy, comm::Communicator* comm = nullptr,
                                        const Shard* shard = nullptr) {
  ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer = optimizer_of(sc.optimizer, sc.formula);
  cfg.params = model(sc.grad_dtype);
  if (shard)
    for (std::size_t i = 0; i < cfg.params.size(); ++i) cfg.params[i].numel = shard->numel[i];
  cfg.chunk_elements = kManagerChunkElements;
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
    o.speculated = rep.chunks_speculated;
    o.committed = rep.chunks_committed;
    o.rolled_back = rep.chunks_rolled_back;
    if (clipped_norm) {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(*clipped_norm), o.norm_bits) << "clip vs report";
      EXPECT_EQ(std::bit_cast<std::uint32_t>(step_scale(s) * rep.clip_coefficient),
                std::bit_cast<std::uint32_t>(m->effective_gradient_scale()));
    }
    for (std::size_t i = 0; i < n; ++i) {
      const ParamSpec& p = cfg.params[i];
      ParamState st;
      st.master.resize(p.numel);
      std::vector<SlotOut> named;
      st.slots.resize(m->state_slot_names().size(), std::vector<float>(p.numel));
      for (std::size_t k = 0; k < st.slots.size(); ++k)
        named.push_back({m->state_slot_names()[k], st.slots[k]});
      st.compute.resize(p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0);
      m->read_parameter(i, st.master, named, st.compute);
      o.state.push_back(std::move(st));
    }
    out.push_back(std::move(o));
  }
  m->close();
  return out;
}

/// The independent expectation over the whole model: manager_model (stepcore::reference).
inline std::vector<StepOut> run_reference(const Scenario& sc) {
  const manager_model::Setup setup{model(sc.grad_dtype), optimizer_of(sc.optimizer, sc.formula),
                                   kManagerChunkElements, sc.max_norm, sc.overlap};
  auto gradient = [&](int s, int mb, std::size_t i) {
    return gradient_bytes(sc, s, mb, i, 0, setup.params[i].numel);
  };
  const manager_model::Stream stream = manager_model::fixed_stream(
      kSteps, kMicroBatches, step_scale, has_gradient, gradient, initial_master);
  std::vector<StepOut> out;
  for (const manager_model::Step& step : manager_model::run(setup, stream).steps) {
    StepOut o;
    o.norm_bits = std::bit_cast<std::uint32_t>(step.report.norm.norm);
    o.norm_finite = step.report.norm.finite;
    o.clip_bits = std::bit_cast<std::uint32_t>(step.report.clip_coefficient);
    o.skipped = step.report.skipped;
    o.speculated = step.report.chunks_speculated;
    o.committed = step.report.chunks_committed;
    o.rolled_back = step.report.chunks_rolled_back;
    o.state = step.state;
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
    EXPECT_EQ(got[s].speculated, want[s].speculated) << what << " step " << s << ": speculated";
    EXPECT_EQ(got[s].committed, want[s].committed) << what << " step " << s << ": committed";
    EXPECT_EQ(got[s].rolled_back, want[s].rolled_back) << what << " step " << s << ": rolled back";
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
    for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}}) {
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

/// Non-finite gradients (a NaN in parameter 4, step 1, micro-batch 1): the whole step, with
/// or without overlap, is skipped and reported; counters do not advance (step 2 still
/// matches the reference, which skips without advancing).
template <class MakeDevice>
void non_finite(MakeDevice make_device) {
  for (std::optional<float> mn : {std::optional<float>{}, std::optional<float>{0.5f}})
    for (bool overlap : {false, true}) {
      for (OptimizerConfig opt : std::vector<OptimizerConfig>{AdamWConfig{}, SignSgdConfig{}}) {
        const Scenario sc{DType::bf16, opt, mn, overlap, Poison{1, 1, 4}};
        SCOPED_TRACE(sc.label());
        const auto want = run_reference(sc);
        // Overlap or not, the whole step is skipped: no chunk of it changes.
        ASSERT_TRUE(want[1].skipped);
        ASSERT_TRUE(want[1].state == want[0].state);
        if (overlap) ASSERT_EQ(want[1].rolled_back, want[1].speculated);
        for (const Variant& v : kVariants) {
          auto dev = make_device();
          expect_same(run_manager(*dev, sc, v.mode, v.lazy), want, v.label);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
}

}  // namespace gpu_manager_cases
