// The CPU engine against the scalar reference, bit for bit: every operation, every
// gradient and output dtype, both AdamW formulas, weight decay on and off, boundary
// and odd sizes, hundreds of tensors per call, misaligned pointers — on every ISA this
// processor supports and with 1, 2, 3 and 7 threads.
#include <gtest/gtest.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <array>
#include <bit>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa_list.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/error.hpp"
#include "stepcore/reference.hpp"

namespace {

// The caller's floating-point control word (x86 MXCSR, aarch64 FPCR) and its flush bits,
// for the test that sets them before calling the engine.
#if defined(__x86_64__)
constexpr std::uint64_t kFlushBits = (1u << 15) | (1u << 6);  // FTZ | DAZ
std::uint64_t get_fp_control() { return _mm_getcsr(); }
void set_fp_control(std::uint64_t v) { _mm_setcsr(static_cast<unsigned>(v)); }
#elif defined(__aarch64__)
// FZ, and FEAT_AFP's FIZ (flush inputs) and AH (alternate handling): RES0 without FEAT_AFP.
constexpr std::uint64_t kFlushBits = (1ull << 24) | (1ull << 0) | (1ull << 1);
std::uint64_t get_fp_control() {
  std::uint64_t r;
  __asm__ volatile("mrs %0, fpcr" : "=r"(r));
  return r;
}
void set_fp_control(std::uint64_t v) { __asm__ volatile("msr fpcr, %0" : : "r"(v)); }
#endif

using namespace stepcore;

/// Thread counts of the single-step suites: 1, 2, 3 and 7; 1 and 3 under the quick profile.
std::vector<int> thread_counts() {
  return testing_support::by_profile(std::vector<int>{1, 2, 3, 7}, std::vector<int>{1, 3},
                                     "threads 1 and 3 only");
}

/// Boundary sizes of the issue plus the chunk size +-1.
std::vector<std::size_t> boundary_sizes() {
  const std::size_t c = cpu::Engine::kWorkChunkElements;
  return {0,  1,   7,   15,  16,   17,   31,   32,    33, 63,   64,
          65, 127, 128, 129, 1023, 1024, 1025, c - 1, c,  c + 1};
}

/// Returns true when two f32 arrays have equal bits, treating any two NaNs as equal
/// (the spec leaves NaN payloads of arithmetic unspecified).
::testing::AssertionResult same_f32(const float* a, const float* b, std::size_t n,
                                    const char* what) {
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t x = f32_bits(a[i]), y = f32_bits(b[i]);
    if (x == y) continue;
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    return ::testing::AssertionFailure()
           << what << "[" << i << "]: reference 0x" << std::hex << x << " engine 0x" << y;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_bytes(const void* a, const void* b, std::size_t n,
                                      const char* what) {
  if (std::memcmp(a, b, n) == 0) return ::testing::AssertionSuccess();
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  std::size_t i = 0;
  while (x[i] == y[i]) ++i;
  return ::testing::AssertionFailure() << what << ": first differing byte " << i;
}

/// Fills raw storage of `dtype` with values spread over many binades, including
/// zeros, negative zeros and (optionally) a few subnormals.
void fill(void* data, DType dtype, std::size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 99);
  for (std::size_t i = 0; i < n; ++i) {
    float x = nd(rng) * scale * std::ldexp(1.0f, pick(rng) % 13 - 6);
    const int p = pick(rng);
    if (p == 0) x = 0.0f;
    if (p == 1) x = -0.0f;
    switch (dtype) {
      case DType::f32:
        static_cast<float*>(data)[i] = x;
        break;
      case DType::bf16:
        static_cast<std::uint16_t*>(data)[i] = f32_to_bf16_bits(x);
        break;
      case DType::f16:
        static_cast<std::uint16_t*>(data)[i] = f32_to_f16_bits(x);
        break;
    }
  }
}

/// A list of tensors with all their buffers, in two identical copies (reference,
/// engine). Each tensor's buffers start one element past a 64-byte boundary so
/// no pointer is vector-aligned.
struct Model {
  std::vector<std::size_t> sizes;
  DType grad_dtype;
  int out_kind;  // 0 none, else 1 + dtype
  std::vector<std::vector<float>> p, m, v;
  std::vector<std::vector<std::uint8_t>> g, out;
  std::vector<float> steps;

  Model(std::vector<std::size_t> s, DType gd, int ok, std::uint32_t seed)
      : sizes(std::move(s)), grad_dtype(gd), out_kind(ok) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t n : sizes) {
      p.emplace_back(n + 1);
      m.emplace_back(n + 1);
      v.emplace_back(n + 1);
      for (std::size_t i = 0; i <= n; ++i) {
        p.back()[i] = nd(rng) * 0.05f;
        m.back()[i] = nd(rng) * 1e-3f;
        v.back()[i] = std::abs(nd(rng)) * 1e-6f;
      }
      g.emplace_back((n + 1) * 4);
      fill(g.back().data() + dtype_size(gd), gd, n, rng, 1e-2f);
      out.emplace_back((n + 1) * 4, 0xAB);
      steps.push_back(static_cast<float>(rng() % 5));
    }
  }

  /// The AdamW tensors: state[0] exp_avg, state[1] exp_avg_sq, a step counter each.
  std::vector<OptimizerTensor> adamw() {
    std::vector<OptimizerTensor> t;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t n = sizes[k];
      OptimizerTensor a;
      a.param = {p[k].data() + 1, n, DType::f32};
      a.state[0] = {m[k].data() + 1, n, DType::f32};
      a.state[1] = {v[k].data() + 1, n, DType::f32};
      a.step = &steps[k];
      a.grad = {g[k].data() + dtype_size(grad_dtype), n, grad_dtype};
      if (out_kind) {
        const auto od = static_cast<DType>(out_kind - 1);
        a.compute_param = {out[k].data() + dtype_size(od), n, od};
      }
      t.push_back(a);
    }
    return t;
  }
  /// The SignSGD tensors: the parameter only (no slot, no counter).
  std::vector<OptimizerTensor> sign_sgd() {
    std::vector<OptimizerTensor> t;
    for (const OptimizerTensor& a : adamw()) {
      OptimizerTensor s;
      s.param = a.param;
      s.grad = a.grad;
      s.compute_param = a.compute_param;
      t.push_back(s);
    }
    return t;
  }
};

::testing::AssertionResult same_model(const Model& r, const Model& e) {
  for (std::size_t k = 0; k < r.sizes.size(); ++k) {
    const std::size_t n = r.sizes[k] + 1;
    if (auto a = same_f32(r.p[k].data(), e.p[k].data(), n, "param"); !a)
      return a << " tensor " << k;
    if (auto a = same_f32(r.m[k].data(), e.m[k].data(), n, "exp_avg"); !a)
      return a << " tensor " << k;
    if (auto a = same_f32(r.v[k].data(), e.v[k].data(), n, "exp_avg_sq"); !a)
      return a << " tensor " << k;
    if (auto a = same_bytes(r.out[k].data(), e.out[k].data(), r.out[k].size(), "compute_param"); !a)
      return a << " tensor " << k;
    if (auto a = same_bytes(r.g[k].data(), e.g[k].data(), r.g[k].size(), "grad"); !a)
      return a << " tensor " << k;
    if (f32_bits(r.steps[k]) != f32_bits(e.steps[k]))
      return ::testing::AssertionFailure() << "step of tensor " << k;
  }
  return ::testing::AssertionSuccess();
}

struct Combo {
  DType grad;
  int out;
  AdamWFormula formula;
  double wd;
};

std::string name(const Combo& c) {
  return std::string(dtype_name(c.grad)) + "/out" + std::to_string(c.out) +
         (c.formula == AdamWFormula::torch ? "/torch" : "/native") + "/wd" + std::to_string(c.wd);
}

std::vector<Combo> all_combos() {
  std::vector<Combo> out;
  for (DType g : {DType::f32, DType::bf16, DType::f16})
    for (int o = 0; o < 4; ++o)
      for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch})
        for (double wd : {0.0, 0.1}) out.push_back({g, o, f, wd});
  return out;
}

TEST(CpuEngine, AdamWMatchesReferenceOnEveryIsaAndThreadCount) {
  const auto sizes = boundary_sizes();
  int idx = 0;
  for (const Combo& c : all_combos()) {
    SCOPED_TRACE(name(c));
    AdamWConfig cfg;
    cfg.formula = c.formula;
    cfg.weight_decay = c.wd;
    cfg.beta1 = (idx % 3 == 0) ? 0.3 : 0.9;  // torch's other lerp branch too
    const GradientRead read{(idx % 2) ? 1.0f / 3000.0f : 1.0f, (idx % 4 == 1) ? 0.37f : 1.0f};
    Model ref(sizes, c.grad, c.out, 100 + idx);
    Model input = ref;
    auto rt = ref.adamw();
    reference::adamw_step(rt, cfg, read);
    for (cpu::Isa isa : testing_support::isas_under_test()) {
      for (int threads : thread_counts()) {
        SCOPED_TRACE(std::string(cpu::isa_name(isa)) + " threads " + std::to_string(threads));
        Model eng = input;
        auto et = eng.adamw();
        cpu::Engine(cpu::EngineConfig{isa, threads}).step(et, cfg, read);
        ASSERT_TRUE(same_model(ref, eng));
      }
    }
    ++idx;
  }
}

