// Unit: block-wise 8-bit state in the reference (docs/numerics.md 8f) against expectations
// built here: the nearest code by brute force over every code in long double, the step
// composed from parts written here (dequantize, the reference's f32 step, requantize), and
// the spec's consequences worked by hand; the optimizers without 8-bit state refuse them.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/q8_maps.hpp"
#include "q8_configs.hpp"
#include "reference/testing.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/error.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace {

using stepcore::AdamWConfig;
using stepcore::AdamWFormula;
using stepcore::DType;
using stepcore::Errc;
using stepcore::kQ8BlockSize;
using stepcore::OptimizerTensor;
using stepcore::Q8Slot;
using stepcore::TensorView;

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

float map_value(bool non_negative, int c) {
  return std::bit_cast<float>(non_negative ? stepcore::detail::kQ8UnsignedBits[c]
                                           : stepcore::detail::kQ8SignedBits[c]);
}
int zero_code(bool non_negative) {
  return non_negative ? stepcore::detail::kQ8UnsignedZero : stepcore::detail::kQ8SignedZero;
}

// The nearest code by brute force: every code's distance in long double (exact for the
// neighbours of y, which are all a tie can involve), a tie to the larger magnitude.
std::uint8_t brute_nearest(float y, bool non_negative) {
  if (std::isnan(y)) return static_cast<std::uint8_t>(zero_code(non_negative));
  int best = 0;
  long double best_d = std::numeric_limits<long double>::infinity();
  for (int c = 0; c < 256; ++c) {
    const long double d = std::fabs(static_cast<long double>(map_value(non_negative, c)) - y);
    if (d < best_d || (d == best_d && std::fabs(map_value(non_negative, c)) >
                                          std::fabs(map_value(non_negative, best)))) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<std::uint8_t>(best);
}

// torchao's quantizer as its Python reads (quant_utils.quantize_8bit_with_qmap), one
// element: the branchless search, then the residual rule.
std::uint8_t torchao_search(float y, bool non_negative) {
  int codes = y >= map_value(non_negative, 128) ? 128 : 0;
  for (int k : {64, 32, 16, 8, 4, 2, 1}) codes += y >= map_value(non_negative, codes + k) ? k : 0;
  const int up = std::min(codes + 1, 255);
  const float val_down = map_value(non_negative, codes);
  const float val_up = map_value(non_negative, up);
  const float residual = y - val_down;
  return static_cast<std::uint8_t>(residual >= (val_up - val_down) * 0.5f ? up : codes);
}

TEST(Q8Maps, AscendFromTheirLeastValueToOneWithTheirZeroCodes) {
  for (bool u : {false, true}) {
    for (int c = 1; c < 256; ++c) ASSERT_LT(map_value(u, c - 1), map_value(u, c)) << c;
    EXPECT_EQ(bits(map_value(u, zero_code(u))), 0u);
    EXPECT_EQ(map_value(u, 255), 1.0f);
  }
  EXPECT_EQ(bits(map_value(false, 0)), 0xbf7e3333u) << "-1 is not a value of the signed map";
  EXPECT_EQ(map_value(true, 0), 0.0f);
}

// N(y) is the exact nearest code: random values over every binade, every value of the map
// and its neighbours, and every midpoint of two neighbours an f32 can hold (a tie) with
// its neighbours.
TEST(Q8Quantizer, NativeIsTheExactNearestCodeWithTiesAwayFromZero) {
  std::mt19937 rng(81);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-40, 0);
  std::size_t ties = 0;
  for (bool u : {false, true}) {
    std::vector<float> ys;
    for (int i = 0; i < 200000; ++i) {
      const float y = std::ldexp(unit(rng), binade(rng));
      ys.push_back(u ? std::fabs(y) : y);
    }
    for (int c = 0; c < 256; ++c) {
      const float v = map_value(u, c);
      ys.insert(ys.end(), {v, std::nextafter(v, -2.0f), std::nextafter(v, 2.0f)});
      if (c == 255) continue;
      const long double mid = (static_cast<long double>(v) + map_value(u, c + 1)) / 2;
      const float m = static_cast<float>(mid);
      if (static_cast<long double>(m) == mid) {
        ++ties;
        ys.insert(ys.end(), {m, std::nextafter(m, -2.0f), std::nextafter(m, 2.0f)});
        EXPECT_EQ(stepcore::reference::testing::q8_nearest(m, u),
                  std::fabs(v) > std::fabs(map_value(u, c + 1)) ? c : c + 1)
            << "the tie between codes " << c << " and " << c + 1;
      }
    }
    ys.insert(ys.end(), {0.0f, -0.0f, 1.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::denorm_min()});
    for (float y : ys)
      ASSERT_EQ(stepcore::reference::testing::q8_nearest(y, u), brute_nearest(y, u))
          << "y " << y << " (" << std::hex << bits(y) << ") map " << (u ? "U" : "S");
  }
  EXPECT_GT(ties, 10u) << "the maps have representable midpoints to test the tie rule on";
}

