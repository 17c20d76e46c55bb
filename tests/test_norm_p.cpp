// Unit: the norms of other orders (docs/numerics.md 6.6) on the reference and the CPU
// engine (every ISA this processor runs, threads 1 and 3), against oracles written here:
// the 1-norm against an exact big-integer sum rounded once to f32 (independent of the
// superaccumulator), inf / -inf / 0 against plain max, min and counts, other p against
// a scaled long double computation within the documented accuracy.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "big_int.hpp"
#include "isa_list.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/error.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/reference.hpp"

namespace {

using namespace stepcore;
using test_support::Big;
using test_support::cmp;
namespace ref = stepcore::reference;

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kInfD = std::numeric_limits<double>::infinity();

// ---- the 1-norm oracle: S = sum |x| * 2^149 as a big integer, rounded here ----------

// |x| = m * 2^e with integer m < 2^24, e >= -149 (from frexp, not from the bit fields).
Big units_of_abs(float x) {
  int ex = 0;
  const double f = std::frexp(std::fabs(static_cast<double>(x)), &ex);
  auto m = static_cast<std::uint64_t>(std::ldexp(f, 24));
  int e = ex - 24;
  while (e < -149) {
    m /= 2;
    ++e;
  }
  return Big::of(m).shl(e + 149);
}

// RN_f32(S * 2^-149), ties to even, +Inf at or beyond the overflow midpoint.
float round_units(const Big& s) {
  if (s.is_zero()) return 0.0f;
  const int L = s.bit_length();
  const int c = std::max(L - 24, 0);
  std::uint64_t k = s.shr(c).low64();
  if (c > 0) {
    // Compare the dropped part with half a unit of the kept grid: 2 (S - k 2^c) vs 2^c.
    const Big rest = s - Big::of(k).shl(c);
    const int r = cmp(rest.shl(1), Big::of(1).shl(c));
    if (r > 0 || (r == 0 && (k & 1))) ++k;
  }
  const double v = std::ldexp(static_cast<double>(k), c - 149);
  if (v >= std::ldexp(1.0, 128)) return kInf;
  return static_cast<float>(v);
}

float oracle_l1(const std::vector<float>& xs) {
  Big s;
  for (float x : xs)
    if (x != 0.0f) s = s + units_of_abs(x);
  return round_units(s);
}

// ---- data ------------------------------------------------------------------------------

struct Tensor {
  DType dtype = DType::f32;
  std::vector<float> f32;
  std::vector<std::uint16_t> h16;
  ConstTensorView view() const {
    if (dtype == DType::f32) return {f32.data(), f32.size(), dtype};
    return {h16.data(), h16.size(), dtype};
  }
  std::size_t size() const { return dtype == DType::f32 ? f32.size() : h16.size(); }
  float value(std::size_t i) const {
    if (dtype == DType::f32) return f32[i];
    return dtype == DType::bf16 ? bf16_bits_to_f32(h16[i]) : f16_bits_to_f32(h16[i]);
  }
  void push(float x) {
    if (dtype == DType::f32)
      f32.push_back(x);
    else
      h16.push_back(dtype == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x));
  }
};

std::vector<ConstTensorView> views(const std::vector<Tensor>& ts) {
  std::vector<ConstTensorView> v;
  for (const Tensor& t : ts) v.push_back(t.view());
  return v;
}
std::vector<float> values(const std::vector<Tensor>& ts) {
  std::vector<float> v;
  for (const Tensor& t : ts)
    for (std::size_t i = 0; i < t.size(); ++i) v.push_back(t.value(i));
  return v;
}