TEST(CpuEngine, SignSgdMatchesReference) {
  const auto sizes = boundary_sizes();
  int idx = 0;
  for (DType g : {DType::f32, DType::bf16, DType::f16}) {
    for (int o = 0; o < 4; ++o) {
      for (double wd : {0.0, 0.05}) {
        SCOPED_TRACE(std::string(dtype_name(g)) + " out " + std::to_string(o) + " wd " +
                     std::to_string(wd));
        Model ref(sizes, g, o, 500 + idx++);
        Model input = ref;
        auto rt = ref.sign_sgd();
        const SignSgdConfig cfg{1e-3, wd};
        reference::sign_sgd_step(rt, cfg);
        for (cpu::Isa isa : testing_support::isas_under_test()) {
          for (int threads : thread_counts()) {
            Model eng = input;
            auto et = eng.sign_sgd();
            cpu::Engine(cpu::EngineConfig{isa, threads}).step(et, cfg);
            ASSERT_TRUE(same_model(ref, eng)) << cpu::isa_name(isa) << " threads " << threads;
          }
        }
      }
    }
  }
}

TEST(CpuEngine, GenericStepRefusesSlotsAndCountersTheOptimizerLacksBeforeWriting) {
  Model m({5, 9}, DType::f32, 0, 3);
  const Model before = m;
  const cpu::Engine e(cpu::EngineConfig{testing_support::baseline_isa(), 1});
  auto expect_refused = [&](std::vector<OptimizerTensor> t, auto config, Errc code,
                            const std::string& arg) {
    try {
      e.step(std::span<const OptimizerTensor>(t), config);
      ADD_FAILURE() << "accepted; expected an error naming " << arg;
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), code) << err.what();
      EXPECT_EQ(err.argument(), arg) << err.what();
    }
    EXPECT_TRUE(same_model(before, m)) << "a refused call wrote";
  };
  {
    auto t = m.adamw();
    t[1].state[2] = t[0].state[0];  // AdamW keeps two slots
    expect_refused(t, AdamWConfig{}, Errc::invalid_argument, "tensors[1].state[2]");
  }
  {
    auto t = m.adamw();
    t[0].state[1] = {};  // exp_avg_sq missing: named by its slot name
    expect_refused(t, AdamWConfig{}, Errc::size_mismatch, "tensors[0].exp_avg_sq");
  }
  {
    auto t = m.adamw();
    t[1].step = nullptr;
    expect_refused(t, AdamWConfig{}, Errc::null_pointer, "tensors[1].step");
  }
  {
    auto t = m.adamw();
    // A source reading a range the call writes: the error names the written buffer and
    // the source (by its slot's source name).
    t[0].state_src[1] = ConstTensorView(t[1].param.data, 5, DType::f32);
    try {
      e.step(std::span<const OptimizerTensor>(t), AdamWConfig{});
      ADD_FAILURE() << "an overlapping source was accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), Errc::overlap);
      EXPECT_EQ(err.argument(), "tensors[1].param");
      EXPECT_NE(std::string(err.what()).find("tensors[0].exp_avg_sq_src"), std::string::npos)
          << err.what();
    }
    EXPECT_TRUE(same_model(before, m));
  }
  {
    AdamWConfig bad;
    bad.beta2 = 1.0;
    expect_refused(m.adamw(), bad, Errc::invalid_argument, "config.beta2");
  }
  {
    auto t = m.sign_sgd();
    t[0].step = &m.steps[0];  // SignSGD keeps no counter
    expect_refused(t, SignSgdConfig{}, Errc::invalid_argument, "tensors[0].step");
  }
  {
    auto t = m.sign_sgd();
    t[1].state[0] = t[1].param;
    expect_refused(t, SignSgdConfig{}, Errc::invalid_argument, "tensors[1].state[0]");
  }
}

/// Stores x rounded to `dtype` (nearest even) as element i of raw storage.
void put(std::uint8_t* data, DType dtype, std::size_t i, float x) {
  switch (dtype) {
    case DType::f32:
      std::memcpy(data + 4 * i, &x, 4);
      break;
    case DType::bf16: {
      const std::uint16_t b = f32_to_bf16_bits(x);
      std::memcpy(data + 2 * i, &b, 2);
      break;
    }
    case DType::f16: {
      const std::uint16_t b = f32_to_f16_bits(x);
      std::memcpy(data + 2 * i, &b, 2);
      break;
    }
  }
}

/// Tensors of a generic optimizer with `slots` state arrays in the param's dtype (f32,
/// bf16 or f16), each buffer one element past a 64-byte boundary, as OptimizerTensor. Out
/// of place (`oop`): the state is read from a second set of buffers and written to the
/// first, which hold garbage before each step; flip() makes the new state the next source.
struct SlotModel {
  std::vector<std::size_t> sizes;
  DType grad_dtype;
  int out_kind;
  int slots;
  DType param_dtype;
  bool counters;
  bool oop;
  std::vector<std::vector<std::uint8_t>> p, s[3], q, r[3];  // q, r: the sources (oop)
  std::vector<std::vector<std::uint8_t>> g, out;
  std::vector<float> steps;

  SlotModel(std::vector<std::size_t> sz, DType gd, int ok, int ns, std::uint32_t seed,
            DType pd = DType::f32, bool with_counters = true, bool out_of_place = false)
      : sizes(std::move(sz)),
        grad_dtype(gd),
        out_kind(ok),
        slots(ns),
        param_dtype(pd),
        counters(with_counters),
        oop(out_of_place) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const std::size_t es = dtype_size(pd);
    for (std::size_t n : sizes) {
      p.emplace_back((n + 1) * es);
      for (auto& v : s) v.emplace_back((n + 1) * es);
      for (std::size_t i = 0; i <= n; ++i) {
        put(p.back().data(), pd, i, nd(rng) * 0.05f);
        put(s[0].back().data(), pd, i, nd(rng) * 1e-3f);
        put(s[1].back().data(), pd, i, std::abs(nd(rng)) * 1e-6f);
        put(s[2].back().data(), pd, i, std::abs(nd(rng)) * 1e-6f);  // a max: above v or not
      }
      g.emplace_back((n + 1) * 4);
      fill(g.back().data() + dtype_size(gd), gd, n, rng, 1e-2f);
      out.emplace_back((n + 1) * 4, 0xAB);
      steps.push_back(0.0f);  // the first step first: SGD's buffer starts as the gradient
    }
    if (oop) {
      q = p;
      for (int j = 0; j < 3; ++j) r[j] = s[j];
      scramble();
    }
  }
  // Garbage in the destinations of an out-of-place step.
  void scramble() {
    for (auto& b : p) std::fill(b.begin(), b.end(), std::uint8_t{0xA5});
    for (auto& v : s)
      for (auto& b : v) std::fill(b.begin(), b.end(), std::uint8_t{0x5A});
  }
  // Out of place: the new state becomes the next step's source.
  void flip() {
    if (!oop) return;
    std::swap(p, q);
    for (int j = 0; j < 3; ++j) std::swap(s[j], r[j]);
    scramble();
  }
  // Fresh gradients for the next step (both copies draw the same ones from `seed`).
  void regrad(std::uint32_t seed) {
    std::mt19937 rng(seed);
    for (std::size_t k = 0; k < sizes.size(); ++k)
      fill(g[k].data() + dtype_size(grad_dtype), grad_dtype, sizes[k], rng, 1e-2f);
  }
  std::vector<OptimizerTensor> tensors() {
    std::vector<OptimizerTensor> t;
    const std::size_t es = dtype_size(param_dtype);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t n = sizes[k];
      OptimizerTensor a;
      a.param = {p[k].data() + es, n, param_dtype};
      for (int j = 0; j < slots; ++j) a.state[j] = {s[j][k].data() + es, n, param_dtype};
      if (oop) {
        a.param_src = {q[k].data() + es, n, param_dtype};
        for (int j = 0; j < slots; ++j) a.state_src[j] = {r[j][k].data() + es, n, param_dtype};
      }
      if (counters) a.step = &steps[k];
      a.grad = {g[k].data() + dtype_size(grad_dtype), n, grad_dtype};
      if (out_kind) {
        const auto od = static_cast<DType>(out_kind - 1);
        a.compute_param = {out[k].data() + dtype_size(od), n, od};
      }
      t.push_back(a);
    }
    return t;
  }
};

