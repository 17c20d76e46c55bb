// The floating-point primitives every CPU kernel body is built from (cpu/simd_body.hpp,
// ArchOps), per ISA, against independent expectations: hand-computed bits, the C
// library's correctly rounded std::fma/std::sqrt, scalar IEEE operations. Inputs tell a
// fused from an unfused multiply-add, catch flush-to-zero, and check NaN payloads and
// signed zeros. ISAs this processor lacks are reported as skipped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/kernel_table.hpp"
#include "cpu/testing.hpp"
#include "isa_list.hpp"
#include "stepcore/convert.hpp"

namespace {

using namespace stepcore;
using cpu::detail::Primitive;
using cpu::detail::Primitive64;

float F(std::uint32_t bits) { return f32_from_bits(bits); }
std::uint32_t B(float x) { return f32_bits(x); }

class Primitives : public ::testing::TestWithParam<cpu::Isa> {
 protected:
  void SetUp() override { STEPCORE_SKIP_UNLESS_ISA(GetParam()); }
  const cpu::detail::KernelTable& table() const {
    return cpu::testing::builtin_kernel_table(GetParam());
  }
  /// Runs `op` lane-wise over the inputs, padded to the ISA's width with copies of the
  /// first element (so every lane position sees every input over the test).
  std::vector<float> run(Primitive op, std::vector<float> a, std::vector<float> b = {},
                         std::vector<float> c = {}) const {
    const std::size_t n = a.size();
    b.resize(n, 1.0f);
    c.resize(n, 1.0f);
    const std::size_t w = table().width;
    // Each input at every lane position: rotate the arrays through w offsets.
    std::vector<float> out(n);
    for (std::size_t shift = 0; shift < w; ++shift) {
      const std::size_t padded = (n + shift + w - 1) / w * w;
      std::vector<float> pa(padded, a[0]), pb(padded, b[0]), pc(padded, c[0]), po(padded);
      for (std::size_t i = 0; i < n; ++i) {
        pa[i + shift] = a[i];
        pb[i + shift] = b[i];
        pc[i + shift] = c[i];
      }
      table().primitive(op, pa.data(), pb.data(), pc.data(), po.data(), padded);
      for (std::size_t i = 0; i < n; ++i) {
        if (shift == 0) {
          out[i] = po[i];
        } else {
          EXPECT_EQ(B(po[i + shift]), B(out[i]))
              << "lane position changes the result of input " << i;
        }
      }
    }
    return out;
  }
};

std::vector<float> random_floats(std::size_t n, std::uint32_t seed, int lo, int hi) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> exp(lo, hi);
  std::uniform_int_distribution<std::uint32_t> mant(0, 0x7FFFFFu), sign(0, 1);
  std::vector<float> v(n);
  for (float& x : v)
    x = F((sign(rng) << 31) | (static_cast<std::uint32_t>(exp(rng) + 127) << 23) | mant(rng));
  return v;
}

TEST_P(Primitives, FmaRoundsOnce) {
  // (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24 exactly; unfused, the square rounds (a tie, to
  // even) to 1 + 2^-11 and the result is 2^-11.
  const float a = F(0x3F800800u);
  auto r = run(Primitive::fma, {a, a, -a}, {a, -a, a}, {-1.0f, 1.0f, 1.0f});
  EXPECT_EQ(B(r[0]), B(0x1p-11f + 0x1p-24f));
  EXPECT_NE(B(r[0]), B(0x1p-11f)) << "an unfused multiply-add";
  EXPECT_EQ(B(r[1]), B(-(0x1p-11f + 0x1p-24f)));
  // Random operands against the C library's fma (one rounding by definition).
  const auto x = random_floats(4096, 1, -20, 20), y = random_floats(4096, 2, -20, 20),
             z = random_floats(4096, 3, -40, 40);
  r = run(Primitive::fma, x, y, z);
  std::size_t fused_differs = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(B(r[i]), B(std::fma(x[i], y[i], z[i]))) << "element " << i;
    const float unfused = x[i] * y[i] + z[i];
    fused_differs += B(unfused) != B(r[i]);
  }
  EXPECT_GT(fused_differs, 0u) << "the inputs must tell fused from unfused";
  // Zeros: fma(+0, -1, +0) = +0 - 0 = +0; fma(-0, 1, -0) = -0.
  r = run(Primitive::fma, {0.0f, -0.0f}, {-1.0f, 1.0f}, {0.0f, -0.0f});
  EXPECT_EQ(B(r[0]), 0x00000000u);
  EXPECT_EQ(B(r[1]), 0x80000000u);
}

