// Unit: the CPU engine's block-wise 8-bit state (docs/numerics.md 8f) against the reference
// bit for bit — every ISA, threads 1 and 3, AdamW's three formulas and Adam, f32/bf16/f16
// params, f32 and bf16 gradients, a compute output, boundary sizes, ten steps of adversarial
// gradients — and the codebooks and each ISA's requantization against the reference's
// literal quantizers near every threshold.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/q8.hpp"
#include "core/q8_maps.hpp"
#include "cpu/testing.hpp"
#include "isa_list.hpp"
#include "q8_configs.hpp"
#include "reference/testing.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/error.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace {

using stepcore::AdamConfig;
using stepcore::AdamWConfig;
using stepcore::AdamWFormula;
using stepcore::DType;
using stepcore::kQ8BlockSize;
using stepcore::OptimizerTensor;
using stepcore::Q8Slot;
using stepcore::TensorView;
using stepcore::detail::Q8Rule;
using stepcore::testing_support::by_profile;
using stepcore::testing_support::isas_under_test;

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
float from_bits(std::uint32_t b) { return std::bit_cast<float>(b); }

const std::uint32_t* map_of(bool non_negative) {
  return non_negative ? stepcore::detail::kQ8UnsignedBits : stepcore::detail::kQ8SignedBits;
}

// The reference's literal quantizer for a rule.
std::uint8_t oracle(float y, bool non_negative, Q8Rule rule) {
  return rule == Q8Rule::torchao ? stepcore::reference::testing::q8_torchao(y, non_negative)
                                 : stepcore::reference::testing::q8_nearest(y, non_negative);
}

// Values y in [-1, 1] where a code can change: every map value and the `radius` f32 values
// on either side of it (both signs), each midpoint of neighbouring values and its
// neighbours, and a stride through every bit pattern.
std::vector<float> threshold_sweep(bool non_negative, std::uint32_t stride, int radius = 3000) {
  std::vector<float> ys;
  const std::uint32_t* map = map_of(non_negative);
  auto add = [&](float y) {
    if (!std::isnan(y) && std::fabs(y) <= 1.0f) ys.push_back(y);
  };
  for (int c = 0; c < 256; ++c)
    for (int d = -radius; d <= radius; ++d)
      for (std::uint32_t sign : {0u, 0x80000000u}) add(from_bits((map[c] + d) ^ sign));
  for (int c = 0; c + 1 < 256; ++c) {
    const double mid = (static_cast<double>(from_bits(map[c])) + from_bits(map[c + 1])) / 2;
    for (int d = -std::min(radius, 64); d <= std::min(radius, 64); ++d)
      add(from_bits(bits(static_cast<float>(mid)) + d));
  }
  for (std::uint64_t b = 0; b <= 0xFFFFFFFFull; b += stride)
    add(from_bits(static_cast<std::uint32_t>(b)));
  add(0.0f);
  add(-0.0f);
  add(std::numeric_limits<float>::denorm_min());
  add(-std::numeric_limits<float>::denorm_min());
  return ys;
}

TEST(Q8Codebook, CodesEqualTheReferenceQuantizersNearEveryThreshold) {
  for (bool u : {false, true})
    for (Q8Rule rule : {Q8Rule::nearest, Q8Rule::torchao}) {
      const auto& cb = stepcore::detail::q8_codebook(u, rule);
      for (float y : threshold_sweep(u, by_profile<std::uint32_t>(997, 65537, "a coarser stride"),
                                     by_profile(3000, 300, "300 values around each map value")))
        ASSERT_EQ(stepcore::detail::q8_code(cb, y), oracle(y, u, rule))
            << "y " << y << " unsigned " << u << " torchao " << (rule == Q8Rule::torchao);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      EXPECT_EQ(stepcore::detail::q8_code(cb, nan), oracle(nan, u, rule));
      EXPECT_EQ(stepcore::detail::q8_code(cb, -nan), oracle(-nan, u, rule));
    }
}