/// Equal bits in every buffer of two SlotModels: f32 arrays with any two NaNs equal (the
/// spec leaves an f32 NaN's payload open), bf16/f16 arrays byte for byte (their
/// conversion defines a NaN's bits).
::testing::AssertionResult same_slot_model(const SlotModel& r, const SlotModel& e) {
  auto same = [&](const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b,
                  const char* what) {
    if (r.param_dtype != DType::f32) return same_bytes(a.data(), b.data(), a.size(), what);
    return same_f32(reinterpret_cast<const float*>(a.data()),
                    reinterpret_cast<const float*>(b.data()), a.size() / 4, what);
  };
  for (std::size_t k = 0; k < r.sizes.size(); ++k) {
    if (auto a = same(r.p[k], e.p[k], "param"); !a) return a << " tensor " << k;
    for (int j = 0; j < 3; ++j)
      if (auto a = same(r.s[j][k], e.s[j][k], "state"); !a)
        return a << " slot " << j << " tensor " << k;
    if (r.oop) {
      if (auto a = same(r.q[k], e.q[k], "param_src"); !a) return a << " tensor " << k;
      for (int j = 0; j < 3; ++j)
        if (auto a = same(r.r[j][k], e.r[j][k], "state_src"); !a)
          return a << " slot " << j << " tensor " << k;
    }
    if (auto a = same_bytes(r.out[k].data(), e.out[k].data(), r.out[k].size(), "compute_param"); !a)
      return a << " tensor " << k;
    if (f32_bits(r.steps[k]) != f32_bits(e.steps[k]))
      return ::testing::AssertionFailure() << "step of tensor " << k;
  }
  return ::testing::AssertionSuccess();
}

/// Steps of `config` (`slots` state arrays) by the reference and by the engine's generic
/// entry on every ISA, threads 1 and 3, over the boundary sizes: equal bits after every
/// step. f32 params: 3 steps, every gradient dtype, without and with a bf16 compute
/// output. bf16 and f16 params (docs/numerics.md 7.3): 10 steps (4 under the quick profile),
/// every gradient dtype, in place and out of place.
template <class Config, class Reference>
void expect_engine_equals_reference(const Config& config, int slots, Reference reference,
                                    std::uint32_t seed, bool counters = true) {
  // Step s reads with reads[s % 4]: exact, scale and clip rounded in f32 (as_f32), the
  // same rounded in the gradient's dtype, and scale alone.
  const GradientRead reads[] = {
      {1.0f, 1.0f}, {1.0f / 3000.0f, 0.37f, true}, {1.0f / 3000.0f, 0.37f}, {2.0f, 1.0f}};
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  for (int pi = 0; pi < 3; ++pi) {
    const DType pd = dtypes[pi];
    const bool f32 = pd == DType::f32;
    const int steps = f32 ? testing_support::by_profile(4, 3, "f32 params: 3 steps, not 4")
                          : testing_support::by_profile(10, 4, "16-bit params: 4 steps, not 10");
    for (int gi = 0; gi < 3; ++gi) {
      const DType gd = dtypes[gi];
      for (int variant : {0, 1}) {  // f32: output kind 0 or 2 (bf16); 16-bit: in place or not
        // The quick profile: one variant per dtype pair, each param dtype taking both.
        if (testing_support::by_profile(false, (pi + gi) % 2 != variant,
                                        "one variant per dtype pair, alternating"))
          continue;
        const int o = f32 && variant == 1 ? 2 : 0;
        const bool oop = !f32 && variant == 1;
        SCOPED_TRACE(std::string("param ") + std::string(dtype_name(pd)) + " grad " +
                     std::string(dtype_name(gd)) + " out " + std::to_string(o) +
                     (oop ? " out of place" : ""));
        SlotModel ref(boundary_sizes(), gd, o, slots, seed, pd, counters, oop);
        const SlotModel input = ref;
        std::vector<SlotModel> eng;
        std::vector<std::pair<cpu::Isa, int>> runs;
        for (cpu::Isa isa : testing_support::isas_under_test())
          for (int threads : {1, 3}) {
            eng.push_back(input);
            runs.emplace_back(isa, threads);
          }
        for (int step = 0; step < steps; ++step) {
          // The step's gradients are drawn once and copied into every run (drawing them is
          // most of the test's work); the reference reads them only.
          if (step > 0) ref.regrad(seed + 17 * step);
          const auto grads = ref.g;
          const auto rt = ref.tensors();
          reference(std::span<const OptimizerTensor>(rt), config, reads[step % 4]);
          for (std::size_t r = 0; r < runs.size(); ++r) {
            SCOPED_TRACE(std::string(cpu::isa_name(runs[r].first)) + " threads " +
                         std::to_string(runs[r].second) + " step " + std::to_string(step + 1));
            eng[r].g = grads;
            const auto et = eng[r].tensors();
            cpu::Engine(cpu::EngineConfig{runs[r].first, runs[r].second})
                .step(std::span<const OptimizerTensor>(et), config, reads[step % 4]);
            ASSERT_TRUE(same_slot_model(ref, eng[r]));
            eng[r].flip();
          }
          ref.flip();
        }
      }
    }
  }
}

TEST(CpuEngine, SignSgdOverOptimizerTensorsMatchesTheReferenceInEveryParamDtype) {
  int idx = 0;
  for (double wd : {0.0, 0.05}) {
    SCOPED_TRACE("wd " + std::to_string(wd));
    expect_engine_equals_reference(
        SignSgdConfig{1e-3, wd}, 0,
        [](std::span<const OptimizerTensor> t, const SignSgdConfig& cfg, GradientRead read) {
          reference::sign_sgd_step(t, cfg, read);
        },
        1400 + idx++, /*counters=*/false);
  }
}

TEST(CpuEngine, AdamWNativeFormulaTakesParamsInTheModelsDtype) {
  AdamWConfig c;
  c.formula = AdamWFormula::native;
  c.weight_decay = 0.1;
  expect_engine_equals_reference(
      c, 2,
      [](std::span<const OptimizerTensor> t, const AdamWConfig& cfg, GradientRead read) {
        reference::adamw_step(t, cfg, read);
      },
      1450);
}

TEST(CpuEngine, LowPrecisionParamsRefuseMixedDtypesAndComputeOutputsBeforeWriting) {
  // Params and state share one dtype (docs/numerics.md 7.3): a slot or source in another
  // dtype, or a compute output beside a bf16/f16 param, is named before anything is written;
  // the reference refuses the same argument with the same code.
  for (DType pd : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(pd)));
    SlotModel m({5, 9}, DType::f32, 0, 3, 31, pd);
    SlotModel other({5, 9}, DType::f32, 0, 3, 32, pd == DType::bf16 ? DType::f16 : DType::bf16);
    SlotModel wide({5, 9}, DType::f32, 2, 3, 33, DType::f32);
    const SlotModel before = m;
    const cpu::Engine e(cpu::EngineConfig{testing_support::baseline_isa(), 1});
    auto expect_refused = [&](std::vector<OptimizerTensor> t, auto config, Errc code,
                              const std::string& arg, auto reference) {
      for (int path = 0; path < 2; ++path) {
        try {
          if (path == 0)
            e.step(std::span<const OptimizerTensor>(t), config);
          else
            reference(std::span<const OptimizerTensor>(t), config);
          ADD_FAILURE() << (path ? "reference" : "engine") << " accepted; expected " << arg;
        } catch (const Error& err) {
          EXPECT_EQ(err.code(), code) << err.what();
          EXPECT_EQ(err.argument(), arg) << err.what();
        }
        EXPECT_TRUE(same_slot_model(before, m)) << "a refused call wrote";
      }
    };
    auto adamw_ref = [](std::span<const OptimizerTensor> t, const AdamWConfig& c) {
      reference::adamw_step(t, c);
    };
    AdamWConfig ams;
    ams.amsgrad = true;
    {
      auto t = m.tensors();
      t[1].state[1] = wide.tensors()[1].state[1];  // f32 exp_avg_sq beside a 16-bit param
      expect_refused(t, ams, Errc::unsupported_dtype, "tensors[1].exp_avg_sq", adamw_ref);
    }
    {
      auto t = m.tensors();
      t[0].state[2] = other.tensors()[0].state[2];  // the other 16-bit dtype
      expect_refused(t, ams, Errc::unsupported_dtype, "tensors[0].max_exp_avg_sq", adamw_ref);
    }
    {
      auto t = m.tensors();
      t[1].state_src[0] = wide.tensors()[1].state[0];
      expect_refused(t, ams, Errc::unsupported_dtype, "tensors[1].exp_avg_src", adamw_ref);
    }
    {
      auto t = m.tensors();
      t[0].compute_param = wide.tensors()[0].compute_param;
      expect_refused(t, ams, Errc::invalid_argument, "tensors[0].compute_param", adamw_ref);
    }
    {
      // A 16-bit param with f32 state: the state is named, not the param.
      auto t = wide.tensors();
      t[0].param = m.tensors()[0].param;
      t[0].compute_param = {};
      SgdConfig sgd;
      sgd.momentum = 0.9;
      expect_refused(t, sgd, Errc::unsupported_dtype, "tensors[0].momentum_buffer",
                     [](std::span<const OptimizerTensor> x, const SgdConfig& c) {
                       reference::sgd_step(x, c);
                     });
    }
  }
}

TEST(CpuEngine, AdamWAmsgradAndMaximizeMatchTheReferenceOnEveryIsa) {
  int idx = 0;
  for (bool amsgrad : {false, true})
    for (bool maximize : {false, true})
      for (double beta1 : {0.9, 0.3}) {
        AdamWConfig c;
        c.amsgrad = amsgrad;
        c.maximize = maximize;
        c.beta1 = beta1;
        c.weight_decay = 0.1;
        SCOPED_TRACE("amsgrad " + std::to_string(amsgrad) + " maximize " +
                     std::to_string(maximize) + " beta1 " + std::to_string(beta1));
        expect_engine_equals_reference(
            c, amsgrad ? 3 : 2,
            [](std::span<const OptimizerTensor> t, const AdamWConfig& cfg, GradientRead read) {
              reference::adamw_step(t, cfg, read);
            },
            1000 + idx++);
      }
}