TEST(Q8Quantizer, TorchaoIsTorchaosSearch) {
  std::mt19937 rng(82);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-30, 0);
  for (bool u : {false, true}) {
    for (int i = 0; i < 200000; ++i) {
      float y = std::ldexp(unit(rng), binade(rng));
      if (u) y = std::fabs(y);
      ASSERT_EQ(stepcore::reference::testing::q8_torchao(y, u), torchao_search(y, u)) << y;
    }
    EXPECT_EQ(stepcore::reference::testing::q8_torchao(std::numeric_limits<float>::quiet_NaN(), u),
              0)
        << "a NaN takes code 0";
  }
  // Its ties go up (toward +inf): on the negative side toward zero, where the native rule
  // goes away from it.
  std::size_t negative_ties = 0;
  for (int c = 0; c < 126; ++c) {
    const long double mid =
        (static_cast<long double>(map_value(false, c)) + map_value(false, c + 1)) / 2;
    const float m = static_cast<float>(mid);
    if (static_cast<long double>(m) != mid) continue;
    ++negative_ties;
    EXPECT_EQ(stepcore::reference::testing::q8_torchao(m, false), c + 1) << c;
    EXPECT_EQ(stepcore::reference::testing::q8_nearest(m, false), c) << c;
  }
  EXPECT_GT(negative_ties, 0u);
}

// ---- the step -------------------------------------------------------------------------

// One tensor's AdamW state kept in 8 bits, with everything the step writes.
struct Q8Tensor {
  std::size_t n = 0;
  DType param_dtype = DType::f32;
  std::vector<std::uint16_t> p16;  // a bf16 param
  std::vector<float> p32;          // an f32 param
  std::vector<float> grad;
  float step = 0.0f;
  std::vector<std::uint8_t> codes[3];
  std::vector<float> absmax[3];

  Q8Tensor(std::size_t numel, DType dtype, int slots, bool torchao) : n(numel), param_dtype(dtype) {
    std::mt19937 rng(static_cast<unsigned>(numel) * 7 + 1);
    std::normal_distribution<float> nd(0.0f, 0.5f);
    if (dtype == DType::f32) {
      p32.resize(n);
      for (float& x : p32) x = nd(rng);
    } else {
      p16.resize(n);
      for (auto& x : p16) x = stepcore::f32_to_bf16_bits(nd(rng));
    }
    grad.resize(n);
    const std::size_t blocks = (n + kQ8BlockSize - 1) / kQ8BlockSize;
    for (int k = 0; k < slots; ++k) {
      const bool u = k > 0;
      codes[k].assign(n, static_cast<std::uint8_t>(zero_code(u)));
      absmax[k].assign(blocks, torchao ? 1e-12f : 0.0f);
    }
  }
  TensorView param() {
    return dtype_f32() ? TensorView{p32.data(), n, DType::f32}
                       : TensorView{p16.data(), n, DType::bf16};
  }
  bool dtype_f32() const { return param_dtype == DType::f32; }
  OptimizerTensor view(int slots) {
    OptimizerTensor t;
    t.param = param();
    t.step = &step;
    t.grad = {grad.data(), n, DType::f32};
    // An empty tensor's slot still says it is 8-bit: any non-null pointers.
    static std::uint8_t no_code;
    static float no_max;
    for (int k = 0; k < slots; ++k)
      t.q8[k] = n == 0 ? Q8Slot{&no_code, &no_max} : Q8Slot{codes[k].data(), absmax[k].data()};
    return t;
  }
};