// Each ISA's requantization against the reference's quantizers, over every block length
// 1..256 (vector lanes and remainder): blocks of values x = RN(y * a) for y near every
// threshold and block maxima a of every kind (1: y' = y; others: the reciprocal path, whose
// y' can differ from RN(x / a) near a threshold; beyond [2^-125, 2^125]: division only);
// and its dequantization against one f32 product per element.
TEST(Q8Quantizer, EveryIsaRequantizesAndDequantizesAsTheReference) {
  for (const stepcore::cpu::Isa isa : isas_under_test()) {
    const auto& table = stepcore::cpu::testing::builtin_kernel_table(isa);
    const std::string name(stepcore::cpu::isa_name(isa));
    for (bool u : {false, true})
      for (Q8Rule rule : {Q8Rule::nearest, Q8Rule::torchao}) {
        const auto& cb = stepcore::detail::q8_codebook(u, rule);
        const std::vector<float> ys =
            threshold_sweep(u, by_profile<std::uint32_t>(1u << 22, 1u << 26, "a coarser stride"),
                            by_profile(48, 12, "12 values around each threshold"));
        std::vector<float> block(kQ8BlockSize);
        std::vector<std::uint8_t> codes(kQ8BlockSize);
        for (float a : {1.0f, 3.0f, 0.7f, 5e-3f, 1e30f, 0x1p-124f, 0x1p126f, 1e-38f, 1e-13f}) {
          const float stored = rule == Q8Rule::torchao ? std::max(a, 1e-12f) : a;
          std::size_t next = 0, len = 1;
          while (next < ys.size()) {
            len = len % kQ8BlockSize + 1;
            block[0] = (len % 2 == 0 || u) ? a : -a;  // the block's maximum magnitude
            std::size_t n = 1;
            for (; n < len && next < ys.size(); ++n) block[n] = ys[next++] * a;
            ASSERT_EQ(bits(table.q8_requantize(block.data(), n, cb, codes.data())), bits(stored))
                << name;
            for (std::size_t i = 0; i < n; ++i)
              ASSERT_EQ(codes[i], oracle(block[i] / stored, u, rule))
                  << name << " x " << block[i] << " a " << a << " at " << i << " of " << n
                  << " unsigned " << u << " torchao " << (rule == Q8Rule::torchao);
          }
        }
        // Blocks with a NaN, an infinity, all zeros, and only subnormals.
        const float nan = std::numeric_limits<float>::quiet_NaN();
        const float inf = std::numeric_limits<float>::infinity();
        const float sub = std::numeric_limits<float>::denorm_min();
        const std::vector<std::vector<float>> specials = {
            {0.5f, -0.25f, nan, 1e-3f, 0.0f, -0.0f, 0.75f, 0.1f, 0.2f, 0.3f},
            {0.5f, -inf, 1e-3f, 0.0f, inf, 3.0f, 2.0f, 1.0f, -1.0f},
            std::vector<float>(37, 0.0f),
            {sub, -sub, 2 * sub, 0.0f, 7 * sub, -3 * sub, sub, sub, sub, -sub, 5 * sub},
        };
        for (const auto& x : specials) {
          float a = 0.0f;
          bool has_nan = false;
          for (float v : x) {
            has_nan = has_nan || std::isnan(v);
            a = std::max(a, std::fabs(v));
          }
          if (has_nan) a = nan;
          if (rule == Q8Rule::torchao && !has_nan) a = std::max(a, 1e-12f);
          const float stored = table.q8_requantize(x.data(), x.size(), cb, codes.data());
          ASSERT_EQ(bits(stored), bits(has_nan ? nan : a)) << name;
          for (std::size_t i = 0; i < x.size(); ++i)
            ASSERT_EQ(codes[i], oracle(x[i] / a, u, rule)) << name << " special " << i;
        }
        // Dequantization: one f32 product per element, every code, maxima of every kind.
        std::mt19937 rng(7);
        std::vector<std::uint8_t> all(kQ8BlockSize);
        for (std::size_t i = 0; i < all.size(); ++i)
          all[i] = static_cast<std::uint8_t>((i * 37) % 256);
        std::vector<float> out(kQ8BlockSize);
        for (float absmax : {1.0f, 0.0f, 3.5e-3f, sub, 1e-40f, 3e38f, inf, nan, 1e-12f}) {
          const std::size_t n = 1 + rng() % kQ8BlockSize;
          table.q8_dequantize(all.data(), absmax, map_of(u), out.data(), n);
          for (std::size_t i = 0; i < n; ++i)
            ASSERT_EQ(bits(out[i]), bits(from_bits(map_of(u)[all[i]]) * absmax))
                << name << " code " << int(all[i]) << " absmax " << absmax;
        }
      }
  }
}

