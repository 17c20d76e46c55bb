// Unit: the exact L2 norm (reference::norm_partial, merge, finalize, same_value)
// and clip_coefficient, against an independent big-integer oracle written here:
// correct rounding incl. ties and sticky bits, invariance under any partition,
// order and merge tree, NaN/Inf handling, the scaled/clipped read.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "big_int.hpp"
#include "core/superaccumulator.hpp"
#include "reference/testing.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace {

using test_support::Big;
using test_support::cmp;
using test_support::isqrt;
using test_support::round_sqrt;

using stepcore::ConstTensorView;
using stepcore::DType;
using stepcore::GradientRead;
using stepcore::NormPartial;
using stepcore::NormResult;
namespace ref = stepcore::reference;

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }
constexpr float kInf = std::numeric_limits<float>::infinity();

// x = m * 2^e with integer m < 2^24 and e >= -149 (x finite, non-zero).
void decompose(float x, std::uint64_t& m, int& e) {
  int ex = 0;
  const double f =
      std::frexp(std::fabs(static_cast<double>(x)), &ex);  // |x| = f * 2^ex, f in [0.5, 1)
  m = static_cast<std::uint64_t>(std::ldexp(f, 24));
  e = ex - 24;
  while (e < -149) {  // subnormals: the low bits are zero
    EXPECT_EQ(m % 2, 0u);
    m /= 2;
    ++e;
  }
}

// S = sum x^2 * 2^298 over the finite values.
Big exact_sum(const std::vector<float>& xs) {
  Big s;
  for (float x : xs) {
    if (x == 0.0f) continue;
    std::uint64_t m = 0;
    int e = 0;
    decompose(x, m, e);
    s = s + Big::of(m * m).shl(2 * e + 298);
  }
  return s;
}

float oracle_norm(const std::vector<float>& xs) { return round_sqrt(exact_sum(xs)); }

// ---- host tensors of any dtype ------------------------------------------------------

struct HostTensor {
  DType dtype = DType::f32;
  std::vector<float> f32;
  std::vector<std::uint16_t> h16;

  explicit HostTensor(DType t = DType::f32) : dtype(t) {}

  std::size_t numel() const { return dtype == DType::f32 ? f32.size() : h16.size(); }
  ConstTensorView view() const {
    if (dtype == DType::f32) return {f32.data(), f32.size(), dtype};
    return {h16.data(), h16.size(), dtype};
  }
  ConstTensorView slice(std::size_t begin, std::size_t n) const {
    if (dtype == DType::f32) return {f32.data() + begin, n, dtype};
    return {h16.data() + begin, n, dtype};
  }
  stepcore::TensorView mut_view() {
    if (dtype == DType::f32) return {f32.data(), f32.size(), dtype};
    return {h16.data(), h16.size(), dtype};
  }
  float value(std::size_t i) const {
    switch (dtype) {
      case DType::f32:
        return f32[i];
      case DType::bf16:
        return stepcore::bf16_bits_to_f32(h16[i]);
      case DType::f16:
        return stepcore::f16_bits_to_f32(h16[i]);
    }
    return NAN;
  }
  void push(float x) {
    switch (dtype) {
      case DType::f32:
        f32.push_back(x);
        break;
      case DType::bf16:
        h16.push_back(stepcore::f32_to_bf16_bits(x));
        break;
      case DType::f16:
        h16.push_back(stepcore::f32_to_f16_bits(x));
        break;
    }
  }
};

HostTensor f32_tensor(std::vector<float> xs) {
  HostTensor t;
  t.f32 = std::move(xs);
  return t;
}

std::vector<ConstTensorView> views(const std::vector<HostTensor>& ts) {
  std::vector<ConstTensorView> v;
  for (const HostTensor& t : ts) v.push_back(t.view());
  return v;
}

std::vector<float> values(const std::vector<HostTensor>& ts) {
  std::vector<float> v;
  for (const HostTensor& t : ts)
    for (std::size_t i = 0; i < t.numel(); ++i) v.push_back(t.value(i));
  return v;
}

NormResult norm_of(const std::vector<HostTensor>& ts, GradientRead read = {}) {
  const auto v = views(ts);
  return stepcore::finalize(ref::norm_partial(v, read));
}

float norm_of_f32(std::vector<float> xs) { return norm_of({f32_tensor(std::move(xs))}).norm; }

// A random value with a log-uniform magnitude in [10^lo, 10^hi] and a random sign.
float log_uniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> e(lo, hi);
  const double m = std::pow(10.0, e(rng));
  return static_cast<float>((rng() & 1) ? -m : m);
}

// Random finite f32 bits with a biased exponent field in [elo, ehi].
float random_f32(std::mt19937_64& rng, int elo, int ehi) {
  std::uniform_int_distribution<std::uint32_t> e(static_cast<std::uint32_t>(elo),
                                                 static_cast<std::uint32_t>(ehi));
  const auto r = static_cast<std::uint32_t>(rng());
  return from_bits((r & 0x807FFFFFu) | (e(rng) << 23));
}

// ---- (a) exactness against the oracle ----------------------------------------------