// The gradients of step s: blocks of zeros, a block with one non-zero, exact zeros inside
// blocks, and magnitudes over many binades (the moments reach subnormal and large values).
void fill_grad(std::vector<float>& g, int s) {
  std::mt19937 rng(1000 + static_cast<unsigned>(s));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-60, 20);
  for (std::size_t i = 0; i < g.size(); ++i) {
    const std::size_t block = i / kQ8BlockSize;
    if (block % 4 == 1) {
      g[i] = 0.0f;  // an all-zero block
    } else if (block % 4 == 2) {
      g[i] = i % kQ8BlockSize == 17 ? std::ldexp(nd(rng), binade(rng)) : 0.0f;
    } else {
      g[i] = i % 5 == 3 ? 0.0f : std::ldexp(nd(rng), binade(rng));
    }
  }
}

// The expected step, from parts written here: dequantize each slot into f32, step those
// with the reference's f32 state (its own oracle, replayed against torch elsewhere), then
// requantize each block (the exact nearest code, or torchao's search over x / max(a, 1e-12)).
void expected_step(Q8Tensor& t, const AdamWConfig& c, int slots) {
  const bool torchao = c.formula == AdamWFormula::torchao;
  std::vector<float> x[3];
  OptimizerTensor v;
  v.param = t.param();
  v.step = &t.step;
  v.grad = {t.grad.data(), t.n, DType::f32};
  for (int k = 0; k < slots; ++k) {
    x[k].resize(t.n);
    for (std::size_t i = 0; i < t.n; ++i)
      x[k][i] = map_value(k > 0, t.codes[k][i]) * t.absmax[k][i / kQ8BlockSize];
    v.state[k] = TensorView{x[k].data(), t.n, DType::f32};
  }
  // The reference takes f32 state only beside an f32 param: step a bf16 param through an
  // f32 copy, rounded once when stored (docs/numerics.md 7.3) — the same arithmetic, the
  // tail placed as for the bf16 param (torch's width doubles).
  std::vector<float> widened;
  AdamWConfig cc = c;
  if (!t.dtype_f32()) {
    widened.resize(t.n);
    for (std::size_t i = 0; i < t.n; ++i) widened[i] = stepcore::bf16_bits_to_f32(t.p16[i]);
    v.param = TensorView{widened.data(), t.n, DType::f32};
    cc.torch_tail_width = 2 * c.torch_tail_width;
  }
  stepcore::reference::adamw_step({&v, 1}, cc);
  if (!t.dtype_f32())
    for (std::size_t i = 0; i < t.n; ++i) t.p16[i] = stepcore::f32_to_bf16_bits(widened[i]);
  for (int k = 0; k < slots; ++k)
    for (std::size_t b0 = 0; b0 < t.n; b0 += kQ8BlockSize) {
      const std::size_t b1 = std::min(t.n, b0 + kQ8BlockSize);
      float a = 0.0f;
      bool nan = false;
      for (std::size_t i = b0; i < b1; ++i) {
        nan = nan || std::isnan(x[k][i]);
        a = std::max(a, std::fabs(x[k][i]));
      }
      if (nan) a = std::numeric_limits<float>::quiet_NaN();
      if (torchao && !nan) a = std::max(a, 1e-12f);
      t.absmax[k][b0 / kQ8BlockSize] = a;
      for (std::size_t i = b0; i < b1; ++i)
        t.codes[k][i] =
            torchao ? torchao_search(x[k][i] / a, k > 0) : brute_nearest(x[k][i] / a, k > 0);
    }
}