// ---- whole steps ------------------------------------------------------------------------

// One optimizer's tensors with 8-bit state, everything a step writes held here, so a copy
// steps independently of its original.
struct Q8Set {
  struct Tensor {
    std::size_t n = 0;
    DType param_dtype = DType::f32;
    DType grad_dtype = DType::f32;
    bool output = false;             // a bf16 compute output (f32 params only)
    std::vector<std::uint32_t> p32;  // f32 param patterns
    std::vector<std::uint16_t> p16;  // bf16/f16 param patterns
    std::vector<std::uint16_t> out;  // the compute output's bf16 patterns
    std::vector<float> g32;
    std::vector<std::uint16_t> g16;
    float step = 0.0f;
    std::vector<std::uint8_t> codes[3];
    std::vector<float> absmax[3];
  };
  std::vector<Tensor> tensors;
  int slots = 2;

  std::vector<OptimizerTensor> views() {
    std::vector<OptimizerTensor> vs;
    static std::uint8_t no_code;
    static float no_max;
    for (Tensor& t : tensors) {
      OptimizerTensor v;
      v.param = t.param_dtype == DType::f32 ? TensorView{t.p32.data(), t.n, DType::f32}
                                            : TensorView{t.p16.data(), t.n, t.param_dtype};
      v.step = &t.step;
      v.grad = t.grad_dtype == DType::f32
                   ? stepcore::ConstTensorView{t.g32.data(), t.n, DType::f32}
                   : stepcore::ConstTensorView{t.g16.data(), t.n, DType::bf16};
      if (t.output) v.compute_param = TensorView{t.out.data(), t.n, DType::bf16};
      for (int k = 0; k < slots; ++k)
        v.q8[k] =
            t.n == 0 ? Q8Slot{&no_code, &no_max} : Q8Slot{t.codes[k].data(), t.absmax[k].data()};
      vs.push_back(v);
    }
    return vs;
  }
};

struct TensorSpec {
  std::size_t n;
  DType param;
  DType grad;
  bool output;
};

Q8Set make_set(const std::vector<TensorSpec>& specs, int slots, bool torchao) {
  Q8Set set;
  set.slots = slots;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  for (const TensorSpec& s : specs) {
    Q8Set::Tensor t;
    t.n = s.n;
    t.param_dtype = s.param;
    t.grad_dtype = s.grad;
    t.output = s.output;
    if (s.param == DType::f32) {
      t.p32.resize(s.n);
      for (auto& x : t.p32) x = bits(nd(rng));
    } else {
      t.p16.resize(s.n);
      for (auto& x : t.p16)
        x = s.param == DType::bf16 ? stepcore::f32_to_bf16_bits(nd(rng))
                                   : stepcore::f32_to_f16_bits(nd(rng));
    }
    if (s.output) t.out.assign(s.n, 0);
    (s.grad == DType::f32 ? t.g32.resize(s.n) : t.g16.resize(s.n));
    const std::size_t blocks = (s.n + kQ8BlockSize - 1) / kQ8BlockSize;
    for (int k = 0; k < slots; ++k) {
      const bool u = k > 0;
      t.codes[k].assign(s.n, static_cast<std::uint8_t>(u ? stepcore::detail::kQ8UnsignedZero
                                                         : stepcore::detail::kQ8SignedZero));
      t.absmax[k].assign(blocks, torchao ? 1e-12f : 0.0f);
    }
    set.tensors.push_back(std::move(t));
  }
  return set;
}