TEST(NormOracle, SelfCheck) {
  // The oracle on values whose norms are known exactly.
  EXPECT_EQ(bits(oracle_norm({3.0f, 4.0f})), bits(5.0f));
  EXPECT_EQ(bits(oracle_norm({})), 0u);
  EXPECT_EQ(bits(oracle_norm({1.0f, 1.0f})), bits(static_cast<float>(std::sqrt(2.0))));
  EXPECT_EQ(bits(oracle_norm({std::ldexp(1.0f, -149)})), 1u);
  // sqrt(2) * 2^-149 = 1.414 * 2^-149 rounds to the smallest subnormal.
  EXPECT_EQ(bits(oracle_norm({std::ldexp(1.0f, -149), std::ldexp(1.0f, -149)})), 1u);
  EXPECT_EQ(bits(oracle_norm({FLT_MAX, FLT_MAX})), bits(kInf));
  // Against sqrt in double (correctly rounded twice is fine here: 53 >= 2*24+2).
  std::mt19937_64 rng(1);
  for (int i = 0; i < 200; ++i) {
    const float a = random_f32(rng, 100, 150), b = random_f32(rng, 100, 150);
    const double exact2 =
        static_cast<double>(a) * a + static_cast<double>(b) * b;  // exact: close exponents
    if (std::fabs(std::log2(std::fabs(a)) - std::log2(std::fabs(b))) > 2) continue;
    EXPECT_EQ(bits(oracle_norm({a, b})), bits(static_cast<float>(std::sqrt(exact2))));
  }
}

TEST(NormExact, SingleElementNormIsItsMagnitude) {
  std::mt19937_64 rng(2);
  std::vector<float> xs = {FLT_MAX, -FLT_MAX, FLT_MIN, std::numeric_limits<float>::denorm_min(),
                           1.0f,    -0.5f};
  for (int i = 0; i < 3000; ++i) xs.push_back(random_f32(rng, 0, 254));
  for (float x : xs) ASSERT_EQ(bits(norm_of_f32({x})), bits(std::fabs(x))) << std::hex << bits(x);
}

TEST(NormExact, HandWorked) {
  EXPECT_EQ(bits(norm_of_f32({3.0f, 4.0f})), bits(5.0f));
  EXPECT_EQ(bits(norm_of_f32({-3.0f, 4.0f})), bits(5.0f));
  EXPECT_EQ(bits(norm_of_f32({3 * std::ldexp(1.0f, 125), 4 * std::ldexp(1.0f, 125)})),
            bits(5 * std::ldexp(1.0f, 125)));
  const float sub = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(bits(norm_of_f32({3 * sub, 4 * sub})), bits(5 * sub));
  EXPECT_EQ(bits(norm_of_f32({sub, sub, sub, sub})), bits(2 * sub));
  EXPECT_EQ(bits(norm_of_f32({sub, sub})), bits(sub));           // 1.414 * 2^-149 -> 2^-149
  EXPECT_EQ(bits(norm_of_f32({sub, sub, sub})), bits(2 * sub));  // 1.732 -> 2
  // FLT_MAX alone is finite; two of them overflow.
  EXPECT_EQ(bits(norm_of_f32({FLT_MAX})), bits(FLT_MAX));
  EXPECT_EQ(bits(norm_of_f32({FLT_MAX, FLT_MAX})), bits(kInf));
  {
    // An overflowing norm of finite values: +Inf, finite == false, no NaN/Inf counted.
    const NormResult r = norm_of({f32_tensor({FLT_MAX, -FLT_MAX})});
    EXPECT_EQ(bits(r.norm), bits(kInf));
    EXPECT_FALSE(r.finite);
    EXPECT_EQ(r.nan_count + r.inf_count, 0u);
    EXPECT_EQ(bits(r.max_abs), bits(FLT_MAX));
    EXPECT_TRUE(norm_of({f32_tensor({FLT_MAX})}).finite);
  }
  // The overflow threshold: the midpoint between FLT_MAX = (2^24-1) 2^104 and
  // 2^128 is m = 2^128 - 2^103; m^2 - FLT_MAX^2 = 2^232 - 3 * 2^206. Adding
  // y = 2^116 (y^2 = 2^232) passes the midpoint: ties or above go to Inf. Adding
  // y = 2^116 (1 - 2^-24) (y^2 = 2^232 - 2^209 + 2^184) stays below: FLT_MAX.
  EXPECT_EQ(bits(norm_of_f32({FLT_MAX, std::ldexp(1.0f, 116)})), bits(kInf));
  EXPECT_EQ(bits(norm_of_f32({FLT_MAX, std::nextafter(std::ldexp(1.0f, 116), 0.0f)})),
            bits(FLT_MAX));
  EXPECT_EQ(bits(norm_of_f32({FLT_MAX, 1.0f})), bits(FLT_MAX));
  // A norm just below FLT_MAX stays finite: {0.75, 1} * 2^127 gives exactly 1.25 * 2^127.
  EXPECT_EQ(bits(norm_of_f32({0.75f * std::ldexp(1.0f, 127), std::ldexp(1.0f, 127)})),
            bits(1.25f * std::ldexp(1.0f, 127)));
  // Empty lists, empty tensors, zeros of both signs: +0.
  EXPECT_EQ(bits(stepcore::finalize(ref::norm_partial({})).norm), 0u);
  EXPECT_EQ(bits(norm_of({HostTensor{}, HostTensor{DType::bf16}, HostTensor{DType::f16}}).norm),
            0u);
  const NormResult z = norm_of({f32_tensor({0.0f, -0.0f, -0.0f})});
  EXPECT_EQ(bits(z.norm), 0u);
  EXPECT_EQ(bits(z.max_abs), 0u);
  EXPECT_TRUE(z.finite);
}