TEST_P(Primitives, ArithmeticIsCorrectlyRoundedWithSubnormals) {
  // Subnormal results and operands survive (no FTZ/DAZ in the spec's environment).
  auto r = run(Primitive::mul, {F(0x00800000u), F(0x00000003u)}, {0.5f, 0.5f});
  EXPECT_EQ(B(r[0]), 0x00400000u);
  EXPECT_EQ(B(r[1]), 0x00000002u) << "1.5 ulp of the smallest subnormal ties to even";
  r = run(Primitive::add, {F(0x00000001u), 0.0f, -0.0f}, {F(0x00000001u), -0.0f, -0.0f});
  EXPECT_EQ(B(r[0]), 0x00000002u);
  EXPECT_EQ(B(r[1]), 0x00000000u) << "+0 + -0 = +0";
  EXPECT_EQ(B(r[2]), 0x80000000u) << "-0 + -0 = -0";
  r = run(Primitive::sub, {1.0f, 0.0f}, {1.0f, 0.0f});
  EXPECT_EQ(B(r[0]), 0u);
  EXPECT_EQ(B(r[1]), 0u) << "x - x = +0";
  r = run(Primitive::div, {1.0f, 1.0f, -1.0f, 0.0f}, {3.0f, 0.0f, 0.0f, 0.0f});
  EXPECT_EQ(B(r[0]), 0x3EAAAAABu);
  EXPECT_EQ(B(r[1]), 0x7F800000u);
  EXPECT_EQ(B(r[2]), 0xFF800000u);
  EXPECT_TRUE(std::isnan(r[3]));
  // Random operands against scalar IEEE operations.
  const auto x = random_floats(4096, 4, -140, 120), y = random_floats(4096, 5, -20, 20);
  const auto add = run(Primitive::add, x, y), sub = run(Primitive::sub, x, y),
             mul = run(Primitive::mul, x, y), div = run(Primitive::div, x, y);
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(B(add[i]), B(x[i] + y[i])) << i;
    ASSERT_EQ(B(sub[i]), B(x[i] - y[i])) << i;
    ASSERT_EQ(B(mul[i]), B(x[i] * y[i])) << i;
    ASSERT_EQ(B(div[i]), B(x[i] / y[i])) << i;
  }
}

TEST_P(Primitives, SqrtIsCorrectlyRounded) {
  auto r = run(Primitive::sqrt, {2.0f, -0.0f, 0.0f, -1.0f, F(0x7F800000u), F(0x00000001u)});
  EXPECT_EQ(B(r[0]), 0x3FB504F3u);
  EXPECT_EQ(B(r[1]), 0x80000000u) << "sqrt(-0) = -0";
  EXPECT_EQ(B(r[2]), 0u);
  EXPECT_TRUE(std::isnan(r[3]));
  EXPECT_EQ(B(r[4]), 0x7F800000u);
  EXPECT_EQ(B(r[5]), B(std::sqrt(F(0x00000001u))));
  auto x = random_floats(4096, 6, -149, 127);
  for (float& v : x) v = std::fabs(v);
  r = run(Primitive::sqrt, x);
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(B(r[i]), B(std::sqrt(x[i]))) << i;
}