// Random finite values: any exponent (subnormals to near-overflow) or a narrow band.
float random_value(std::mt19937_64& rng, int kind) {
  const auto r = static_cast<std::uint32_t>(rng());
  switch (kind) {
    case 0:  // every finite f32 (the exponent field 0..254)
      return from_bits((r & 0x807FFFFFu) | (static_cast<std::uint32_t>(rng() % 255) << 23));
    case 1:  // subnormals only
      return from_bits(r & 0x807FFFFFu);
    case 2:  // near overflow
      return from_bits((r & 0x807FFFFFu) | (static_cast<std::uint32_t>(250 + rng() % 5) << 23));
    default:  // ordinary gradients around 1
      return from_bits((r & 0x807FFFFFu) | (static_cast<std::uint32_t>(110 + rng() % 20) << 23));
  }
}

Tensor random_tensor(std::mt19937_64& rng, DType dt, std::size_t n, int kind) {
  Tensor t;
  t.dtype = dt;
  for (std::size_t i = 0; i < n; ++i) {
    float x = random_value(rng, kind);
    t.push(x);
    if (!std::isfinite(t.value(t.size() - 1))) {  // beyond bf16's or f16's range: just below
      t.dtype == DType::f32 ? t.f32.pop_back() : t.h16.pop_back();
      t.push(std::ldexp(x, 14 - std::ilogb(x)));
    }
  }
  return t;
}

const std::size_t kSizes[] = {0,    1,    7,    8,    9,    31,    32,    33,   1023,
                              1024, 1025, 2047, 2048, 2049, 32767, 32768, 32769};
const DType kDTypes[] = {DType::f32, DType::bf16, DType::f16};

std::string label(cpu::Isa isa, int threads) {
  return std::string(cpu::isa_name(isa)) + " threads " + std::to_string(threads);
}

// ---- the 1-norm -------------------------------------------------------------------------

TEST(Norm1Oracle, HandWorked) {
  EXPECT_EQ(bits(oracle_l1({1.0f, -2.0f, 4.0f})), bits(7.0f));
  EXPECT_EQ(bits(oracle_l1({from_bits(1), from_bits(0x80000001u)})), bits(from_bits(2)));
  EXPECT_EQ(bits(oracle_l1({16777216.0f, 1.0f})), bits(16777216.0f));                // tie: even
  EXPECT_EQ(bits(oracle_l1({16777216.0f, 3.0f})), bits(16777220.0f));                // tie: even
  EXPECT_EQ(bits(oracle_l1({16777216.0f, 1.0f, from_bits(1)})), bits(16777218.0f));  // sticky
  EXPECT_EQ(bits(oracle_l1({FLT_MAX, 0x1p103f})), bits(kInf));  // the overflow midpoint
  EXPECT_EQ(bits(oracle_l1({FLT_MAX, 0x1p102f, 0x1p101f})), bits(FLT_MAX));
}

// The hand-worked cases above through the reference and every engine.
TEST(Norm1, HandWorkedOnEveryPath) {
  const std::vector<std::vector<float>> cases = {
      {},
      {0.0f, -0.0f},
      {1.0f, -2.0f, 4.0f},
      {from_bits(1), from_bits(0x80000001u)},
      {16777216.0f, 1.0f},
      {16777216.0f, 3.0f},
      {16777216.0f, 1.0f, from_bits(1)},
      {FLT_MAX, 0x1p103f},
      {FLT_MAX, 0x1p102f, 0x1p101f},
      {FLT_MAX, -FLT_MAX},
  };
  for (const auto& xs : cases) {
    Tensor t;
    t.f32 = xs;
    const ConstTensorView v = t.view();
    const float want = oracle_l1(xs);
    const NormResult r = ref::p_norm({&v, 1}, 1.0);
    EXPECT_EQ(bits(r.norm), bits(want)) << xs.size();
    EXPECT_EQ(r.finite, want != kInf);
    for (const cpu::Isa isa : testing_support::isas_under_test())
      for (int threads : {1, 3}) {
        const cpu::Engine e(cpu::EngineConfig{isa, threads});
        EXPECT_EQ(bits(e.p_norm({&v, 1}, 1.0).norm), bits(want)) << label(isa, threads);
        EXPECT_EQ(bits(e.norm({&v, 1}, {}, NormOrder::one).norm), bits(want));
      }
  }
}