TEST(NormExact, TiesRoundToEven) {
  // sum = (2^24 + 1)^2 = 2^48 + 2^25 + 1 from {2^24, 2^12, 2^12, 1}: the norm is
  // exactly 2^24 + 1, the midpoint between 2^24 (even significand) and 2^24 + 2.
  // sum = (2^24 + 3)^2 = 2^48 + 2^26 + 2^25 + 9 from {2^24, 2^13, 2^12, 2^12, 3}:
  // midpoint between 2^24 + 2 (odd significand) and 2^24 + 4 (even).
  // All scaled by 2^j over the whole range, incl. subnormal elements (j = -149).
  for (int j : {-149, -140, -100, -60, -24, -1, 0, 1, 30, 77, 103}) {
    const auto s = [j](double v) { return static_cast<float>(std::ldexp(v, j)); };
    const float lo = s(16777216.0), mid_even = s(16777218.0), up = s(16777220.0);
    const float tiny = std::numeric_limits<float>::denorm_min();
    SCOPED_TRACE(j);
    EXPECT_EQ(bits(norm_of_f32({s(16777216), s(4096), s(4096), s(1)})), bits(lo));
    EXPECT_EQ(bits(norm_of_f32({s(16777216), s(8192), s(4096), s(4096), s(3)})), bits(up));
    // A single extra unit of 2^-298 in S (the smallest subnormal) breaks the tie upwards.
    EXPECT_EQ(bits(norm_of_f32({s(16777216), s(4096), s(4096), s(1), tiny})), bits(mid_even));
    EXPECT_EQ(bits(norm_of_f32({tiny, s(16777216), s(8192), s(4096), s(4096), s(3)})), bits(up));
    // Slightly below the tie rounds down: drop the last square (1) or make it 4 instead of 9.
    EXPECT_EQ(bits(norm_of_f32({s(16777216), s(4096), s(4096)})), bits(lo));
    EXPECT_EQ(bits(norm_of_f32({s(16777216), s(8192), s(4096), s(4096), s(2)})), bits(mid_even));
    // The oracle agrees with the hand values.
    EXPECT_EQ(bits(oracle_norm({s(16777216), s(4096), s(4096), s(1)})), bits(lo));
    EXPECT_EQ(bits(oracle_norm({s(16777216), s(8192), s(4096), s(4096), s(3)})), bits(up));
  }
}

TEST(NormExact, RandomDataMatchesOracle) {
  std::mt19937_64 rng(3);
  struct Range {
    int elo, ehi;
  };
  // Biased exponent ranges: full range, subnormals only, tiny (result near the
  // subnormal/normal boundary), narrow (many near-ties), huge (overflow region).
  const Range ranges[] = {{0, 254},   {0, 0},     {0, 3},     {120, 121},
                          {126, 128}, {240, 254}, {252, 254}, {60, 90}};
  for (const Range& r : ranges) {
    for (int trial = 0; trial < 200; ++trial) {
      std::uniform_int_distribution<int> len(1, 300);
      std::vector<float> xs(static_cast<std::size_t>(len(rng)));
      for (float& x : xs) x = random_f32(rng, r.elo, r.ehi);
      const float want = oracle_norm(xs);
      const NormResult got = norm_of({f32_tensor(xs)});
      ASSERT_EQ(bits(got.norm), bits(want))
          << "range " << r.elo << ".." << r.ehi << " trial " << trial;
      float mx = 0.0f;
      for (float x : xs) mx = std::max(mx, std::fabs(x));
      ASSERT_EQ(bits(got.max_abs), bits(mx));
      // finite: no NaN/Inf input and the norm itself does not overflow.
      ASSERT_EQ(got.finite, std::isfinite(want));
      ASSERT_EQ(got.nan_count + got.inf_count, 0u);
    }
  }
  // Two or three equal elements: sqrt(2) x and sqrt(3) x, for all binades.
  for (int e = 0; e <= 254; ++e) {
    const float x = random_f32(rng, e, e);
    ASSERT_EQ(bits(norm_of_f32({x, -x})), bits(oracle_norm({x, x}))) << e;
    ASSERT_EQ(bits(norm_of_f32({x, x, x})), bits(oracle_norm({x, x, x}))) << e;
  }
}

TEST(NormExact, SquareUnitsIsExact) {
  std::mt19937_64 rng(4);
  for (int i = 0; i < 20000; ++i) {
    const float x = random_f32(rng, 0, 254);
    if (x == 0.0f) continue;
    std::uint64_t m2 = 0;
    int shift = 0;
    ref::testing::square_units(x, m2, shift);
    std::uint64_t m = 0;
    int e = 0;
    decompose(x, m, e);
    ASSERT_GE(shift, 0);
    ASSERT_EQ(cmp(Big::of(m2).shl(shift), Big::of(m * m).shl(2 * e + 298)), 0)
        << std::hex << bits(x);
  }
}

// ---- (b) invariance under partition, order and merge tree ----------------------------