// The gradients of step s, the same for every copy: all-zero blocks, blocks with one
// non-zero, exact zeros inside blocks, magnitudes from 2^-75 (subnormal moments) to 2^20,
// and at step 4 one element of the last tensor at 2^63 (its square overflows: an infinite
// moment, and its block NaN from the next step).
void fill_grads(Q8Set& set, int s) {
  std::mt19937 rng(1000 + static_cast<unsigned>(s));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-75, 20);
  for (std::size_t t = 0; t < set.tensors.size(); ++t) {
    Q8Set::Tensor& x = set.tensors[t];
    for (std::size_t i = 0; i < x.n; ++i) {
      const std::size_t block = i / kQ8BlockSize;
      float g;
      if (block % 4 == 1)
        g = 0.0f;
      else if (block % 4 == 2)
        g = i % kQ8BlockSize == 17 ? std::ldexp(nd(rng), binade(rng)) : 0.0f;
      else
        g = i % 5 == 3 ? 0.0f : std::ldexp(nd(rng), binade(rng));
      if (s == 4 && t + 1 == set.tensors.size() && i == x.n / 2) g = 0x1p63f;
      if (x.grad_dtype == DType::f32)
        x.g32[i] = g;
      else
        x.g16[i] = stepcore::f32_to_bf16_bits(g);
    }
  }
}

void expect_same(const Q8Set& got, const Q8Set& want, const std::string& what) {
  for (std::size_t t = 0; t < got.tensors.size(); ++t) {
    const auto& a = got.tensors[t];
    const auto& b = want.tensors[t];
    const std::string w =
        what + " tensor " + std::to_string(t) + " (n " + std::to_string(a.n) + ")";
    ASSERT_EQ(a.p32, b.p32) << w << " param";
    ASSERT_EQ(a.p16, b.p16) << w << " param";
    ASSERT_EQ(a.out, b.out) << w << " compute output";
    ASSERT_EQ(bits(a.step), bits(b.step)) << w;
    for (int k = 0; k < got.slots; ++k) {
      ASSERT_EQ(a.codes[k], b.codes[k]) << w << " codes of slot " << k;
      for (std::size_t i = 0; i < a.absmax[k].size(); ++i)
        ASSERT_EQ(bits(a.absmax[k][i]), bits(b.absmax[k][i])) << w << " absmax " << k << "." << i;
    }
  }
}

void reference_step(std::vector<OptimizerTensor>& v, const AdamWConfig& c,
                    stepcore::GradientRead read) {
  stepcore::reference::adamw_step(v, c, read);
}
void reference_step(std::vector<OptimizerTensor>& v, const AdamConfig& c,
                    stepcore::GradientRead read) {
  stepcore::reference::adam_step(v, c, read);
}