// Random data of every dtype and magnitude class at the boundary sizes: the reference's
// exact partial equals the engine's exact partial digit for digit, and every finalised
// 1-norm (fast or exact, reference or engine) equals the oracle.
TEST(Norm1, RandomDataEqualsTheOracleOnEveryPath) {
  std::mt19937_64 rng(11);
  for (const DType dt : kDTypes)
    for (const std::size_t n : kSizes)
      for (int kind = 0; kind < 4; ++kind) {
        if (n > 2049 && kind != 0 && kind != 3) continue;  // keep the run short
        const std::vector<Tensor> ts = {random_tensor(rng, dt, n, kind),
                                        random_tensor(rng, dt, n % 5, 3)};
        const auto v = views(ts);
        const float want = oracle_l1(values(ts));
        SCOPED_TRACE(std::string(dtype_name(dt)) + " n " + std::to_string(n) + " kind " +
                     std::to_string(kind));
        const NormPartial exact = ref::norm_partial(v, {}, NormOrder::one);
        ASSERT_EQ(bits(finalize(exact, NormOrder::one).norm), bits(want));
        for (const cpu::Isa isa : testing_support::isas_under_test())
          for (int threads : {1, 3}) {
            SCOPED_TRACE(label(isa, threads));
            const cpu::Engine e(cpu::EngineConfig{isa, threads});
            EXPECT_TRUE(same_value(e.norm_partial(v, {}, NormMode::exact, NormOrder::one), exact));
            const NormResult fast =
                finalize(e.norm_partial(v, {}, NormMode::fast, NormOrder::one), NormOrder::one);
            if (!fast.needs_exact) EXPECT_EQ(bits(fast.norm), bits(want));
            EXPECT_EQ(bits(e.norm(v, {}, NormOrder::one).norm), bits(want));
            EXPECT_EQ(bits(e.p_norm(v, 1.0).norm), bits(want));
          }
      }
}

// About 10^6 values in many tensors, split three ways: the same bits for any split.
TEST(Norm1, ManyTensorsAndAMillionValues) {
  std::mt19937_64 rng(12);
  std::vector<Tensor> ts;
  std::vector<float> all;
  for (int k = 0; k < 40; ++k) {
    ts.push_back(random_tensor(rng, kDTypes[k % 3], 1 + rng() % 50000, k % 2 ? 0 : 3));
    const auto v = values({ts.back()});
    all.insert(all.end(), v.begin(), v.end());
  }
  const float want = oracle_l1(all);
  Tensor flat;
  flat.f32 = all;
  std::shuffle(flat.f32.begin(), flat.f32.end(), rng);
  const ConstTensorView fv = flat.view();
  for (const cpu::Isa isa : testing_support::isas_under_test())
    for (int threads : {1, 3}) {
      const cpu::Engine e(cpu::EngineConfig{isa, threads});
      EXPECT_EQ(bits(e.p_norm(views(ts), 1.0).norm), bits(want)) << label(isa, threads);
      EXPECT_EQ(bits(e.p_norm({&fv, 1}, 1.0).norm), bits(want)) << label(isa, threads);
    }
}

// Sums built on a rounding tie cannot be certified from a 2^-40 approximation: the fast
// partial must ask for the exact one, and the engine's norm must then be the tie's even.
TEST(Norm1, TiesFallBackToTheExactPartial) {
  Tensor t;
  t.f32.assign(3000, 0.0f);
  t.f32[0] = 16777216.0f;
  t.f32[2999] = 1.0f;  // 2^24 + 1: a tie, in another block than 2^24
  const ConstTensorView v = t.view();
  for (const cpu::Isa isa : testing_support::isas_under_test()) {
    const cpu::Engine e(cpu::EngineConfig{isa, 1});
    EXPECT_TRUE(
        finalize(e.norm_partial({&v, 1}, {}, NormMode::fast, NormOrder::one), NormOrder::one)
            .needs_exact);
    EXPECT_EQ(bits(e.p_norm({&v, 1}, 1.0).norm), bits(16777216.0f));
  }
}