std::vector<HostTensor> mixed_tensors(std::mt19937_64& rng, int count) {
  std::vector<HostTensor> ts;
  std::uniform_int_distribution<int> len(0, 400);
  for (int i = 0; i < count; ++i) {
    HostTensor t;
    t.dtype = static_cast<DType>(rng() % 3);
    const int n = (rng() % 5 == 0) ? 0 : len(rng);  // some empty tensors
    for (int k = 0; k < n; ++k) {
      // f16 holds 6e-8 .. 65504; the others 1e-30 .. 1e30. Some exact zeros.
      float x = t.dtype == DType::f16 ? log_uniform(rng, -7.5, 4.8) : log_uniform(rng, -30, 30);
      if (rng() % 50 == 0) x = (rng() & 1) ? 0.0f : -0.0f;
      t.push(x);
    }
    ts.push_back(std::move(t));
  }
  return ts;
}

// Merges the partials in a random tree: repeatedly two random ones.
NormPartial random_merge(std::vector<NormPartial> ps, std::mt19937_64& rng) {
  if (ps.empty()) return NormPartial{};
  while (ps.size() > 1) {
    std::uniform_int_distribution<std::size_t> pick(0, ps.size() - 1);
    const std::size_t a = pick(rng);
    std::size_t b = pick(rng);
    while (b == a) b = pick(rng);
    stepcore::merge(ps[a], ps[b]);
    ps.erase(ps.begin() + static_cast<std::ptrdiff_t>(b));
  }
  return ps[0];
}

TEST(NormInvariance, PartitionsOrdersAndMergeTrees) {
  std::mt19937_64 rng(5);
  const std::vector<HostTensor> ts = mixed_tensors(rng, 40);
  const NormPartial whole = ref::norm_partial(views(ts));
  const NormResult whole_r = stepcore::finalize(whole);
  ASSERT_EQ(bits(whole_r.norm), bits(oracle_norm(values(ts))));

  for (int trial = 0; trial < 60; ++trial) {
    // Cut every tensor at random points into pieces (views into the same buffers).
    std::vector<ConstTensorView> pieces;
    for (const HostTensor& t : ts) {
      std::size_t begin = 0;
      while (begin < t.numel()) {
        std::uniform_int_distribution<std::size_t> len(1, t.numel() - begin);
        const std::size_t n = (rng() % 4 == 0) ? 1 : len(rng);
        pieces.push_back(t.slice(begin, n));
        begin += n;
      }
      if (rng() % 3 == 0) pieces.push_back(t.slice(0, 0));  // empty pieces too
    }
    std::shuffle(pieces.begin(), pieces.end(), rng);
    // Deal them to shards, compute each separately, merge in a random tree.
    std::uniform_int_distribution<std::size_t> nshards_d(1, 16);
    const std::size_t nshards = nshards_d(rng);
    std::vector<std::vector<ConstTensorView>> shards(nshards);
    for (const ConstTensorView& p : pieces) shards[rng() % nshards].push_back(p);
    std::vector<NormPartial> partials;
    for (const auto& s : shards) partials.push_back(ref::norm_partial(s));
    const NormPartial merged = random_merge(partials, rng);
    ASSERT_TRUE(stepcore::same_value(merged, whole)) << "trial " << trial;
    const NormResult r = stepcore::finalize(merged);
    ASSERT_EQ(bits(r.norm), bits(whole_r.norm));
    ASSERT_EQ(bits(r.max_abs), bits(whole_r.max_abs));

    // The collective model: digit-wise integer sums of the raw digits, no carries
    // propagated, then finalize.
    NormPartial raw;
    for (const NormPartial& p : partials) {
      for (int k = 0; k < stepcore::kNormDigits; ++k) raw.digits[k] += p.digits[k];
      raw.max_abs_bits = std::max(raw.max_abs_bits, p.max_abs_bits);
    }
    ASSERT_TRUE(stepcore::same_value(raw, whole));
    ASSERT_EQ(bits(stepcore::finalize(raw).norm), bits(whole_r.norm));
  }
}

TEST(NormInvariance, ElementPermutationsAndTensorOrder) {
  std::mt19937_64 rng(6);
  std::vector<HostTensor> ts = mixed_tensors(rng, 25);
  const NormPartial whole = ref::norm_partial(views(ts));
  for (int trial = 0; trial < 20; ++trial) {
    for (HostTensor& t : ts) {
      std::shuffle(t.f32.begin(), t.f32.end(), rng);
      std::shuffle(t.h16.begin(), t.h16.end(), rng);
    }
    std::shuffle(ts.begin(), ts.end(), rng);
    const NormPartial p = ref::norm_partial(views(ts));
    ASSERT_TRUE(stepcore::same_value(p, whole));
    ASSERT_EQ(bits(stepcore::finalize(p).norm), bits(stepcore::finalize(whole).norm));
  }
}

TEST(NormInvariance, OnePartialPerElement) {
  std::mt19937_64 rng(7);
  const std::vector<HostTensor> ts = mixed_tensors(rng, 12);
  const NormPartial whole = ref::norm_partial(views(ts));
  std::vector<NormPartial> partials;
  for (const HostTensor& t : ts)
    for (std::size_t i = 0; i < t.numel(); ++i) {
      const ConstTensorView one = t.slice(i, 1);
      partials.push_back(ref::norm_partial({&one, 1}));
    }
  // Left fold, right fold and a random tree.
  NormPartial left;
  for (const NormPartial& p : partials) stepcore::merge(left, p);
  NormPartial right;
  for (std::size_t i = partials.size(); i-- > 0;) {
    NormPartial acc = partials[i];
    stepcore::merge(acc, right);
    right = acc;
  }
  EXPECT_TRUE(stepcore::same_value(left, whole));
  EXPECT_TRUE(stepcore::same_value(right, whole));
  EXPECT_TRUE(stepcore::same_value(random_merge(partials, rng), whole));
  // Merging an empty partial changes nothing.
  NormPartial e = whole;
  stepcore::merge(e, NormPartial{});
  EXPECT_TRUE(stepcore::same_value(e, whole));
  // same_value is not trivially true.
  NormPartial other = whole;
  other.digits[0] += 1;
  EXPECT_FALSE(stepcore::same_value(other, whole));
  other = whole;
  other.max_abs_bits ^= 1;
  EXPECT_FALSE(stepcore::same_value(other, whole));
}