void expect_same(const Q8Tensor& got, const Q8Tensor& want, int slots, const std::string& what) {
  if (got.dtype_f32()) {
    for (std::size_t i = 0; i < got.n; ++i)
      ASSERT_EQ(bits(got.p32[i]), bits(want.p32[i])) << what << " param " << i;
  } else {
    ASSERT_EQ(got.p16, want.p16) << what << " param";
  }
  ASSERT_EQ(bits(got.step), bits(want.step)) << what;
  for (int k = 0; k < slots; ++k) {
    ASSERT_EQ(got.codes[k], want.codes[k]) << what << " codes of slot " << k;
    for (std::size_t b = 0; b < got.absmax[k].size(); ++b)
      ASSERT_EQ(bits(got.absmax[k][b]), bits(want.absmax[k][b])) << what << " absmax " << b;
  }
}

TEST(ReferenceQ8, AdamWStepsEqualDequantizeStepRequantizeOverAdversarialBlocks) {
  for (const AdamWConfig& c : stepcore::testing_support::q8_adamw_configs())
    for (DType dt : {DType::f32, DType::bf16})
      for (std::size_t n : {0, 1, 31, 255, 256, 257, 1023, 4095, 4097}) {
        const int slots = c.amsgrad ? 3 : 2;
        const bool torchao = c.formula == AdamWFormula::torchao;
        Q8Tensor got(n, dt, slots, torchao), want(n, dt, slots, torchao);
        for (int s = 1; s <= 10; ++s) {
          fill_grad(got.grad, s);
          want.grad = got.grad;
          OptimizerTensor v = got.view(slots);
          stepcore::reference::adamw_step({&v, 1}, c);
          expected_step(want, c, slots);
          expect_same(
              got, want, slots,
              "formula " + std::string(stepcore::kAdamWFormulaNames[static_cast<int>(c.formula)]) +
                  (c.amsgrad ? " amsgrad" : "") + " " + std::string(stepcore::dtype_name(dt)) +
                  " n " + std::to_string(n) + " step " + std::to_string(s));
          if (HasFatalFailure()) return;
        }
      }
}

// Zeros stay zeros: coordinates whose gradient is always zero keep codes of zero and,
// without weight decay, their parameter's bits, through ten steps; an all-zero block
// stores absmax 0 (native) or torchao's 1e-12.
TEST(ReferenceQ8, ZeroGradientCoordinatesStayExactlyPut) {
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch, AdamWFormula::torchao}) {
    AdamWConfig c;
    c.formula = f;
    c.weight_decay = 0.0;
    const bool torchao = f == AdamWFormula::torchao;
    Q8Tensor t(600, DType::f32, 2, torchao);
    const std::vector<float> p0 = t.p32;
    for (int s = 1; s <= 10; ++s) {
      for (std::size_t i = 0; i < t.n; ++i)
        t.grad[i] = (i < 256 || i % 3 == 0) ? 0.0f : 0.01f * static_cast<float>(s);
      OptimizerTensor v = t.view(2);
      stepcore::reference::adamw_step({&v, 1}, c);
    }
    for (std::size_t i = 0; i < t.n; ++i) {
      if (!(i < 256 || i % 3 == 0)) continue;
      ASSERT_EQ(bits(t.p32[i]), bits(p0[i])) << "formula " << static_cast<int>(f) << " " << i;
      ASSERT_EQ(t.codes[0][i], zero_code(false));
      ASSERT_EQ(t.codes[1][i], zero_code(true));
    }
    EXPECT_EQ(bits(t.absmax[0][0]), bits(torchao ? 1e-12f : 0.0f)) << "the all-zero block";
    EXPECT_GT(t.absmax[0][1], 0.0f);
  }
}