TEST(Norm1, TheReadIsScaledAndClipped) {
  std::mt19937_64 rng(13);
  for (const DType dt : kDTypes) {
    Tensor t = random_tensor(rng, dt, 1025, 3);
    const GradientRead read{0.375f, 0.75f};
    // The oracle of the eagerly scaled values: R_T(R_T(x * s) * c).
    std::vector<float> eager;
    for (std::size_t i = 0; i < t.size(); ++i) {
      const float x = t.value(i);
      const auto rt = [&](float y) {
        if (dt == DType::f32) return y;
        return dt == DType::bf16 ? bf16_bits_to_f32(f32_to_bf16_bits(y))
                                 : f16_bits_to_f32(f32_to_f16_bits(y));
      };
      eager.push_back(rt(rt(x * read.scale) * read.clip));
    }
    const ConstTensorView v = t.view();
    const float want = oracle_l1(eager);
    EXPECT_EQ(bits(ref::p_norm({&v, 1}, 1.0, read).norm), bits(want));
    for (const cpu::Isa isa : testing_support::isas_under_test())
      EXPECT_EQ(bits(cpu::Engine(cpu::EngineConfig{isa, 3}).p_norm({&v, 1}, 1.0, read).norm),
                bits(want));
  }
}

// ---- non-finite values, bad orders ----------------------------------------------------

struct NonFinite {
  double p;
  std::vector<float> xs;
  float norm;  // the expected norm (NaN: any NaN)
};

TEST(NormP, NonFiniteValuesEveryOrder) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<NonFinite> cases = {
      {1.0, {1.0f, nan, kInf}, nan}, {1.0, {1.0f, -kInf}, kInf},
      {3.0, {1.0f, nan}, nan},       {3.0, {1.0f, -kInf}, kInf},
      {0.5, {0.0f, kInf}, kInf},     {-1.0, {2.0f, kInf}, 2.0f},  // Inf's term is 0
      {-1.0, {kInf, -kInf}, kInf},   {-1.0, {2.0f, nan}, nan},
      {kInfD, {2.0f, -kInf}, kInf},  {kInfD, {2.0f, nan}, nan},
      {-kInfD, {2.0f, -kInf}, 2.0f}, {-kInfD, {kInf}, kInf},
      {-kInfD, {2.0f, nan}, nan},    {0.0, {0.0f, nan, kInf, 1.0f}, 3.0f},
  };
  for (const NonFinite& c : cases) {
    Tensor t;
    t.f32 = c.xs;
    const ConstTensorView v = t.view();
    SCOPED_TRACE("p " + std::to_string(c.p) + " n " + std::to_string(c.xs.size()));
    const NormResult r = ref::p_norm({&v, 1}, c.p);
    if (std::isnan(c.norm))
      EXPECT_TRUE(std::isnan(r.norm));
    else
      EXPECT_EQ(bits(r.norm), bits(c.norm));
    EXPECT_FALSE(r.finite);  // found-inf: a NaN or Inf was read, whatever the norm
    for (const cpu::Isa isa : testing_support::isas_under_test()) {
      const NormResult e = cpu::Engine(cpu::EngineConfig{isa, 3}).p_norm({&v, 1}, c.p);
      EXPECT_EQ(bits(e.norm), bits(r.norm));
      EXPECT_EQ(e.nan_count, r.nan_count);
      EXPECT_EQ(e.inf_count, r.inf_count);
      EXPECT_FALSE(e.finite);
    }
  }
}