// ---- (c) the 0.5 ulp bound against long double ---------------------------------------

TEST(NormBound, WithinHalfUlpOfLongDoubleSum) {
  // Correct rounding means |norm - exact| <= half the spacing of floats at the
  // exact value. The long-double sum of squares (64-bit significand, n <= 500)
  // has a relative error below 2^-54, far below half an f32 ulp (2^-24 relative),
  // so this is an independent check of the integer path up to that slack.
  std::mt19937_64 rng(8);
  for (int trial = 0; trial < 1500; ++trial) {
    std::uniform_int_distribution<int> len(1, 500);
    std::uniform_real_distribution<double> centre(-33.0,
                                                  33.0);  // values 1e-36 .. 1e36: norms stay finite
    const double c = centre(rng);
    std::vector<float> xs(static_cast<std::size_t>(len(rng)));
    for (float& x : xs) x = log_uniform(rng, c - 3, c + 3);
    long double sum = 0;
    for (float x : xs) sum += static_cast<long double>(x) * x;
    const long double exact = std::sqrt(sum);
    const float got = norm_of_f32(xs);
    ASSERT_TRUE(std::isfinite(got));
    const float toward = std::nextafter(got, exact > got ? kInf : 0.0f);
    const long double half_spacing = std::fabs(static_cast<long double>(toward) - got) / 2;
    const long double err = std::fabs(static_cast<long double>(got) - exact);
    ASSERT_LE(err, half_spacing + exact * 0x1p-50L) << "trial " << trial;
  }
}

// ---- (d) NaN and Inf ----------------------------------------------------------------

TEST(NormNonFinite, NaNAndInf) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  {
    const NormResult r = norm_of({f32_tensor({1.0f, nan, 2.0f})});
    EXPECT_TRUE(std::isnan(r.norm));
    EXPECT_TRUE(std::isnan(r.max_abs));
    EXPECT_FALSE(r.finite);
    EXPECT_EQ(r.nan_count, 1u);
    EXPECT_EQ(r.inf_count, 0u);
  }
  {
    const NormResult r = norm_of({f32_tensor({1.0f, -kInf, 3.0f})});
    EXPECT_EQ(bits(r.norm), bits(kInf));  // +Inf even for -Inf
    EXPECT_EQ(bits(r.max_abs), bits(kInf));
    EXPECT_FALSE(r.finite);
    EXPECT_EQ(r.nan_count, 0u);
    EXPECT_EQ(r.inf_count, 1u);
  }
  {
    // Both: NaN wins; counts add over tensors and dtypes.
    HostTensor b{DType::bf16}, h{DType::f16};
    b.h16 = {0x3F80, 0x7FC1, 0xFF81, 0xFF80};  // 1, NaN, NaN, -Inf
    h.h16 = {0x7C00, 0x3C00, 0xFE00};          // +Inf, 1, NaN
    const NormResult r = norm_of({f32_tensor({kInf, 2.0f}), b, h});
    EXPECT_TRUE(std::isnan(r.norm));
    EXPECT_FALSE(r.finite);
    EXPECT_EQ(r.nan_count, 3u);
    EXPECT_EQ(r.inf_count, 3u);
    const NormPartial p = ref::norm_partial(views({f32_tensor({kInf, 2.0f}), b, h}));
    EXPECT_EQ(p.max_abs_bits, bits(2.0f));  // max over the finite values
  }
  {
    // Finite data: finite, counts zero, max_abs = max |x| (sign dropped).
    const NormResult r = norm_of({f32_tensor({-7.5f, 3.0f, -0.0f}), f32_tensor({-8.0f})});
    EXPECT_TRUE(r.finite);
    EXPECT_EQ(bits(r.max_abs), bits(8.0f));
    EXPECT_EQ(r.nan_count + r.inf_count, 0u);
  }
}

// ---- (e) the scaled, clipped read ----------------------------------------------------

