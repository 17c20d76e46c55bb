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
#include "q8_sets.hpp"
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
using namespace stepcore::testing_support::q8;  // NOLINT: the shared 8-bit sets

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
          // A NaN block stores the quiet NaN, torchao's all bits set (docs/numerics.md 8f.1).
          const std::uint32_t nan_bits = rule == Q8Rule::torchao ? 0xFFFFFFFFu : 0x7FC00000u;
          if (has_nan) a = nan;
          if (rule == Q8Rule::torchao && !has_nan) a = std::max(a, 1e-12f);
          const float stored = table.q8_requantize(x.data(), x.size(), cb, codes.data());
          ASSERT_EQ(bits(stored), has_nan ? nan_bits : bits(a)) << name;
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

TEST(CpuEngineQ8, AdamWEqualsTheReferenceOnEveryIsaAndThreadCount) {
  const int steps = by_profile(10, 3, "3 steps");
  for (const AdamWConfig& c : stepcore::testing_support::q8_adamw_configs()) {
    run_against_reference(make_set(boundary_specs(), c), c, steps, q8_config_name(c));
    if (HasFatalFailure()) return;
  }
}

TEST(CpuEngineQ8, AdamEqualsTheReferenceOnEveryIsaAndThreadCount) {
  const int steps = by_profile(10, 3, "3 steps");
  for (const AdamConfig& c : adam_configs()) {
    run_against_reference(make_set(boundary_specs(), c), c, steps, q8_config_name(c));
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
    run_against_reference(make_set(specs, c), c, by_profile(4, 1, "1 step"), q8_config_name(c));
    if (HasFatalFailure()) return;
  }
}

// The optimizers without 8-bit state refuse an 8-bit slot, naming it; a tensor whose used
// slots are partly 8-bit is refused; nothing is written.
TEST(CpuEngineQ8, RefusalsNameTheSlotAndWriteNothing) {
  const stepcore::cpu::Engine engine;
  Q8Set set = make_set({{300, DType::f32, DType::f32, false}}, AdamWConfig{});
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