TEST(NormP, NaNOrderIsRejectedNamingP) {
  Tensor t;
  t.f32 = {1.0f};
  const ConstTensorView v = t.view();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  try {
    ref::p_norm({&v, 1}, nan);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_EQ(e.argument(), "p");
  }
  EXPECT_THROW(cpu::Engine().p_norm({&v, 1}, nan), Error);
}

// ---- inf, -inf, 0 -----------------------------------------------------------------------

TEST(NormP, InfMinusInfAndZeroAreExact) {
  std::mt19937_64 rng(14);
  for (const DType dt : kDTypes)
    for (const std::size_t n : kSizes) {
      std::vector<Tensor> ts = {random_tensor(rng, dt, n, static_cast<int>(n % 4)),
                                random_tensor(rng, dt, 3, 1)};
      if (n > 4) ts[0].push(0.0f);  // a zero (and -0 from the random signs of tiny values)
      const auto v = views(ts);
      const auto xs = values(ts);
      float mx = 0.0f, mn = kInf;
      std::uint64_t nonzero = 0;
      for (float x : xs) {
        mx = std::max(mx, std::fabs(x));
        mn = std::min(mn, std::fabs(x));
        nonzero += x != 0.0f;
      }
      if (xs.empty()) mn = 0.0f;
      SCOPED_TRACE(std::string(dtype_name(dt)) + " n " + std::to_string(n));
      EXPECT_EQ(bits(ref::p_norm(v, kInfD).norm), bits(mx));
      EXPECT_EQ(bits(ref::p_norm(v, -kInfD).norm), bits(mn));
      EXPECT_EQ(bits(ref::p_norm(v, 0.0).norm), bits(static_cast<float>(nonzero)));
      for (const cpu::Isa isa : testing_support::isas_under_test())
        for (int threads : {1, 3}) {
          const cpu::Engine e(cpu::EngineConfig{isa, threads});
          EXPECT_EQ(bits(e.p_norm(v, kInfD).norm), bits(mx)) << label(isa, threads);
          EXPECT_EQ(bits(e.p_norm(v, -kInfD).norm), bits(mn)) << label(isa, threads);
          EXPECT_EQ(bits(e.p_norm(v, 0.0).norm), bits(static_cast<float>(nonzero)));
        }
    }
}

// ---- other p --------------------------------------------------------------------------

// The p-norm in long double: scaled by the largest (p > 0) or smallest (p < 0) |x|, terms
// summed in ascending order. Relative error well below 2^-50 for these sizes.
long double ld_norm(const std::vector<float>& xs, double p) {
  std::vector<long double> a;
  for (float x : xs) a.push_back(std::fabs(static_cast<long double>(x)));
  if (a.empty()) return 0.0L;
  const long double base =
      p > 0 ? *std::max_element(a.begin(), a.end()) : *std::min_element(a.begin(), a.end());
  if (base == 0.0L) return 0.0L;
  std::vector<long double> terms;
  for (long double y : a) terms.push_back(y == 0.0L ? 0.0L : std::pow(y / base, (long double)p));
  std::sort(terms.begin(), terms.end());
  long double s = 0.0L;
  for (long double t : terms) s += t;
  return base * std::pow(s, 1.0L / p);
}

// ours is faithful (one of the two floats around the long double value), and is its
// rounding whenever that value is not within 2^-40 (relative) of a rounding midpoint.
void expect_faithful(float ours, long double want, const std::string& what) {
  if (want > static_cast<long double>(FLT_MAX) * (1.0L + 0x1p-25L)) {
    EXPECT_EQ(bits(ours), bits(kInf)) << what;
    return;
  }
  const auto rn = static_cast<float>(want);
  const float lo = std::nextafter(rn, 0.0f), hi = std::nextafter(rn, kInf);
  const long double mid_lo = (static_cast<long double>(lo) + rn) / 2;
  const long double mid_hi = (static_cast<long double>(hi) + rn) / 2;
  const long double gap = std::min(std::fabs(want - mid_lo), std::fabs(want - mid_hi));
  if (gap > std::fabs(want) * 0x1p-40L) {
    EXPECT_EQ(bits(ours), bits(rn)) << what << " want " << static_cast<double>(want);
  } else {
    const long double d = std::fabs(static_cast<long double>(ours) - want);
    EXPECT_LE(d, std::fabs(static_cast<long double>(hi) - lo)) << what;
  }
}