TEST(NormRead, EqualsNormOfEagerlyScaledCopy) {
  std::mt19937_64 rng(9);
  const std::vector<HostTensor> ts = mixed_tensors(rng, 20);
  const GradientRead reads[] = {{1.0f, 1.0f},      {0.5f, 1.0f},  {1.0f / 3.0f, 0.7f}, {3.0f, 0.1f},
                                {1e-20f, 0.9f},    {1e20f, 1.0f}, {1e-30f, 0.3f},      {2.0f, 0.0f},
                                {1000.0f, 0.999f}, {0.001f, 0.5f}};
  for (const GradientRead& rd : reads) {
    SCOPED_TRACE(testing::Message() << "scale " << rd.scale << " clip " << rd.clip);
    // Eager: scale in place, then clip in place, then read as is.
    std::vector<HostTensor> eager = ts;
    for (HostTensor& t : eager) {
      const stepcore::TensorView v = t.mut_view();
      ref::scale_({&v, 1}, rd.scale);
      ref::scale_({&v, 1}, rd.clip);
    }
    const NormPartial fused = ref::norm_partial(views(ts), rd);
    const NormPartial staged = ref::norm_partial(views(eager));
    ASSERT_TRUE(stepcore::same_value(fused, staged));
    // Independently: x = R_T(R_T(g * scale) * clip) element by element.
    std::vector<float> xs;
    bool finite = true;
    for (const HostTensor& t : ts)
      for (std::size_t i = 0; i < t.numel(); ++i) {
        HostTensor one{t.dtype};
        one.push(t.value(i) * rd.scale);
        HostTensor two{t.dtype};
        two.push(one.value(0) * rd.clip);
        const float x = two.value(0);
        if (!std::isfinite(x)) finite = false;
        xs.push_back(x);
      }
    const NormResult r = stepcore::finalize(fused);
    if (finite) {
      const float want = oracle_norm(xs);
      EXPECT_EQ(bits(r.norm), bits(want));
      EXPECT_EQ(r.finite, std::isfinite(want));
    } else {
      EXPECT_FALSE(r.finite);
    }
  }
}

TEST(NormRead, ScaleOverflowIsNonFinite) {
  HostTensor h{DType::f16}, b{DType::bf16};
  h.h16 = {0x7A00};  // 49152 * 2 overflows f16
  b.h16 = {0x7F00};  // 2^127 * 2 overflows bf16
  const HostTensor f = f32_tensor({FLT_MAX});
  for (const HostTensor& t : {h, b, f}) {
    const NormResult r = norm_of({t}, {2.0f, 1.0f});
    EXPECT_FALSE(r.finite);
    EXPECT_EQ(r.inf_count, 1u);
    EXPECT_EQ(bits(r.norm), bits(kInf));
    // The unscaled read is finite.
    EXPECT_TRUE(norm_of({t}).finite);
    // Overflow then clip 0 reads Inf * 0 = NaN, as the eager path would store.
    const NormResult z = norm_of({t}, {2.0f, 0.0f});
    EXPECT_EQ(z.nan_count, 1u);
    EXPECT_TRUE(std::isnan(z.norm));
  }
  // The read rounds twice. f16 g = 1, scale 1 + 2^-11: the product is the
  // midpoint between 1 and 1 + 2^-10 and ties to 1; times clip 1 - 2^-11 gives
  // 1 - 2^-11, exact in f16. One rounding of (1 + 2^-11)(1 - 2^-11) = 1 - 2^-22
  // would give 1. Same for bf16 with 2^-8.
  HostTensor h1{DType::f16}, b1{DType::bf16};
  h1.push(1.0f);
  b1.push(1.0f);
  EXPECT_EQ(bits(norm_of({h1}, {1.0f + 0x1p-11f, 1.0f - 0x1p-11f}).norm), bits(1.0f - 0x1p-11f));
  EXPECT_EQ(bits(norm_of({b1}, {1.0f + 0x1p-8f, 1.0f - 0x1p-8f}).norm), bits(1.0f - 0x1p-8f));
  // f32 reads round like f32 arithmetic: 1 * (1 + 2^-23) * (1 - 2^-23) = 1 - 2^-46 -> 1.
  EXPECT_EQ(bits(norm_of({f32_tensor({1.0f})}, {1.0f + 0x1p-23f, 1.0f - 0x1p-23f}).norm),
            bits(1.0f));
}

// ---- approximate partials: certified rounding or the exact fallback ------------------

Big big_of_digits(const std::uint64_t (&d)[stepcore::kNormDigits]) {
  std::uint64_t n[stepcore::kNormDigits];
  std::memcpy(n, d, sizeof n);
  stepcore::detail::normalize_digits(n);
  Big b;
  for (int k = 0; k < stepcore::kNormDigits; ++k)
    b.limb.push_back(static_cast<std::uint32_t>(n[k]));
  b.trim();
  return b;
}

NormPartial partial_of(const Big& s, bool approximate) {
  NormPartial p;
  EXPECT_LE(s.limb.size(), static_cast<std::size_t>(stepcore::kNormDigits));
  for (std::size_t k = 0; k < s.limb.size(); ++k) p.digits[k] = s.limb[k];
  p.approximate = approximate ? 1 : 0;
  return p;
}

TEST(NormApproximate, DigitsRoundTripThroughTheOracle) {
  // The reference's digits are the oracle's S (ties the two representations).
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> xs(100);
    for (float& x : xs) x = random_f32(rng, 0, 254);
    const NormPartial p = ref::norm_partial(views({f32_tensor(xs)}));
    EXPECT_EQ(p.approximate, 0u);
    ASSERT_EQ(cmp(big_of_digits(p.digits), exact_sum(xs)), 0);
  }
}