// An infinite moment from a finite gradient makes the block's codes all zero with an
// infinite maximum; the next step's values are NaN, and so is every parameter of the
// block, not of the others. A found-inf step writes nothing.
TEST(ReferenceQ8, AnInfiniteMomentMakesItsBlockNaNAtTheNextStep) {
  AdamWConfig c;
  c.formula = AdamWFormula::native;
  Q8Tensor t(512, DType::f32, 2, false);
  for (std::size_t i = 0; i < t.n; ++i) t.grad[i] = 0.5f;
  t.grad[3] = 3e19f;  // finite; g*g overflows
  OptimizerTensor v = t.view(2);
  stepcore::reference::adamw_step({&v, 1}, c);
  EXPECT_TRUE(std::isinf(t.absmax[1][0]));
  for (std::size_t i = 0; i < 256; ++i) ASSERT_EQ(t.codes[1][i], zero_code(true)) << i;
  EXPECT_TRUE(std::isfinite(t.absmax[1][1]));
  const Q8Tensor before = t;
  const std::int32_t found_inf = 1;
  stepcore::reference::adamw_step({&v, 1}, c, {}, &found_inf);
  expect_same(t, before, 2, "a found-inf step");
  for (std::size_t i = 0; i < t.n; ++i) t.grad[i] = 0.5f;
  stepcore::reference::adamw_step({&v, 1}, c);
  for (std::size_t i = 0; i < 256; ++i) ASSERT_TRUE(std::isnan(t.p32[i])) << i;
  for (std::size_t i = 256; i < 512; ++i) ASSERT_TRUE(std::isfinite(t.p32[i])) << i;
}

// Bad input: each refusal names the argument and writes nothing; the optimizers without
// 8-bit state refuse an 8-bit slot (the CPU engine's refusals: test_q8_engine.cpp).
TEST(ReferenceQ8, BadSlotsAreRefusedBeforeAnythingIsWritten) {
  AdamWConfig c;
  Q8Tensor t(300, DType::f32, 2, false);
  for (std::size_t i = 0; i < t.n; ++i) t.grad[i] = 1.0f;
  const Q8Tensor before = t;
  auto refused = [&](OptimizerTensor v, auto&& step, Errc code, const std::string& arg) {
    try {
      step(v);
      ADD_FAILURE() << arg << ": not refused";
    } catch (const stepcore::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
    expect_same(t, before, 2, arg);
  };
  auto reference = [&](OptimizerTensor& v) { stepcore::reference::adamw_step({&v, 1}, c); };
  std::vector<float> m(t.n);
  OptimizerTensor v = t.view(2);
  v.state[0] = TensorView{m.data(), t.n, DType::f32};
  refused(v, reference, Errc::invalid_argument, "tensors[0].state[0]");
  v = t.view(2);
  v.q8[1].absmax = nullptr;
  refused(v, reference, Errc::invalid_argument, "tensors[0].q8[1]");
  v = t.view(2);
  v.q8[0].codes = t.codes[1].data();  // overlaps slot 1's codes
  refused(v, reference, Errc::overlap, "tensors[0].q8[1]");
  v = t.view(2);
  v.q8[2] = Q8Slot{t.codes[0].data(), t.absmax[0].data()};  // no amsgrad: slot 2 unused
  refused(v, reference, Errc::invalid_argument, "tensors[0].q8[2]");
  stepcore::SgdConfig sgd;
  sgd.momentum = 0.9;
  refused(
      t.view(1),
      [&](OptimizerTensor& w) {
        stepcore::reference::sgd_step({&w, 1}, sgd);
      },
      Errc::unsupported_dtype, "tensors[0].q8[0]");
}

}  // namespace