// Steps copies of `set` on every ISA under test with threads 1 and 3 and the reference,
// `steps` times, comparing after each step; the gradient read with a scale and a clip,
// its products rounded in the gradient's dtype at odd steps and in f32 at even ones.
template <class Config>
void run_against_reference(const Q8Set& set, const Config& c, int steps, const std::string& what) {
  struct Run {
    stepcore::cpu::Engine engine;
    Q8Set set;
    std::string name;
  };
  std::vector<Run> runs;
  for (const stepcore::cpu::Isa isa : isas_under_test())
    for (int threads : {1, 3})
      runs.push_back(
          {stepcore::cpu::Engine(stepcore::cpu::EngineConfig{isa, threads, {}}), set,
           std::string(stepcore::cpu::isa_name(isa)) + " threads " + std::to_string(threads)});
  Q8Set want = set;
  for (int s = 1; s <= steps; ++s) {
    fill_grads(want, s);
    auto wv = want.views();
    const stepcore::GradientRead read{1.0f / 3.0f, 0.7f, s % 2 == 0};
    reference_step(wv, c, read);
    for (Run& r : runs) {
      fill_grads(r.set, s);
      auto v = r.set.views();
      r.engine.step(v, c, read);
      expect_same(r.set, want, what + " " + r.name + " step " + std::to_string(s));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

std::vector<AdamConfig> adam_configs() {
  AdamConfig plain;
  plain.lr = 1e-2;
  plain.weight_decay = 0.05;
  AdamConfig ams = plain;
  ams.amsgrad = true;
  ams.beta1 = 0.3;
  ams.torch_v_first = true;
  ams.torch_tail_width = 4;
  return {plain, ams};
}

// Boundary sizes, each a tensor of one multi-tensor call: the vector width's, the block's
// and 4 Ki's neighbours; every param and gradient dtype, and a compute output.
std::vector<TensorSpec> boundary_specs() {
  std::vector<TensorSpec> specs;
  const std::size_t sizes[] = {0, 1, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097};
  int k = 0;
  for (std::size_t n : sizes)
    for (DType p : {DType::f32, DType::bf16, DType::f16}) {
      const DType g = (k++ % 2 == 0) ? DType::f32 : DType::bf16;
      specs.push_back({n, p, g, false});
    }
  specs.push_back({777, DType::f32, DType::f32, true});
  return specs;
}

TEST(CpuEngineQ8, AdamWEqualsTheReferenceOnEveryIsaAndThreadCount) {
  const int steps = by_profile(10, 3, "3 steps");
  for (const AdamWConfig& c : stepcore::testing_support::q8_adamw_configs()) {
    const int slots = c.amsgrad ? 3 : 2;
    const Q8Set set = make_set(boundary_specs(), slots, c.formula == AdamWFormula::torchao);
    run_against_reference(
        set, c, steps,
        std::string("adamw ") +
            std::string(stepcore::kAdamWFormulaNames[static_cast<int>(c.formula)]) +
            (c.amsgrad ? " amsgrad" : ""));
    if (HasFatalFailure()) return;
  }
}

TEST(CpuEngineQ8, AdamEqualsTheReferenceOnEveryIsaAndThreadCount) {
  const int steps = by_profile(10, 3, "3 steps");
  for (const AdamConfig& c : adam_configs()) {
    const Q8Set set = make_set(boundary_specs(), c.amsgrad ? 3 : 2, false);
    run_against_reference(set, c, steps, c.amsgrad ? "adam amsgrad" : "adam");
    if (HasFatalFailure()) return;
  }
}

// Work chunks and thread splits fall on block boundaries: sizes around one chunk and a
// tensor of about 10^6 elements.
TEST(CpuEngineQ8, ChunkBoundariesAndAMillionElementsEqualTheReference) {
  const std::size_t chunk = stepcore::cpu::Engine::kWorkChunkElements;
  std::vector<TensorSpec> specs = {{chunk - 1, DType::f32, DType::f32, false},
                                   {chunk, DType::f32, DType::bf16, false},
                                   {chunk + 1, DType::bf16, DType::f32, false},
                                   {1000003, DType::f32, DType::f32, false}};
  for (const AdamWConfig& c : stepcore::testing_support::q8_adamw_configs()) {
    if (c.amsgrad) continue;
    const Q8Set set = make_set(specs, 2, c.formula == AdamWFormula::torchao);
    run_against_reference(
        set, c, by_profile(4, 1, "1 step"),
        std::string("adamw ") +
            std::string(stepcore::kAdamWFormulaNames[static_cast<int>(c.formula)]));
    if (HasFatalFailure()) return;
  }
}

// The optimizers without 8-bit state refuse an 8-bit slot, naming it; a tensor whose used
// slots are partly 8-bit is refused; nothing is written.
TEST(CpuEngineQ8, RefusalsNameTheSlotAndWriteNothing) {
  const stepcore::cpu::Engine engine;
  Q8Set set = make_set({{300, DType::f32, DType::f32, false}}, 2, false);
  fill_grads(set, 1);
  const Q8Set before = set;
  auto refused = [&](std::vector<OptimizerTensor> v, auto config, stepcore::Errc code,
                     const std::string& arg) {
    try {
      engine.step(v, config);
      ADD_FAILURE() << arg << ": not refused";
    } catch (const stepcore::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
    expect_same(set, before, arg);
  };
  stepcore::SgdConfig sgd;
  sgd.momentum = 0.9;
  auto one = set.views();
  one[0].q8[1] = {};
  refused(one, sgd, stepcore::Errc::unsupported_dtype, "tensors[0].q8[0]");
  std::vector<float> v(300);
  auto mixed = set.views();
  mixed[0].q8[1] = {};
  mixed[0].state[1] = TensorView{v.data(), v.size(), DType::f32};
  refused(mixed, AdamWConfig{}, stepcore::Errc::invalid_argument, "tensors[0].q8[1]");
  stepcore::LionConfig lion;
  refused(one, lion, stepcore::Errc::unsupported_dtype, "tensors[0].q8[0]");
}

}  // namespace