TEST(NormP, OtherOrdersAreFaithfulAndTheSameOnEveryPath) {
  std::mt19937_64 rng(15);
  const double orders[] = {3.0, 0.5, 1.5, 4.0, -1.0, -0.5, -2.5, 7.25, 100.0, 1e-3, -40.0};
  const std::size_t sizes[] = {1, 7, 9, 33, 1025, 32769};
  for (const double p : orders)
    for (const DType dt : kDTypes)
      for (const std::size_t n : sizes) {
        const int kind = static_cast<int>((n + static_cast<std::size_t>(dt)) % 4);
        const std::vector<Tensor> ts = {random_tensor(rng, dt, n, kind),
                                        random_tensor(rng, dt, 5, 3)};
        const auto v = views(ts);
        const std::string what = "p " + std::to_string(p) + " " + std::string(dtype_name(dt)) +
                                 " n " + std::to_string(n);
        const NormResult r = ref::p_norm(v, p);
        expect_faithful(r.norm, ld_norm(values(ts), p), what);
        for (const cpu::Isa isa : testing_support::isas_under_test())
          for (int threads : {1, 3})
            EXPECT_EQ(bits(cpu::Engine(cpu::EngineConfig{isa, threads}).p_norm(v, p).norm),
                      bits(r.norm))
                << what << " " << label(isa, threads);
      }
}

TEST(NormP, HandWorkedOrders) {
  Tensor t;
  t.f32 = {3.0f, -4.0f, 0.0f};
  const ConstTensorView v = t.view();
  EXPECT_EQ(bits(ref::p_norm({&v, 1}, 3.0).norm), bits(static_cast<float>(std::cbrt(91.0))));
  EXPECT_EQ(bits(ref::p_norm({&v, 1}, 0.5).norm),
            bits(static_cast<float>(std::pow(std::sqrt(3.0) + 2.0, 2.0))));
  EXPECT_EQ(bits(ref::p_norm({&v, 1}, -1.0).norm), bits(0.0f));  // a zero: 1/0 = Inf
  EXPECT_EQ(bits(ref::p_norm({&v, 1}, 0.0).norm), bits(2.0f));
  Tensor u;
  u.f32 = {2.0f, -2.0f, 4.0f};
  const ConstTensorView w = u.view();
  EXPECT_EQ(bits(ref::p_norm({&w, 1}, -1.0).norm), bits(0.8f));  // 1 / (1/2 + 1/2 + 1/4)
  // Terms far outside binary64 without the scaling: 2^120 ^ 10 and 2^-149 ^ 8.
  Tensor big;
  big.f32 = {0x1p120f, 0x1p120f};
  const ConstTensorView b = big.view();
  EXPECT_EQ(bits(ref::p_norm({&b, 1}, 10.0).norm),
            bits(static_cast<float>(0x1p120 * std::pow(2.0, 0.1))));
  Tensor tiny;
  tiny.f32 = {from_bits(1), from_bits(1)};
  const ConstTensorView s = tiny.view();
  EXPECT_EQ(bits(ref::p_norm({&s, 1}, 8.0).norm),
            bits(static_cast<float>(0x1p-149 * std::pow(2.0, 0.125))));
  // No values: 0 for every order.
  const ConstTensorView none(t.f32.data(), 0, DType::f32);
  for (const double p : {1.0, 2.0, 3.0, -1.0, 0.0, kInfD, -kInfD})
    EXPECT_EQ(bits(ref::p_norm({&none, 1}, p).norm), bits(0.0f)) << p;
}

}  // namespace