TEST(CpuEngine, AdamMatchesTheReferenceOnEveryIsa) {
  int idx = 0;
  for (bool amsgrad : {false, true})
    for (bool maximize : {false, true})
      for (double wd : {0.0, 0.05}) {
        AdamConfig c;
        c.amsgrad = amsgrad;
        c.maximize = maximize;
        c.weight_decay = wd;
        c.beta1 = idx % 3 == 0 ? 0.3 : 0.9;
        SCOPED_TRACE("amsgrad " + std::to_string(amsgrad) + " maximize " +
                     std::to_string(maximize) + " wd " + std::to_string(wd));
        expect_engine_equals_reference(
            c, amsgrad ? 3 : 2,
            [](std::span<const OptimizerTensor> t, const AdamConfig& cfg, GradientRead read) {
              reference::adam_step(t, cfg, read);
            },
            1100 + idx++);
      }
}

TEST(CpuEngine, SgdMatchesTheReferenceOnEveryIsa) {
  struct Case {
    double momentum, dampening, wd;
    bool nesterov, maximize;
  };
  const Case cases[] = {{0.0, 0.0, 0.0, false, false}, {0.0, 0.0, 0.01, false, true},
                        {0.9, 0.0, 0.0, false, false}, {0.9, 0.1, 0.01, false, false},
                        {0.9, 0.0, 0.01, true, false}, {0.5, 0.5, 0.0, false, true}};
  int idx = 0;
  for (const Case& k : cases) {
    SgdConfig c;
    c.lr = 0.01;
    c.momentum = k.momentum;
    c.dampening = k.dampening;
    c.weight_decay = k.wd;
    c.nesterov = k.nesterov;
    c.maximize = k.maximize;
    SCOPED_TRACE("momentum " + std::to_string(k.momentum) + " dampening " +
                 std::to_string(k.dampening) + " wd " + std::to_string(k.wd) + " nesterov " +
                 std::to_string(k.nesterov) + " maximize " + std::to_string(k.maximize));
    expect_engine_equals_reference(
        c, k.momentum != 0.0 ? 1 : 0,
        [](std::span<const OptimizerTensor> t, const SgdConfig& cfg, GradientRead read) {
          reference::sgd_step(t, cfg, read);
        },
        1200 + idx++);
  }
}

TEST(CpuEngine, AdagradMatchesTheReferenceOnEveryIsa) {
  struct Case {
    double lr_decay, wd, eps;
    bool maximize;
  };
  const Case cases[] = {{0.0, 0.0, 1e-10, false},
                        {0.047, 0.0, 1e-10, false},
                        {0.01, 0.02, 1e-6, true},
                        {0.0, 0.0, 0.0, false}};
  int idx = 0;
  for (const Case& k : cases) {
    AdagradConfig c;
    c.lr = 0.01;
    c.lr_decay = k.lr_decay;
    c.weight_decay = k.wd;
    c.eps = k.eps;
    c.maximize = k.maximize;
    SCOPED_TRACE("lr_decay " + std::to_string(k.lr_decay) + " wd " + std::to_string(k.wd) +
                 " eps " + std::to_string(k.eps) + " maximize " + std::to_string(k.maximize));
    expect_engine_equals_reference(
        c, 1,
        [](std::span<const OptimizerTensor> t, const AdagradConfig& cfg, GradientRead read) {
          reference::adagrad_step(t, cfg, read);
        },
        1300 + idx++);
  }
}

TEST(CpuEngine, LionMatchesTheReferenceOnEveryIsa) {
  struct Case {
    double beta1, beta2, wd;
  };
  const Case cases[] = {{0.9, 0.99, 0.0}, {0.9, 0.99, 0.1}, {0.95, 0.98, 0.01}, {0.0, 1.0, 0.0}};
  int idx = 0;
  for (const Case& k : cases) {
    LionConfig c;
    c.lr = 3e-3;
    c.beta1 = k.beta1;
    c.beta2 = k.beta2;
    c.weight_decay = k.wd;
    SCOPED_TRACE("beta1 " + std::to_string(k.beta1) + " beta2 " + std::to_string(k.beta2) + " wd " +
                 std::to_string(k.wd));
    expect_engine_equals_reference(
        c, 1,
        [](std::span<const OptimizerTensor> t, const LionConfig& cfg, GradientRead read) {
          reference::lion_step(t, cfg, read);
        },
        1500 + idx++, /*counters=*/false);
  }
}

// Lion's sign on the edges, against what docs/numerics.md 8d says directly (not against the
// reference): u = +-0 leaves p's bits (signed zeros too), a NaN gradient or momentum makes
// p NaN, an infinite gradient moves p by exactly lr; every ISA and the reference agree.
TEST(CpuEngine, LionSignEdgesFollowTheSpec) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // {g, m, p}: the expected new p is computed below from the spec's cases.
  const std::vector<std::array<float, 3>> rows = {
      {0.0f, 0.0f, 1.5f},   {-0.0f, 0.0f, -0.0f},   {0.0f, -0.0f, 0.0f},   {-0.0f, -0.0f, 2.0f},
      {nan, 0.5f, 1.0f},    {1.0f, nan, 1.0f},      {inf, 0.0f, 1.0f},     {-inf, 3.0f, 1.0f},
      {1e-45f, 0.0f, 1.0f}, {-1e-45f, 0.0f, -1.0f}, {2.0f, -20.0f, 0.25f}, {-2.0f, 20.0f, 0.25f}};
  LionConfig c;
  c.lr = 0.125;  // a power of two: p - lr is exact for these p
  c.beta1 = 0.9;
  c.beta2 = 0.99;
  const float b1 = 0.9f, c1 = static_cast<float>(1.0 - 0.9);
  for (std::size_t n : {rows.size(), std::size_t{37}}) {  // the rows, then repeated past a vector
    std::vector<float> g(n), m(n), p(n);
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = rows[i % rows.size()][0];
      m[i] = rows[i % rows.size()][1];
      p[i] = rows[i % rows.size()][2];
    }
    std::vector<float> want(n);
    for (std::size_t i = 0; i < n; ++i) {
      volatile float keep = b1 * m[i], part = c1 * g[i];  // one rounding each
      const float u = keep + part;
      if (std::isnan(u))
        want[i] = nan;
      else if (u == 0.0f)
        want[i] = p[i];  // the bits of p, its sign included
      else
        want[i] = u > 0.0f ? p[i] - 0.125f : p[i] + 0.125f;
    }
    auto run = [&](auto&& step) {
      std::vector<float> pp = p, mm = m;
      OptimizerTensor t;
      t.param = {pp.data(), n, DType::f32};
      t.state[0] = {mm.data(), n, DType::f32};
      t.grad = ConstTensorView{g.data(), n, DType::f32};
      step(std::span<const OptimizerTensor>(&t, 1));
      return pp;
    };
    auto same = [&](const std::vector<float>& got, const char* who) {
      for (std::size_t i = 0; i < n; ++i) {
        if (std::isnan(want[i])) {
          EXPECT_TRUE(std::isnan(got[i])) << who << " element " << i;
        } else {
          EXPECT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
              << who << " element " << i << ": " << got[i] << " want " << want[i];
        }
      }
    };
    same(run([&](auto t) { reference::lion_step(t, c); }), "reference");
    for (cpu::Isa isa : testing_support::isas_under_test())
      for (int threads : {1, 3})
        same(run([&](auto t) {
               cpu::Engine(cpu::EngineConfig{isa, threads}).step(t, c);
             }),
             cpu::isa_name(isa).data());
  }
}

TEST(CpuEngine, HundredsOfTensorsAndOddMillions) {
  std::mt19937 rng(77);
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 300; ++i) sizes.push_back(rng() % 3000);
  sizes.push_back(1000003);
  sizes.push_back(2 * cpu::Engine::kWorkChunkElements + 5);
  for (const Combo& c : {Combo{DType::bf16, 3, AdamWFormula::native, 0.1},
                         Combo{DType::f32, 2, AdamWFormula::torch, 0.0}}) {
    SCOPED_TRACE(name(c));
    AdamWConfig cfg;
    cfg.formula = c.formula;
    cfg.weight_decay = c.wd;
    const GradientRead read{1.0f / 777.0f, 0.5f};
    Model ref(sizes, c.grad, c.out, 9);
    Model input = ref;
    auto rt = ref.adamw();
    reference::adamw_step(rt, cfg, read);
    for (cpu::Isa isa : testing_support::isas_under_test()) {
      for (int threads : {2, 7}) {
        Model eng = input;
        auto et = eng.adamw();
        cpu::Engine(cpu::EngineConfig{isa, threads}).step(et, cfg, read);
        ASSERT_TRUE(same_model(ref, eng)) << cpu::isa_name(isa) << " threads " << threads;
      }
    }
  }
}