TEST(NormApproximate, CertifiedResultsAreTheExactRounding) {
  // S' = S +- floor(S / 2^41) is within the 2^-40 bound of S. Marked approximate,
  // finalize must either give RN(sqrt(S)) or ask for the exact pass.
  std::mt19937_64 rng(13);
  int certified = 0, fallbacks = 0;
  for (int trial = 0; trial < 400; ++trial) {
    std::vector<float> xs(1 + rng() % 50);
    const int e = static_cast<int>(1 + rng() % 250);
    for (float& x : xs) x = random_f32(rng, std::max(e - 4, 0), std::min(e + 4, 254));
    const Big s = exact_sum(xs);
    const float want = round_sqrt(s);
    for (int sign : {-1, 0, 1}) {
      Big sp = s;
      if (sign > 0) sp = s + s.shr(41);
      if (sign < 0) sp = s - s.shr(41);
      const NormResult r = stepcore::finalize(partial_of(sp, true));
      if (r.needs_exact) {
        ++fallbacks;
        EXPECT_TRUE(std::isnan(r.norm));
        EXPECT_FALSE(r.finite);
      } else {
        ++certified;
        ASSERT_EQ(bits(r.norm), bits(want)) << "trial " << trial << " sign " << sign;
        EXPECT_EQ(r.finite, std::isfinite(want));
      }
    }
  }
  // Fallbacks are rare for random data (about 2^-16 of norms).
  EXPECT_GT(certified, 1150);
  EXPECT_LE(fallbacks, 50);
}

TEST(NormApproximate, TiesAlwaysFallBack) {
  for (int j : {-149, -20, 0, 50, 103}) {
    const auto s = [j](double v) { return static_cast<float>(std::ldexp(v, j)); };
    const std::vector<float> tie = {s(16777216), s(4096), s(4096), s(1)};
    NormPartial p = ref::norm_partial(views({f32_tensor(tie)}));
    EXPECT_FALSE(stepcore::finalize(p).needs_exact);
    p.approximate = 1;
    const NormResult r = stepcore::finalize(p);
    EXPECT_TRUE(r.needs_exact) << j;
    EXPECT_TRUE(std::isnan(r.norm));
    // Merging with an approximate partial makes the result approximate.
    NormPartial exact = ref::norm_partial(views({f32_tensor(tie)}));
    stepcore::merge(exact, p);
    EXPECT_NE(exact.approximate, 0u);
  }
}

TEST(NormApproximate, DepositDoubleIsExact) {
  // Any binary64 sum of squares of binary32 values is a multiple of 2^-298;
  // deposit_double must add exactly that value.
  std::mt19937_64 rng(14);
  for (int trial = 0; trial < 3000; ++trial) {
    const int e = static_cast<int>(rng() % 255);
    double sum = 0.0;
    std::vector<float> xs(1 + rng() % 8);
    for (float& x : xs) {
      x = random_f32(rng, std::max(e - 20, 0), std::min(e + 20, 254));
      sum += static_cast<double>(x) * x;
    }
    if (sum == 0.0) continue;
    NormPartial p;
    stepcore::detail::deposit_double(p.digits, sum);
    // The oracle: sum = f * 2^ex exactly with a 53-bit integer f.
    int ex = 0;
    const double f = std::frexp(sum, &ex);
    auto m = static_cast<std::uint64_t>(std::ldexp(f, 53));
    int sh = ex - 53 + 298;
    while (sh < 0) {
      ASSERT_EQ(m % 2, 0u) << "not a multiple of 2^-298";
      m /= 2;
      ++sh;
    }
    ASSERT_EQ(cmp(big_of_digits(p.digits), Big::of(m).shl(sh)), 0) << "trial " << trial;
  }
}

// ---- (f) clip_coefficient -------------------------------------------------------------

// torch's min(1, max / (norm + 1e-6)) on an f32 tensor: denom = norm + 1e-6f,
// recip = 1 / denom, q = recip * max, each one f32 rounding (docs 6.5). Double
// evaluates each op and rounds to f32 correctly (53 >= 2*24 + 2), so this is an
// independent expectation.
float expected_clip(float norm, float max_norm) {
  const auto denom = static_cast<float>(static_cast<double>(norm) + static_cast<double>(1e-6f));
  const auto recip = static_cast<float>(1.0 / static_cast<double>(denom));
  const auto q = static_cast<float>(static_cast<double>(recip) * static_cast<double>(max_norm));
  if (std::isnan(q)) return q;
  return q < 1.0f ? q : 1.0f;
}

// ---- partials beyond the documented range: exact, or flagged ---------------------

// S of raw (unnormalised) 64-bit digits, summed here without stepcore's carry code.
Big big_of_raw_digits(const std::uint64_t (&d)[stepcore::kNormDigits]) {
  Big s;
  for (int k = 0; k < stepcore::kNormDigits; ++k) s = s + Big::of(d[k]).shl(32 * k);
  return s;
}

TEST(NormRange, DigitsAt2To64AreSummedExactly) {
  // The two low digits at 2^64 - 1 (more than 2^32 partials summed): once 2^-117 with
  // finite = true, the true norm being about 2^-101.
  NormPartial p;
  p.digits[0] = p.digits[1] = ~std::uint64_t{0};
  const NormResult r = stepcore::finalize(p);
  EXPECT_TRUE(r.finite);
  EXPECT_EQ(bits(r.norm), bits(round_sqrt(big_of_raw_digits(p.digits))));
  EXPECT_NEAR(std::log2(r.norm), -101.0, 0.01);
  // Random raw digits anywhere below the top: finalize and merge agree with the oracle.
  std::mt19937_64 rng(18);
  for (int i = 0; i < 300; ++i) {
    NormPartial a, b;
    const int top = static_cast<int>(rng() % (stepcore::kNormDigits - 1));
    for (int k = 0; k <= top; ++k) {
      a.digits[k] = rng() >> (rng() % 64);
      b.digits[k] = rng() >> (rng() % 64);
    }
    const Big sa = big_of_raw_digits(a.digits), sb = big_of_raw_digits(b.digits);
    ASSERT_EQ(bits(stepcore::finalize(a).norm), bits(round_sqrt(sa))) << i;
    stepcore::merge(a, b);
    ASSERT_EQ(bits(stepcore::finalize(a).norm), bits(round_sqrt(sa + sb))) << i;
  }
}