TEST_P(Primitives, ComparesAreOrderedAndNanAware) {
  const float nan = F(0x7FC00000u), snan = F(0x7F800001u), inf = F(0x7F800000u);
  const std::vector<float> a = {1.0f, -1.0f, 0.0f, -0.0f, nan, 1.0f, snan, inf, 0.0f};
  const std::vector<float> b = {0.0f, 0.0f, -0.0f, 0.0f, 0.0f, nan, snan, inf, F(0x80000001u)};
  const auto gt = run(Primitive::gt, a, b), lt = run(Primitive::lt, a, b),
             eq = run(Primitive::eq, a, b), is_nan = run(Primitive::is_nan, a);
  const float want_gt[] = {1, 0, 0, 0, 0, 0, 0, 0, 1};
  const float want_lt[] = {0, 1, 0, 0, 0, 0, 0, 0, 0};
  const float want_eq[] = {0, 0, 1, 1, 0, 0, 0, 1, 0};
  const float want_nan[] = {0, 0, 0, 0, 1, 0, 1, 0, 0};
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(gt[i], want_gt[i]) << "gt " << i;
    EXPECT_EQ(lt[i], want_lt[i]) << "lt " << i;
    EXPECT_EQ(eq[i], want_eq[i]) << "eq " << i << " (ordered: a NaN is unequal to itself)";
    EXPECT_EQ(is_nan[i], want_nan[i]) << "is_nan " << i;
  }
}

TEST_P(Primitives, SelectKeepsPayloadsAndZeroSigns) {
  const std::vector<float> a = {F(0xFFC00001u), -0.0f, F(0x7F800001u), 1.0f};
  const std::vector<float> b = {0.0f, 0.0f, F(0x80000001u), F(0x7FA00000u)};
  const std::vector<float> c = {-1.0f, -1.0f, 1.0f, 1.0f};  // select a where c < 0
  const auto r = run(Primitive::select, a, b, c);
  EXPECT_EQ(B(r[0]), 0xFFC00001u);
  EXPECT_EQ(B(r[1]), 0x80000000u);
  EXPECT_EQ(B(r[2]), 0x80000001u);
  EXPECT_EQ(B(r[3]), 0x7FA00000u) << "a signalling NaN passes a select unquieted";
}

TEST_P(Primitives, BinarySixtyFourWidenSquareAndSum) {
  const std::size_t w = table().width;
  auto x = random_floats(4 * w, 7, -149, 127);
  x[0] = F(0x00000001u);
  x[1] = F(0x7F7FFFFFu);
  x[2] = -0.0f;
  std::vector<double> acc(4 * w), out(4 * w, -1.0);
  for (std::size_t i = 0; i < acc.size(); ++i)
    acc[i] = std::ldexp(static_cast<double>(i) + 0.25, 200);
  table().primitive64(Primitive64::widen, x.data(), acc.data(), out.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(out[i], static_cast<double>(x[i])) << "widen " << i;
    ASSERT_EQ(std::signbit(out[i]), std::signbit(x[i])) << i;
  }
  table().primitive64(Primitive64::add_square, x.data(), acc.data(), out.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double d = x[i];
    ASSERT_EQ(out[i], acc[i] + d * d) << "add_square " << i;  // d*d is exact
  }
  // dsum of one vector of small integers: exact in any order.
  std::vector<double> ints(w);
  for (std::size_t l = 0; l < w / 2; ++l) ints[l] = static_cast<double>(3 * l + 1);
  std::vector<double> sum(w, 0.0);
  std::vector<float> dummy(w, 0.0f);
  table().primitive64(Primitive64::dsum, dummy.data(), ints.data(), sum.data(), w);
  double want = 0;
  for (std::size_t l = 0; l < w / 2; ++l) want += static_cast<double>(3 * l + 1);
  EXPECT_EQ(sum[0], want);
}

INSTANTIATE_TEST_SUITE_P(EveryIsa, Primitives, ::testing::ValuesIn(testing_support::kAllIsas),
                         [](const ::testing::TestParamInfo<cpu::Isa>& i) {
                           return std::string(cpu::isa_name(i.param));
                         });

}  // namespace