TEST(CpuEngine, FoundInfWritesNothing) {
  Model m(boundary_sizes(), DType::bf16, 3, 3);
  const Model before = m;
  auto t = m.adamw();
  const std::int32_t found_inf = 1;
  cpu::Engine().step(t, AdamWConfig{}, GradientRead{}, &found_inf);
  EXPECT_TRUE(same_model(before, m));
  auto s = m.sign_sgd();
  cpu::Engine().step(s, SignSgdConfig{}, GradientRead{}, &found_inf);
  EXPECT_TRUE(same_model(before, m));
}

// ---- out-of-place steps -------------------------------------------------------------

/// Where a tensor of an out-of-place call reads its old state from.
enum class Source : std::uint8_t {
  in_place,    ///< no sources: the destinations hold the old state
  separate,    ///< every state buffer from a disjoint source
  param_only,  ///< param from a disjoint source, the moments in place
  self,        ///< sources given, each exactly its own destination (in place)
};

/// A NaN bit pattern per element (quiet and signalling, both signs): garbage an out-of-place
/// step must overwrite, and a value no step of this data produces.
float garbage(std::size_t i) {
  const std::uint32_t bits[] = {0x7FC0DEADu, 0xFFBADBADu, 0x7F800001u, 0xFFFFFFFFu};
  return f32_from_bits(bits[i % 4]);
}

/// The destinations of an out-of-place call, laid out like Model's buffers (one element
/// ahead, so no pointer is vector-aligned) and pre-filled with garbage.
struct Destinations {
  std::vector<std::vector<float>> p, m, v;
  explicit Destinations(const Model& shape) {
    for (std::size_t n : shape.sizes)
      for (auto* d : {&p, &m, &v}) {
        d->emplace_back(n + 1);
        for (std::size_t i = 0; i <= n; ++i) d->back()[i] = garbage(i);
      }
  }
};

/// Points tensor k of `t` at `dst` as `mode` says; its old state stays in `src` (whose
/// buffers t holds now). `slots`: the state arrays the optimizer keeps (AdamW 2, SignSGD 0).
void redirect(OptimizerTensor& t, std::size_t k, Source mode, Destinations& dst, int slots) {
  const std::size_t n = t.param.numel;
  auto out_of_place = [&](TensorView& to, ConstTensorView& from, std::vector<float>& d) {
    from = to;  // the old values: the model's buffer
    to = {d.data() + 1, n, DType::f32};
  };
  if (mode == Source::self) {
    t.param_src = t.param;
    for (int s = 0; s < slots; ++s) t.state_src[s] = t.state[s];
    return;
  }
  if (mode == Source::in_place) return;
  out_of_place(t.param, t.param_src, dst.p[k]);
  if (mode == Source::separate) {
    if (slots > 0) out_of_place(t.state[0], t.state_src[0], dst.m[k]);
    if (slots > 1) out_of_place(t.state[1], t.state_src[1], dst.v[k]);
  }
}

/// Runs one out-of-place call (modes[k] for tensor k; `adamw` false: SignSGD) on a copy of
/// `input` and checks it against `ref`, the reference's in-place step of `input`: every
/// destination holds the reference's bits (garbage where the call has no destination),
/// every source is bit for bit the input, and the compute outputs, gradients and step
/// counters are the reference's.
void expect_out_of_place(const Model& input, const Model& ref, const std::vector<Source>& modes,
                         bool adamw, const cpu::Engine& engine, const AdamWConfig& acfg,
                         const SignSgdConfig& scfg, GradientRead read) {
  Model eng = input;
  Destinations dst(input);
  if (adamw) {
    auto t = eng.adamw();
    for (std::size_t k = 0; k < t.size(); ++k) redirect(t[k], k, modes[k], dst, 2);
    engine.step(t, acfg, read);
  } else {
    auto t = eng.sign_sgd();
    for (std::size_t k = 0; k < t.size(); ++k) redirect(t[k], k, modes[k], dst, 0);
    engine.step(t, scfg, read);
  }
  // What each buffer must hold: the model's buffers keep the input where they were
  // sources and take the reference's result where they were destinations.
  Model want = ref;
  Destinations want_dst(input);
  for (std::size_t k = 0; k < modes.size(); ++k) {
    const std::size_t n = input.sizes[k];
    auto moved = [&](std::vector<float>& model, const std::vector<float>& in,
                     std::vector<float>& d) {
      std::copy(model.begin() + 1, model.end(), d.begin() + 1);  // the result, moved out
      model = in;                                                // the source, intact
    };
    if (modes[k] == Source::separate || modes[k] == Source::param_only)
      moved(want.p[k], input.p[k], want_dst.p[k]);
    if (adamw && modes[k] == Source::separate) {
      moved(want.m[k], input.m[k], want_dst.m[k]);
      moved(want.v[k], input.v[k], want_dst.v[k]);
    }
    for (const auto& [got, expected, what] :
         {std::tuple{&dst.p[k], &want_dst.p[k], "param destination"},
          std::tuple{&dst.m[k], &want_dst.m[k], "exp_avg destination"},
          std::tuple{&dst.v[k], &want_dst.v[k], "exp_avg_sq destination"}})
      ASSERT_TRUE(same_bytes(expected->data(), got->data(), (n + 1) * 4, what))
          << " tensor " << k << " (n " << n << ", mode " << static_cast<int>(modes[k]) << ")";
  }
  for (std::size_t k = 0; k < modes.size(); ++k)
    for (const auto& [got, expected, what] :
         {std::tuple{&eng.p[k], &want.p[k], "param"}, std::tuple{&eng.m[k], &want.m[k], "exp_avg"},
          std::tuple{&eng.v[k], &want.v[k], "exp_avg_sq"}})
      ASSERT_TRUE(same_bytes(expected->data(), got->data(), got->size() * 4, what))
          << " tensor " << k << " (mode " << static_cast<int>(modes[k]) << ")";
  ASSERT_TRUE(same_model(want, eng));  // compute outputs, gradients, step counters too
}

TEST(CpuEngine, OutOfPlaceStepsGiveTheInPlaceBitsAndLeaveTheSourcesIntact) {
  // Every tensor out of place, then a mix of in-place, out-of-place, param-only and
  // explicitly in-place (source = destination) tensors in one call; the expectation is
  // the reference stepping a copy of the sources in place.
  const auto sizes = boundary_sizes();
  const std::vector<Source> all(sizes.size(), Source::separate);
  std::vector<Source> mixed;
  for (std::size_t k = 0; k < sizes.size(); ++k) mixed.push_back(static_cast<Source>(k % 4));
  const int outputs[] = {0, 1 + static_cast<int>(DType::bf16), 1 + static_cast<int>(DType::f32)};
  int idx = 0;
  for (DType g : {DType::bf16, DType::f16, DType::f32}) {
    for (int o : outputs) {
      for (int opt = 0; opt < 3; ++opt) {  // AdamW native, AdamW torch, SignSGD
        const bool adamw = opt < 2;
        SCOPED_TRACE(std::string(dtype_name(g)) + " out " + std::to_string(o) +
                     (opt == 0   ? " adamw native"
                      : opt == 1 ? " adamw torch"
                                 : " sign_sgd"));
        AdamWConfig acfg;
        acfg.formula = opt == 0 ? AdamWFormula::native : AdamWFormula::torch;
        acfg.weight_decay = idx % 2 ? 0.1 : 0.0;
        acfg.beta1 = idx % 3 == 0 ? 0.3 : 0.9;
        const SignSgdConfig scfg{1e-3, idx % 2 ? 0.05 : 0.0};
        const GradientRead read{idx % 2 ? 1.0f / 3000.0f : 1.0f, idx % 4 == 1 ? 0.37f : 1.0f};
        const Model input(sizes, g, o, 900 + idx++);
        Model ref = input;
        if (adamw) {
          auto rt = ref.adamw();
          reference::adamw_step(rt, acfg, read);
        } else {
          auto rt = ref.sign_sgd();
          reference::sign_sgd_step(rt, scfg, read);
        }
        for (cpu::Isa isa : testing_support::isas_under_test()) {
          for (int threads : {1, 3}) {
            SCOPED_TRACE(std::string(cpu::isa_name(isa)) + " threads " + std::to_string(threads));
            const cpu::Engine engine(cpu::EngineConfig{isa, threads});
            for (const std::vector<Source>& modes : {all, mixed})
              ASSERT_NO_FATAL_FAILURE(
                  expect_out_of_place(input, ref, modes, adamw, engine, acfg, scfg, read));
          }
        }
      }
    }
  }
}

/// Out-of-place destinations placed `offset` bytes past a 64-byte boundary, with garbage
/// around them: the streamed kernels' scalar head, aligned lanes and tail at every phase.
struct PlacedDestination {
  std::vector<float> storage;
  std::size_t lead;  ///< index of the destination's first element in storage
  std::size_t n;
  PlacedDestination(std::size_t count, std::size_t offset) : storage(count + 48), n(count) {
    for (std::size_t i = 0; i < storage.size(); ++i) storage[i] = garbage(i);
    const auto a = reinterpret_cast<std::uintptr_t>(storage.data());
    lead = ((64 - a % 64) % 64 + offset) / sizeof(float);
  }
  float* data() { return storage.data() + lead; }
  /// Checks that the destination holds `want` (n elements) and the garbage around it is
  /// untouched.
  ::testing::AssertionResult holds(const float* want, const char* what) const {
    if (auto r = same_bytes(want, storage.data() + lead, n * 4, what); !r) return r;
    for (std::size_t i = 0; i < storage.size(); ++i)
      if ((i < lead || i >= lead + n) && f32_bits(storage[i]) != f32_bits(garbage(i)))
        return ::testing::AssertionFailure() << what << ": wrote outside, storage[" << i << "]";
    return ::testing::AssertionSuccess();
  }
};