TEST(NormRange, ValuesBeyond640BitsAreInfinite) {
  NormPartial p;
  p.digits[stepcore::kNormDigits - 1] = std::uint64_t{1} << 33;  // S = 2^641
  NormResult r = stepcore::finalize(p);
  EXPECT_EQ(bits(r.norm), bits(kInf));
  EXPECT_FALSE(r.finite);
  NormPartial a, b;
  for (auto& d : a.digits) d = ~std::uint64_t{0};
  for (auto& d : b.digits) d = ~std::uint64_t{0};
  stepcore::merge(a, b);  // saturates: still +Inf, never a wrapped small value
  r = stepcore::finalize(a);
  EXPECT_EQ(bits(r.norm), bits(kInf));
  EXPECT_FALSE(r.finite);
}

TEST(NormRange, AMaxAbsThatNoFiniteValueGivesIsFlagged) {
  // NaN, Inf or negative max-abs records with no NaN/Inf counted: once max_abs NaN with
  // finite = true.
  for (std::uint32_t m : {0x7FC00000u, 0x7FC00001u, 0x7F800000u, 0x80000001u, 0xFFFFFFFFu}) {
    NormPartial p;
    p.digits[9] = 1;
    p.max_abs_bits = m;
    const NormResult r = stepcore::finalize(p);
    EXPECT_FALSE(r.finite) << std::hex << m;
    EXPECT_TRUE(std::isnan(r.norm)) << std::hex << m;
    EXPECT_TRUE(std::isnan(r.max_abs)) << std::hex << m;
  }
  NormPartial ok;
  ok.digits[9] = 1;
  ok.max_abs_bits = 0x7F7FFFFFu;  // FLT_MAX: a finite record stays as it is
  EXPECT_TRUE(stepcore::finalize(ok).finite);
}

TEST(ClipCoefficient, HandWorked) {
  using stepcore::clip_coefficient;
  // norm 0: max / 1e-6f = 1e6 -> 1.
  EXPECT_EQ(bits(clip_coefficient(0.0f, 1.0f)), bits(1.0f));
  EXPECT_EQ(bits(clip_coefficient(0.0f, 0.0f)), bits(0.0f));
  // norm 1, max 1: 1 + 1e-6f = 1 + 8.39 * 2^-23 rounds to 1 + 2^-20;
  // 1 / (1 + 2^-20) = 1 - 2^-20 + 2^-40 - ... rounds to 1 - 2^-20 = 0x3F7FFFF0; times 1.
  EXPECT_EQ(bits(clip_coefficient(1.0f, 1.0f)), 0x3F7FFFF0u);
  // norm 2, max 1: a bit below 0.5.
  EXPECT_LT(clip_coefficient(2.0f, 1.0f), 0.5f);
  EXPECT_EQ(bits(clip_coefficient(2.0f, 1.0f)), bits(expected_clip(2.0f, 1.0f)));
  // norm far below max: exactly 1.
  EXPECT_EQ(bits(clip_coefficient(0.5f, 1.0f)), bits(1.0f));
  // NaN propagates, Inf gives +0.
  EXPECT_TRUE(std::isnan(clip_coefficient(std::numeric_limits<float>::quiet_NaN(), 1.0f)));
  EXPECT_EQ(bits(clip_coefficient(kInf, 1.0f)), 0u);
  // A huge finite norm: tiny coefficient, not 0.
  EXPECT_GT(clip_coefficient(1e30f, 1.0f), 0.0f);
}

TEST(ClipCoefficient, ReciprocalThenMultiplyNotOneDivision) {
  // Find inputs where RN(max / denom) != RN(RN(1 / denom) * max): the coefficient
  // must be the latter (torch's Tensor.__rtruediv__).
  std::mt19937_64 rng(11);
  int found = 0;
  for (int i = 0; i < 100000 && found < 50; ++i) {
    const float norm = std::fabs(log_uniform(rng, -1, 3));
    const float mx = std::fabs(log_uniform(rng, -1, 1));
    const auto denom = static_cast<float>(static_cast<double>(norm) + static_cast<double>(1e-6f));
    const auto one_div = static_cast<float>(static_cast<double>(mx) / static_cast<double>(denom));
    const float want = expected_clip(norm, mx);
    if (one_div >= 1.0f || bits(one_div) == bits(want)) continue;
    ++found;
    ASSERT_EQ(bits(stepcore::clip_coefficient(norm, mx)), bits(want)) << norm << " " << mx;
  }
  EXPECT_EQ(found, 50);
}

TEST(ClipCoefficient, NeverAboveOneAndMatchesDouble) {
  std::mt19937_64 rng(10);
  for (int i = 0; i < 200000; ++i) {
    const float norm = std::fabs(log_uniform(rng, -12, 12));
    const float mx = std::fabs(log_uniform(rng, -12, 12));
    const float c = stepcore::clip_coefficient(norm, mx);
    ASSERT_LE(c, 1.0f);
    ASSERT_GE(c, 0.0f);
    ASSERT_EQ(bits(c), bits(expected_clip(norm, mx))) << norm << " " << mx;
  }
}

}  // namespace