TEST(CpuEngine, StreamedDestinationsGiveTheInPlaceBitsAtEveryAlignment) {
  // Out-of-place destinations take streaming stores from the first 64-byte line where
  // every streamed one is aligned (a scalar head before it). Destinations 0, 4, 8, 32 and
  // 60 bytes into a line, all alike or each its own (then only those agreeing with the
  // most stream, the rest store plainly), over sizes around every vector and line width,
  // one chunk and several: the reference's in-place bits, nothing written around them.
  const std::size_t c = cpu::Engine::kWorkChunkElements;
  const std::vector<std::size_t> sizes{0,  1,    15,   16,   17,    31,    32,
                                       33, 1023, 1024, 1025, c - 1, c + 1, 2 * c + 5};
  const std::size_t placements[][3] = {{0, 0, 0},    {4, 4, 4},  {8, 8, 8},  {32, 32, 32},
                                       {60, 60, 60}, {4, 8, 32}, {4, 4, 32}, {60, 0, 0}};
  int idx = 0;
  for (const auto& [g, o] : {std::pair{DType::bf16, 1 + static_cast<int>(DType::bf16)},
                             std::pair{DType::f32, 0}, std::pair{DType::f16, 1}}) {
    for (int opt = 0; opt < 3; ++opt) {  // AdamW native, AdamW torch, SignSGD
      const bool adamw = opt < 2;
      AdamWConfig acfg;
      acfg.formula = opt == 0 ? AdamWFormula::native : AdamWFormula::torch;
      acfg.weight_decay = 0.1;
      const SignSgdConfig scfg{1e-3, 0.05};
      const GradientRead read{1.0f / 3000.0f, idx % 2 ? 0.37f : 1.0f};
      const Model input(sizes, g, o, 4000 + idx++);
      Model ref = input;
      if (adamw) {
        auto rt = ref.adamw();
        reference::adamw_step(rt, acfg, read);
      } else {
        auto rt = ref.sign_sgd();
        reference::sign_sgd_step(rt, scfg, read);
      }
      Model want = ref;  // the sources keep the input
      want.p = input.p;
      if (adamw) {
        want.m = input.m;
        want.v = input.v;
      }
      for (cpu::Isa isa : testing_support::isas_under_test()) {
        for (int threads : {1, 3}) {
          const cpu::Engine engine(cpu::EngineConfig{isa, threads});
          for (const auto& place : placements) {
            SCOPED_TRACE(std::string(cpu::isa_name(isa)) + " threads " + std::to_string(threads) +
                         " grad " + std::string(dtype_name(g)) + " optimizer " +
                         std::to_string(opt) + " offsets " + std::to_string(place[0]) + "/" +
                         std::to_string(place[1]) + "/" + std::to_string(place[2]));
            Model eng = input;
            std::vector<PlacedDestination> dp, dm, dv;
            for (std::size_t n : sizes) {
              dp.emplace_back(n, place[0]);
              dm.emplace_back(n, place[1]);
              dv.emplace_back(n, place[2]);
            }
            if (adamw) {
              auto t = eng.adamw();
              for (std::size_t k = 0; k < t.size(); ++k) {
                t[k].param_src = t[k].param;
                t[k].state_src[0] = t[k].state[0];
                t[k].state_src[1] = t[k].state[1];
                t[k].param = {dp[k].data(), sizes[k], DType::f32};
                t[k].state[0] = {dm[k].data(), sizes[k], DType::f32};
                t[k].state[1] = {dv[k].data(), sizes[k], DType::f32};
              }
              engine.step(t, acfg, read);
            } else {
              auto t = eng.sign_sgd();
              for (std::size_t k = 0; k < t.size(); ++k) {
                t[k].param_src = t[k].param;
                t[k].param = {dp[k].data(), sizes[k], DType::f32};
              }
              engine.step(t, scfg, read);
            }
            for (std::size_t k = 0; k < sizes.size(); ++k) {
              SCOPED_TRACE("size " + std::to_string(sizes[k]));
              ASSERT_TRUE(dp[k].holds(ref.p[k].data() + 1, "param destination"));
              if (adamw) {
                ASSERT_TRUE(dm[k].holds(ref.m[k].data() + 1, "exp_avg destination"));
                ASSERT_TRUE(dv[k].holds(ref.v[k].data() + 1, "exp_avg_sq destination"));
              }
            }
            ASSERT_TRUE(same_model(want, eng));  // sources, outputs, grads, counters
          }
        }
      }
    }
  }
}

TEST(CpuEngine, OutOfPlaceFoundInfAndBadSourcesWriteNothing) {
  Model input({100, 33}, DType::bf16, 2, 5);
  const std::vector<Source> modes{Source::separate, Source::separate};
  Model m = input;
  Destinations dst(m);
  const Destinations garbage_only(m);
  auto t = m.adamw();
  for (std::size_t k = 0; k < t.size(); ++k) redirect(t[k], k, modes[k], dst, 2);
  auto unchanged = [&] {
    EXPECT_TRUE(same_model(input, m));
    for (std::size_t k = 0; k < t.size(); ++k) {
      EXPECT_TRUE(same_bytes(garbage_only.p[k].data(), dst.p[k].data(), dst.p[k].size() * 4, "p"));
      EXPECT_TRUE(same_bytes(garbage_only.m[k].data(), dst.m[k].data(), dst.m[k].size() * 4, "m"));
      EXPECT_TRUE(same_bytes(garbage_only.v[k].data(), dst.v[k].data(), dst.v[k].size() * 4, "v"));
    }
  };
  const std::int32_t found_inf = 1;
  cpu::Engine().step(t, AdamWConfig{}, GradientRead{}, &found_inf);
  unchanged();
  // The last tensor's exp_avg source overlaps the first tensor's param destination.
  t[1].state_src[0] = {static_cast<const float*>(t[0].param.data) + 50, 33, DType::f32};
  try {
    cpu::Engine().step(t, AdamWConfig{});
    FAIL() << "a source overlapping a destination was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::overlap);
    EXPECT_EQ(e.argument(), "tensors[1].exp_avg_src");
  }
  unchanged();
}

// ---- accumulate and scale ---------------------------------------------------------
TEST(CpuEngine, AccumulateAndScaleMatchReference) {
  const auto sizes = boundary_sizes();
  std::mt19937 rng(11);
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    for (bool copy : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(d)) + (copy ? " copy" : " add"));
      std::vector<std::vector<float>> acc;
      std::vector<std::vector<std::uint8_t>> src;
      for (std::size_t n : sizes) {
        acc.emplace_back(n + 1);
        for (auto& x : acc.back()) x = std::normal_distribution<float>(0, 1)(rng);
        src.emplace_back((n + 1) * 4);
        fill(src.back().data() + dtype_size(d), d, n, rng, 3.0f);
      }
      auto ref = acc;
      std::vector<AccumulatePair> rp;
      for (std::size_t k = 0; k < sizes.size(); ++k)
        rp.push_back({{ref[k].data() + 1, sizes[k], DType::f32},
                      {src[k].data() + dtype_size(d), sizes[k], d},
                      copy});
      reference::accumulate(rp);
      for (cpu::Isa isa : testing_support::isas_under_test()) {
        for (int threads : thread_counts()) {
          auto eng = acc;
          std::vector<AccumulatePair> ep;
          for (std::size_t k = 0; k < sizes.size(); ++k)
            ep.push_back({{eng[k].data() + 1, sizes[k], DType::f32},
                          {src[k].data() + dtype_size(d), sizes[k], d},
                          copy});
          cpu::Engine(cpu::EngineConfig{isa, threads}).accumulate(ep);
          for (std::size_t k = 0; k < sizes.size(); ++k)
            ASSERT_TRUE(same_f32(ref[k].data(), eng[k].data(), sizes[k] + 1, "acc"))
                << cpu::isa_name(isa) << " threads " << threads << " tensor " << k;
        }
      }
      // scale_ in place on the sources, including overflow to Inf and underflow.
      for (float s : {0.0f, 1.0f / 3.0f, 3e5f, 1e-30f}) {
        auto ref_src = src;
        std::vector<TensorView> rv;
        for (std::size_t k = 0; k < sizes.size(); ++k)
          rv.push_back({ref_src[k].data() + dtype_size(d), sizes[k], d});
        reference::scale_(rv, s);
        for (cpu::Isa isa : testing_support::isas_under_test()) {
          for (int threads : {1, 3}) {
            auto eng_src = src;
            std::vector<TensorView> ev;
            for (std::size_t k = 0; k < sizes.size(); ++k)
              ev.push_back({eng_src[k].data() + dtype_size(d), sizes[k], d});
            cpu::Engine(cpu::EngineConfig{isa, threads}).scale_(ev, s);
            for (std::size_t k = 0; k < sizes.size(); ++k) {
              if (d == DType::f32)
                ASSERT_TRUE(same_f32(reinterpret_cast<float*>(ref_src[k].data()),
                                     reinterpret_cast<float*>(eng_src[k].data()), sizes[k] + 1,
                                     "scaled"));
              else
                ASSERT_TRUE(
                    same_bytes(ref_src[k].data(), eng_src[k].data(), ref_src[k].size(), "scaled"))
                    << cpu::isa_name(isa) << " scale " << s << " tensor " << k;
            }
          }
        }
      }
    }
  }
}

// ---- norm -------------------------------------------------------------------------
struct NormData {
  std::vector<std::vector<std::uint8_t>> buffers;
  std::vector<ConstTensorView> views;
};

NormData norm_data(DType d, const std::vector<std::size_t>& sizes, std::uint32_t seed,
                   float scale) {
  NormData nd;
  std::mt19937 rng(seed);
  for (std::size_t n : sizes) {
    nd.buffers.emplace_back((n + 1) * 4);
    fill(nd.buffers.back().data() + dtype_size(d), d, n, rng, scale);
  }
  for (std::size_t k = 0; k < sizes.size(); ++k)
    nd.views.push_back({nd.buffers[k].data() + dtype_size(d), sizes[k], d});
  return nd;
}

TEST(CpuEngine, NormMatchesReferenceBits) {
  auto sizes = boundary_sizes();
  sizes.push_back(100003);
  std::uint32_t seed = 1;
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    for (const GradientRead read : {GradientRead{}, GradientRead{1.0f / 4099.0f, 0.61f},
                                    GradientRead{1.0f / 4099.0f, 0.61f, true}}) {
      for (float scale : {1e-3f, 1e3f}) {
        SCOPED_TRACE(std::string(dtype_name(d)) + " scale " + std::to_string(read.scale) +
                     (read.as_f32 ? " as_f32" : ""));
        NormData data = norm_data(d, sizes, seed++, scale);
        const NormPartial ref_partial = reference::norm_partial(data.views, read);
        const NormResult ref = finalize(ref_partial);
        for (cpu::Isa isa : testing_support::isas_under_test()) {
          for (int threads : thread_counts()) {
            const cpu::Engine eng(cpu::EngineConfig{isa, threads});
            const NormResult got = eng.norm(data.views, read);
            ASSERT_EQ(f32_bits(ref.norm), f32_bits(got.norm))
                << cpu::isa_name(isa) << " t" << threads;
            ASSERT_EQ(f32_bits(ref.max_abs), f32_bits(got.max_abs));
            ASSERT_EQ(ref.finite, got.finite);
            const NormPartial exact = eng.norm_partial(data.views, read, cpu::NormMode::exact);
            ASSERT_TRUE(same_value(ref_partial, exact))
                << "exact mode must equal the reference digits";
            const NormPartial fast = eng.norm_partial(data.views, read);
            ASSERT_NE(fast.approximate, 0u);
          }
        }
      }
    }
  }
}

TEST(CpuEngine, NormCountsNonFinite) {
  std::vector<float> x(5000, 0.5f);
  x[17] = std::nanf("");
  x[4000] = INFINITY;
  x[4001] = -INFINITY;
  const std::vector<ConstTensorView> v{{x.data(), x.size(), DType::f32}};
  for (cpu::Isa isa : testing_support::isas_under_test()) {
    const NormResult r = cpu::Engine(cpu::EngineConfig{isa, 2}).norm(v);
    EXPECT_TRUE(std::isnan(r.norm));
    EXPECT_FALSE(r.finite);
    EXPECT_EQ(r.nan_count, 1u);
    EXPECT_EQ(r.inf_count, 2u);
  }
  x[17] = 0.5f;
  for (cpu::Isa isa : testing_support::isas_under_test()) {
    const NormResult r = cpu::Engine(cpu::EngineConfig{isa, 2}).norm(v);
    EXPECT_EQ(f32_bits(r.norm), f32_bits(INFINITY));
    EXPECT_EQ(r.inf_count, 2u);
  }
  // A finite gradient whose scaled read overflows counts as Inf.
  std::vector<float> big(100, 3e38f);
  const std::vector<ConstTensorView> bv{{big.data(), big.size(), DType::f32}};
  const NormResult r = cpu::Engine().norm(bv, GradientRead{2.0f, 1.0f});
  EXPECT_EQ(r.inf_count, 100u);
}

TEST(CpuEngine, NanAndInfGradientsThroughTheScaledReadStayNonFinite) {
  // bf16 and f16 NaNs with every kind of payload (quiet, signalling, all ones, sign
  // set) and infinities, read with scale and clip: the norm must count them like the
  // reference and AdamW must produce NaN/Inf exactly where the reference does.
  const std::uint16_t bf16_specials[] = {0x7FFF, 0xFFFF, 0x7F81, 0xFF81, 0x7FC0, 0x7F80, 0xFF80};
  const std::uint16_t f16_specials[] = {0x7FFF, 0xFFFF, 0x7C01, 0xFC01, 0x7E00, 0x7C00, 0xFC00};
  for (DType d : {DType::bf16, DType::f16}) {
    std::vector<std::uint16_t> g(257);
    std::mt19937 rng(3);
    for (std::size_t i = 0; i < g.size(); ++i) {
      const float x = std::normal_distribution<float>(0.0f, 1e-2f)(rng);
      g[i] = d == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
    }
    const std::uint16_t* specials = d == DType::bf16 ? bf16_specials : f16_specials;
    for (int k = 0; k < 7; ++k) g[3 + 37 * k] = specials[k];
    const std::vector<ConstTensorView> views{{g.data(), g.size(), d}};
    for (const GradientRead read : {GradientRead{}, GradientRead{1.0f / 3.0f, 1.0f},
                                    GradientRead{0.5f, 0.3f}, GradientRead{2.0f, 0.0f}}) {
      const NormResult ref = finalize(reference::norm_partial(views, read));
      Model ref_model({g.size()}, d, 2, 8);
      std::memcpy(ref_model.g[0].data() + dtype_size(d), g.data(), g.size() * 2);
      Model eng_model = ref_model;
      auto rt = ref_model.adamw();
      reference::adamw_step(rt, AdamWConfig{}, read);
      for (cpu::Isa isa : testing_support::isas_under_test()) {
        const cpu::Engine eng(cpu::EngineConfig{isa, 2});
        const NormResult got = eng.norm(views, read);
        EXPECT_EQ(got.nan_count, ref.nan_count) << cpu::isa_name(isa);
        EXPECT_EQ(got.inf_count, ref.inf_count) << cpu::isa_name(isa);
        Model m = eng_model;
        auto et = m.adamw();
        eng.step(et, AdamWConfig{}, read);
        EXPECT_TRUE(same_model(ref_model, m)) << cpu::isa_name(isa) << " " << dtype_name(d);
      }
    }
  }
}

TEST(CpuEngine, NanResultsStoreAsThePositiveQuietNanOnEveryIsa) {
  // docs/numerics.md section 2: narrowing a NaN drops its sign and payload (bf16 0x7FC0,
  // f16 0x7E00), so a NaN result is the same 16 bits whatever NaN the arithmetic gave
  // (fuzz_engine found an f16 compute weight whose sign followed the ISA's NaN). The
  // expectation is the spec's constant, not the reference.
  const std::uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0xFFFF0000u, 0x7F800001u,
                                0xFF812345u, 0x7FFFFFFFu, 0xFFFFFFFFu};
  for (const std::size_t n : boundary_sizes()) {
    if (n == 0) continue;
    std::vector<std::size_t> at;  // where the NaN masters are: ends, middle, a stride
    for (std::size_t k = 0; k < n; k += 1 + n / 9) at.push_back(k);
    at.push_back(n - 1);
    for (const DType out : {DType::f16, DType::bf16}) {
      const std::uint16_t want = out == DType::f16 ? 0x7E00 : 0x7FC0;
      for (cpu::Isa isa : testing_support::isas_under_test()) {
        SCOPED_TRACE(std::string(cpu::isa_name(isa)) + " n " + std::to_string(n) + " " +
                     std::string(dtype_name(out)));
        // SignSGD: a NaN master stays NaN (x86 keeps the operand's NaN, sign included).
        std::vector<float> param(n, 0.25f), grad(n, -1.0f);
        for (std::size_t j = 0; j < at.size(); ++j)
          param[at[j]] = f32_from_bits(nans[j % (sizeof nans / sizeof nans[0])]);
        std::vector<std::uint16_t> compute(n, 0x1234);
        OptimizerTensor t;
        t.param = {param.data(), n, DType::f32};
        t.grad = {grad.data(), n, DType::f32};
        t.compute_param = {compute.data(), n, out};
        const cpu::Engine eng(cpu::EngineConfig{isa, 2});
        eng.step(std::span(&t, 1), SignSgdConfig{1e-3, 0.1});
        for (const std::size_t k : at) {
          ASSERT_TRUE(std::isnan(param[k])) << k;
          ASSERT_EQ(compute[k], want) << "compute[" << k << "]";
        }
        // scale_ in place on a 16-bit tensor of NaNs of both signs and any payload.
        std::vector<std::uint16_t> g(n, out == DType::f16 ? 0x3C00 : 0x3F80);
        for (std::size_t j = 0; j < at.size(); ++j)
          g[at[j]] = static_cast<std::uint16_t>((j % 2 ? 0x8000u : 0u) |
                                                (out == DType::f16 ? 0x7C01u + j : 0x7F81u + j));
        const TensorView v{g.data(), n, out};
        eng.scale_(std::span(&v, 1), 0.5f);
        for (const std::size_t k : at) ASSERT_EQ(g[k], want) << "scaled[" << k << "]";
      }
    }
  }
}

TEST(CpuEngine, NormOnARoundingTieFallsBackToExact) {
  // Four times 2^24 and {8192, 8192, 2}: S = 2^50 + 2^27 + 4 = (2^25 + 2)^2, so the
  // exact norm 2^25 + 2 lies exactly halfway between the floats 2^25 and 2^25 + 4.
  // An approximate partial cannot certify a tie; the exact fallback rounds to even.
  const std::vector<float> a(4, 16777216.0f);
  const std::vector<float> c = {8192.0f, 8192.0f, 2.0f};
  const std::vector<ConstTensorView> views{{a.data(), a.size(), DType::f32},
                                           {c.data(), c.size(), DType::f32}};
  const NormResult ref = finalize(reference::norm_partial(views));
  EXPECT_EQ(ref.norm, 33554432.0f) << "tie rounds to the even neighbour 2^25";
  for (cpu::Isa isa : testing_support::isas_under_test()) {
    const cpu::Engine eng(cpu::EngineConfig{isa, 1});
    const NormResult fast = finalize(eng.norm_partial(views));
    EXPECT_TRUE(fast.needs_exact) << "a tie cannot be certified from an approximate partial";
    const NormResult r = eng.norm(views);
    EXPECT_FALSE(r.needs_exact);
    EXPECT_EQ(f32_bits(r.norm), f32_bits(ref.norm));
  }
}

TEST(CpuEngine, ResultsIgnoreTheCallersFloatingPointEnvironment) {
  // A trainer may run with flush-to-zero / denormals-are-zero (torch.set_flush_denormal)
  // or another rounding mode. Subnormal-heavy data computed in such an environment must
  // give the bits of the default environment, for the engine and the reference alike.
  const std::vector<std::size_t> sizes = {1, 33, 1025, 40000};
  Model base(sizes, DType::f32, 2, 21);
  std::mt19937 rng(4);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    float* g = reinterpret_cast<float*>(base.g[k].data() + 4);
    for (std::size_t i = 0; i < sizes[k]; ++i) {
      g[i] =
          std::ldexp(std::normal_distribution<float>(0, 1)(rng), -120 - static_cast<int>(i % 20));
      base.m[k][i + 1] = std::ldexp(base.m[k][i + 1], -110);
    }
  }
  const GradientRead read{0.75f, 0.5f};  // pushes reads further into the subnormal range
  Model expected = base;
  auto et = expected.adamw();
  reference::adamw_step(et, AdamWConfig{}, read);
  std::vector<ConstTensorView> gv;
  for (const auto& t : base.adamw()) gv.push_back(t.grad);
  const NormPartial expected_norm = reference::norm_partial(gv, read);
  ASSERT_TRUE(finalize(expected_norm).norm > 0.0f);

  const std::uint64_t csr = get_fp_control();
  set_fp_control(csr | kFlushBits);  // FTZ | DAZ (x86), FZ | FIZ | AH (aarch64)
  // The bits this processor keeps (FIZ and AH read as zero without FEAT_AFP).
  const std::uint64_t flush_set = get_fp_control() & kFlushBits;
  ASSERT_NE(flush_set, 0u);
  if (flush_set != kFlushBits)
    std::printf("[ NOTE     ] control bits 0x%llx not kept by this processor\n",
                static_cast<unsigned long long>(kFlushBits & ~flush_set));
  std::fesetround(FE_UPWARD);
  Model by_engine = base, by_reference = base;
  auto t1 = by_engine.adamw();
  auto t2 = by_reference.adamw();
  cpu::Engine(cpu::EngineConfig{std::nullopt, 2}).step(t1, AdamWConfig{}, read);
  reference::adamw_step(t2, AdamWConfig{}, read);
  const NormResult engine_norm = cpu::Engine(cpu::EngineConfig{std::nullopt, 2}).norm(gv, read);
  const NormPartial reference_norm = reference::norm_partial(gv, read);
  const std::uint64_t csr_after = get_fp_control();
  const int round_after = std::fegetround();
  std::fesetround(FE_TONEAREST);
  set_fp_control(csr);

  EXPECT_EQ(csr_after & kFlushBits, flush_set) << "caller's MXCSR / FPCR restored";
  EXPECT_EQ(round_after, FE_UPWARD) << "caller's rounding mode restored";
  EXPECT_TRUE(same_model(expected, by_engine));
  EXPECT_TRUE(same_model(expected, by_reference));
  EXPECT_TRUE(same_value(expected_norm, reference_norm));
  EXPECT_EQ(f32_bits(engine_norm.norm), f32_bits(finalize(expected_norm).norm));
}

// ---- configuration -----------------------------------------------------------------
TEST(CpuEngine, IsaSelectionAndNames) {
  const auto isas = cpu::supported_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), testing_support::baseline_isa());
  EXPECT_EQ(cpu::best_isa(), isas.back());
  for (cpu::Isa isa : isas) {
    const cpu::Engine e(cpu::EngineConfig{isa, 1});
    EXPECT_EQ(e.isa(), isa);
    EXPECT_EQ(cpu::parse_isa(e.isa_name()), isa);
  }
  EXPECT_THROW(cpu::parse_isa("sve"), Error);
  EXPECT_EQ(cpu::parse_isa("neon"), cpu::Isa::neon);
  // Another target's ISA is named, not run.
  const cpu::Isa other =
      testing_support::baseline_isa() == cpu::Isa::neon ? cpu::Isa::sse2 : cpu::Isa::neon;
  try {
    cpu::Engine e(cpu::EngineConfig{other, 1});
    FAIL() << "another target's ISA accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), Errc::not_supported);
    EXPECT_EQ(err.argument(), "config.isa");
  }
  std::printf("[ info     ] ISAs on this processor:");
  for (cpu::Isa isa : isas) std::printf(" %s", std::string(cpu::isa_name(isa)).c_str());
  std::printf("; best %s\n", std::string(cpu::isa_name(cpu::best_isa())).c_str());
}

TEST(CpuEngine, EnvironmentConfiguresIsaAndThreads) {
  const std::string baseline(cpu::isa_name(testing_support::baseline_isa()));
  ::setenv("STEPCORE_ISA", baseline.c_str(), 1);
  ::setenv("STEPCORE_THREADS", "3", 1);
  {
    const cpu::Engine e;
    EXPECT_EQ(e.isa(), testing_support::baseline_isa());
    EXPECT_EQ(e.threads(), 3);
  }
  ::setenv("OMP_NUM_THREADS", "1", 1);  // ignored by design
  ::unsetenv("STEPCORE_THREADS");
  EXPECT_GE(cpu::Engine().threads(), 1);
  ::setenv("STEPCORE_THREADS", "zero", 1);
  try {
    cpu::Engine e;
    FAIL() << "bad STEPCORE_THREADS accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), Errc::invalid_argument);
    EXPECT_EQ(err.argument(), "STEPCORE_THREADS");
  }
  ::unsetenv("STEPCORE_THREADS");
  ::setenv("STEPCORE_ISA", "avx9000", 1);
  EXPECT_THROW(cpu::Engine(), Error);
  ::unsetenv("STEPCORE_ISA");
  ::unsetenv("OMP_NUM_THREADS");
  try {
    cpu::Engine e(cpu::EngineConfig{std::nullopt, -2});
    FAIL() << "negative threads accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.argument(), "config.threads");
  }
  const auto isas = cpu::supported_isas();
  if (isas.back() != cpu::Isa::avx512) {
    try {
      cpu::Engine e(cpu::EngineConfig{cpu::Isa::avx512, 1});
      FAIL() << "unsupported ISA accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), Errc::not_supported);
    }
  }
}

TEST(CpuEngine, BadInputWritesNothing) {
  Model m({100, 200, 300}, DType::bf16, 3, 4);
  const Model before = m;
  auto t = m.adamw();
  t[2].state[0].numel = 299;  // the last tensor is bad: nothing of the first two may change
  try {
    cpu::Engine().step(t, AdamWConfig{});
    FAIL() << "size mismatch accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::size_mismatch);
    EXPECT_EQ(e.argument(), "tensors[2].exp_avg");
  }
  EXPECT_TRUE(same_model(before, m));
  t = m.adamw();
  t[1].compute_param = {t[0].param.data, 200, DType::f32};  // overlaps tensors[0].param
  EXPECT_THROW(cpu::Engine().step(t, AdamWConfig{}), Error);
  EXPECT_TRUE(same_model(before, m));
}

}  // namespace
