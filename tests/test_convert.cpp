// Unit: the bf16/f16 <-> f32 conversions of stepcore/convert.hpp against
// independent expectations: every 16-bit pattern, hand-worked bit patterns, and
// large f32 sweeps rounded by choosing the nearest candidate by exact distance.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "stepcore/convert.hpp"

namespace {

using stepcore::bf16_bits_to_f32;
using stepcore::f16_bits_to_f32;
using stepcore::f32_to_bf16_bits;
using stepcore::f32_to_f16_bits;

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

// The value of a non-negative finite binary16 pattern, computed from its fields
// (independent of the library): subnormal frac * 2^-24, normal (1024 + frac) * 2^(e - 25).
double f16_value(std::uint16_t h) {
  const int e = (h >> 10) & 0x1F;
  const int f = h & 0x3FF;
  const double mag = e == 0 ? std::ldexp(f, -24) : std::ldexp(1024 + f, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

// The value of a non-negative finite bfloat16 pattern from its fields.
double bf16_value(std::uint16_t h) {
  const int e = (h >> 7) & 0xFF;
  const int f = h & 0x7F;
  const double mag = e == 0 ? std::ldexp(f, -133) : std::ldexp(128 + f, e - 134);
  return (h & 0x8000) ? -mag : mag;
}

// Ascending values of the non-negative patterns 0 .. inf_bits, where the Inf
// pattern stands for the next value of an unbounded exponent range (65536 for
// f16, 2^128 for bf16): IEEE rounding decides overflow with that value, and its
// pattern (0x7C00 / 0x7F80) is even, as ties-to-even needs. Patterns are
// ordered like their values, so neighbours in the table differ by one pattern.
struct Grid {
  std::vector<double> value;  // value[k] = value of pattern k
};

Grid make_f16_grid() {
  Grid g;
  for (std::uint32_t h = 0; h < 0x7C00; ++h)
    g.value.push_back(f16_value(static_cast<std::uint16_t>(h)));
  g.value.push_back(65536.0);
  return g;
}

Grid make_bf16_grid() {
  Grid g;
  for (std::uint32_t h = 0; h < 0x7F80; ++h)
    g.value.push_back(bf16_value(static_cast<std::uint16_t>(h)));
  g.value.push_back(std::ldexp(1.0, 128));
  return g;
}

// Expected rounding of f32 x onto the grid: the nearest of the two neighbouring
// patterns, ties to the even pattern. Distances are differences of an f32 and a
// grid value that sit in the same or adjacent binades (or a zero), so they need
// at most ~35 significant bits and double computes them exactly.
// A NaN gives nan_bits (both formats drop its sign and payload).
std::uint16_t expected_round(const Grid& g, float x, std::uint16_t inf_bits,
                             std::uint16_t nan_bits) {
  const std::uint32_t u = bits(x);
  const std::uint16_t sign = (u & 0x80000000u) ? 0x8000 : 0;
  if (std::isnan(x)) return nan_bits;
  if (std::isinf(x)) return sign | inf_bits;
  const double a = std::fabs(static_cast<double>(x));
  // lo = largest k with value[k] <= a.
  const auto it = std::upper_bound(g.value.begin(), g.value.end(), a);
  if (it == g.value.end()) return sign | inf_bits;  // beyond the overflow value
  const std::size_t hi = static_cast<std::size_t>(it - g.value.begin());
  const std::size_t lo = hi - 1;
  const double dlo = a - g.value[lo];
  const double dhi = g.value[hi] - a;
  std::size_t k;
  if (dlo < dhi)
    k = lo;
  else if (dhi < dlo)
    k = hi;
  else
    k = (lo % 2 == 0) ? lo : hi;
  return sign | static_cast<std::uint16_t>(k);
}

const Grid& f16_grid() {
  static const Grid g = make_f16_grid();
  return g;
}
const Grid& bf16_grid() {
  static const Grid g = make_bf16_grid();
  return g;
}

std::uint16_t expect_f16(float x) { return expected_round(f16_grid(), x, 0x7C00, 0x7E00); }
std::uint16_t expect_bf16(float x) { return expected_round(bf16_grid(), x, 0x7F80, 0x7FC0); }

// ---- widening and round trips over all 65,536 patterns --------------------------------

TEST(ConvertBf16, WideningIsExactForAllPatterns) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_bits_to_f32(static_cast<std::uint16_t>(h));
    // The pattern itself, NaN payloads and signs included.
    ASSERT_EQ(bits(f), h << 16) << std::hex << h;
    const int e = (h >> 7) & 0xFF;
    if (e == 0xFF) {
      if ((h & 0x7F) == 0)
        ASSERT_TRUE(std::isinf(f)) << std::hex << h;
      else
        ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), bf16_value(static_cast<std::uint16_t>(h))) << std::hex << h;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
  }
}

TEST(ConvertBf16, RoundTripForAllNonNanPatterns) {
  int nans = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_bits_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      ++nans;
      // Narrowing any NaN gives the canonical quiet NaN, sign dropped.
      ASSERT_EQ(f32_to_bf16_bits(f), 0x7FC0) << std::hex << h;
      continue;
    }
    ASSERT_EQ(f32_to_bf16_bits(f), h) << std::hex << h;
  }
  EXPECT_EQ(nans, 2 * 127);  // 2 signs x 127 non-zero fractions
}

TEST(ConvertF16, WideningIsExactForAllPatterns) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto h16 = static_cast<std::uint16_t>(h);
    const float f = f16_bits_to_f32(h16);
    const int e = (h >> 10) & 0x1F;
    const std::uint32_t frac = h & 0x3FF;
    const std::uint32_t sign = (h & 0x8000u) << 16;
    if (e == 0x1F) {
      // Inf or NaN: exponent all ones, fraction moved to the top of f32's, sign kept.
      ASSERT_EQ(bits(f), sign | 0x7F800000u | (frac << 13)) << std::hex << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), f16_value(h16)) << std::hex << h;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
  }
}

TEST(ConvertF16, RoundTripForAllNonNanPatterns) {
  int nans = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_bits_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      ++nans;
      // Narrowing a NaN gives the positive quiet NaN, whatever its sign.
      ASSERT_EQ(f32_to_f16_bits(f), 0x7E00u) << std::hex << h;
      continue;
    }
    ASSERT_EQ(f32_to_f16_bits(f), h) << std::hex << h;
  }
  EXPECT_EQ(nans, 2 * 1023);
}

// ---- hand-worked cases ----------------------------------------------------------------

TEST(ConvertBf16, HandWorkedCases) {
  struct Case {
    std::uint32_t in;
    std::uint16_t out;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80},  // 1.0
      {0x3F808000u, 0x3F80},  // 1 + 2^-8: halfway between 0x3F80 and 0x3F81 -> even 0x3F80
      {0x3F818000u, 0x3F82},  // 1 + 3*2^-8: halfway between 0x3F81 and 0x3F82 -> even 0x3F82
      {0x3F808001u, 0x3F81},  // just above the first halfway point
      {0x3F807FFFu, 0x3F80},  // just below it
      {0x3DCCCCCDu, 0x3DCD},  // 0.1f: low half 0xCCCD > 0x8000 rounds up
      {0xBF808000u, 0xBF80},  // -(1 + 2^-8): ties to even, sign kept
      {0x00000000u, 0x0000},  // +0
      {0x80000000u, 0x8000},  // -0
      {0x00000001u, 0x0000},  // smallest f32 subnormal rounds to +0
      {0x80000001u, 0x8000},  // ... and its negative to -0
      {0x00008000u, 0x0000},  // tie between 0 and the smallest bf16 subnormal -> 0 (even)
      {0x00008001u, 0x0001}, {0x00018000u, 0x0002},  // tie between 0x0001 and 0x0002 -> 0x0002
      {0x007FFFFFu, 0x0080},  // largest f32 subnormal rounds up to the smallest normal
      {0x7F7F7FFFu, 0x7F7F},  // below the midpoint between bf16 max and 2^128
      {0x7F7F8000u, 0x7F80},  // the midpoint: 0x7F7F is odd, so ties go up: Inf
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX overflows to Inf
      {0xFF7FFFFFu, 0xFF80},  // -FLT_MAX -> -Inf
      {0x7F800000u, 0x7F80},  // +Inf
      {0xFF800000u, 0xFF80},  // -Inf
      {0x7FC00000u, 0x7FC0},  // quiet NaN
      {0xFFC00000u, 0x7FC0},  // negative NaN: sign dropped
      {0x7F800001u, 0x7FC0},  // signalling NaN whose truncation would read as Inf
      {0x7F810000u, 0x7FC0},  // NaN with a payload in the kept bits
      {0xFFFFFFFFu, 0x7FC0},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(f32_to_bf16_bits(from_bits(c.in)), c.out) << std::hex << c.in;
    EXPECT_EQ(expect_bf16(from_bits(c.in)), c.out)
        << "oracle disagrees with hand value " << std::hex << c.in;
  }
}

TEST(ConvertF16, HandWorkedCases) {
  struct Case {
    float in;
    std::uint16_t out;
  };
  const float two_m25 = std::ldexp(1.0f, -25);
  const Case cases[] = {
      {1.0f, 0x3C00},
      {1.0f + std::ldexp(1.0f, -11), 0x3C00},      // tie -> even
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3C02},  // tie -> even
      {std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f), 0x3C01},
      {0.1f, 0x2E66},
      {-2.0f, 0xC000},
      {65504.0f, 0x7BFF},                        // largest finite
      {std::nextafter(65520.0f, 0.0f), 0x7BFF},  // 65519.996: still finite
      {65520.0f, 0x7C00},                        // midpoint to 65536: ties to even -> Inf
      {-65520.0f, 0xFC00},
      {65536.0f, 0x7C00},
      {std::numeric_limits<float>::max(), 0x7C00},
      {std::ldexp(1.0f, -14), 0x0400},                // smallest normal
      {std::ldexp(1.0f, -14) - two_m25, 0x0400},      // tie between 0x03FF and 0x0400 -> 0x0400
      {std::ldexp(1.0f, -14) - 3 * two_m25, 0x03FE},  // tie between 0x03FE and 0x03FF -> 0x03FE
      {std::ldexp(1.0f, -24), 0x0001},                // smallest subnormal
      {two_m25, 0x0000},                              // tie between 0 and 0x0001 -> 0
      {-two_m25, 0x8000},
      {std::nextafter(two_m25, 1.0f), 0x0001},  // 2^-25 + tiny -> 0x0001
      {std::nextafter(two_m25, 0.0f), 0x0000},
      {3 * two_m25, 0x0002},  // tie between 1 and 2 -> 2
      {5 * two_m25, 0x0002},  // tie between 2 and 3 -> 2
      {std::ldexp(1.0f, -26), 0x0000},
      {std::numeric_limits<float>::denorm_min(), 0x0000},
      {-std::numeric_limits<float>::denorm_min(), 0x8000},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {std::numeric_limits<float>::infinity(), 0x7C00},
      {-std::numeric_limits<float>::infinity(), 0xFC00},
      {from_bits(0x7FC00000u), 0x7E00},
      {from_bits(0xFFC00000u), 0x7E00},  // sign dropped
      {from_bits(0x7F800001u), 0x7E00},  // signalling NaN, payload only in low bits
      {from_bits(0xFF812345u), 0x7E00},
      {from_bits(0x7FFFFFFFu), 0x7E00},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(f32_to_f16_bits(c.in), c.out) << std::hex << bits(c.in);
    EXPECT_EQ(expect_f16(c.in), c.out)
        << "oracle disagrees with hand value " << std::hex << bits(c.in);
  }
}

TEST(ConvertWidening, HandWorkedCases) {
  EXPECT_EQ(bits(bf16_bits_to_f32(0x3F80)), 0x3F800000u);
  EXPECT_EQ(bits(bf16_bits_to_f32(0x7FC1)), 0x7FC10000u);  // NaN payload kept
  EXPECT_EQ(bits(bf16_bits_to_f32(0xFF81)), 0xFF810000u);  // signalling NaN, sign kept
  EXPECT_EQ(bits(bf16_bits_to_f32(0x0001)), 0x00010000u);  // subnormal
  EXPECT_EQ(bits(f16_bits_to_f32(0x3C00)), 0x3F800000u);
  EXPECT_EQ(bits(f16_bits_to_f32(0x0001)), 0x33800000u);  // 2^-24
  EXPECT_EQ(bits(f16_bits_to_f32(0x03FF)), bits(1023.0f * std::ldexp(1.0f, -24)));
  EXPECT_EQ(bits(f16_bits_to_f32(0x8000)), 0x80000000u);
  EXPECT_EQ(bits(f16_bits_to_f32(0x7BFF)), bits(65504.0f));
  EXPECT_EQ(bits(f16_bits_to_f32(0x7C00)), 0x7F800000u);
  EXPECT_EQ(bits(f16_bits_to_f32(0xFC00)), 0xFF800000u);
  EXPECT_EQ(bits(f16_bits_to_f32(0x7E01)), 0x7FC02000u);  // payload moved up 13 bits
  EXPECT_EQ(bits(f16_bits_to_f32(0xFC01)), 0xFF802000u);  // signalling NaN kept as is
}

// ---- the storage-type templates (to_f32, from_f32, round_to) -------------------------

// Against the independent expectations of this file, not against the bit functions
// they wrap: the widening of every 16-bit pattern from its fields, narrowing by the
// nearest-candidate oracle, and the f32 identity.
// Inf and NaN keep sign and payload: bf16's bits are the top half of the f32's, f16's
// fraction moves up 13 bits. Finite patterns: the value of the fields, exact in f32
// (8 or 11 significant bits, exponents well inside f32's range), signed zeros included.
float expected_widening_bf16(std::uint16_t h) {
  if (((h >> 7) & 0xFF) == 0xFF) return from_bits(std::uint32_t{h} << 16);
  return static_cast<float>(bf16_value(h));
}

float expected_widening_f16(std::uint16_t h) {
  if (((h >> 10) & 0x1F) == 0x1F)
    return from_bits((std::uint32_t{h} & 0x8000u) << 16 | 0x7F800000u | (h & 0x3FFu) << 13);
  return static_cast<float>(f16_value(h));
}

TEST(ConvertTemplates, WidenEveryPatternAsItsFieldsSay) {
  using stepcore::bfloat16_t;
  using stepcore::float16_t;
  for (std::uint32_t u = 0; u < 65536; ++u) {
    const auto h = static_cast<std::uint16_t>(u);
    ASSERT_EQ(bits(stepcore::to_f32(bfloat16_t{h})), bits(expected_widening_bf16(h)))
        << std::hex << h;
    ASSERT_EQ(bits(stepcore::to_f32(float16_t{h})), bits(expected_widening_f16(h)))
        << std::hex << h;
  }
  // The expectation itself, on known values: 1.0, -0, pi's bf16 and f16 roundings, NaN.
  EXPECT_EQ(bits(expected_widening_f16(0x3C00)), 0x3F800000u);
  EXPECT_EQ(bits(expected_widening_f16(0x8000)), 0x80000000u);
  EXPECT_EQ(expected_widening_f16(0x4248), 3.140625f);
  EXPECT_EQ(bits(expected_widening_bf16(0xC049)), 0xC0490000u);  // -3.140625
  EXPECT_EQ(bits(expected_widening_bf16(0xFFC1)), 0xFFC10000u);
}

TEST(ConvertTemplates, NarrowAndRoundAsTheOracleSays) {
  using stepcore::bfloat16_t;
  using stepcore::float16_t;
  std::vector<float> inputs;
  for (std::uint32_t u = 0; u < 65536; ++u) {  // every widened pattern, and its neighbours
    const float b = from_bits(u << 16);
    for (float x : {b, std::nextafter(b, 0.0f), std::nextafter(b, INFINITY)}) inputs.push_back(x);
    const float f = expected_widening_f16(static_cast<std::uint16_t>(u));
    for (float x : {f, std::nextafter(f, 0.0f), std::nextafter(f, INFINITY)}) inputs.push_back(x);
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 100000; ++i) inputs.push_back(from_bits(rng()));
  for (const float x : inputs) {
    const std::uint16_t b = expect_bf16(x), f = expect_f16(x);
    ASSERT_EQ(stepcore::from_f32<bfloat16_t>(x).bits, b) << std::hex << bits(x);
    ASSERT_EQ(stepcore::from_f32<float16_t>(x).bits, f) << std::hex << bits(x);
    ASSERT_EQ(bits(stepcore::from_f32<float>(x)), bits(x));
    ASSERT_EQ(bits(stepcore::to_f32(x)), bits(x));
    ASSERT_EQ(bits(stepcore::round_to<float>(x)), bits(x));
    if (std::isnan(x)) continue;  // R_T of a NaN is a NaN; its pattern is checked above
    ASSERT_EQ(bits(stepcore::round_to<bfloat16_t>(x)), bits(expected_widening_bf16(b)))
        << std::hex << bits(x);
    ASSERT_EQ(bits(stepcore::round_to<float16_t>(x)), bits(expected_widening_f16(f)))
        << std::hex << bits(x);
  }
}

// ---- sweeps against the nearest-candidate oracle ------------------------------------

// Checks one input for both directions, reporting the first few mismatches.
struct SweepChecker {
  int f16_failures = 0;
  int bf16_failures = 0;
  std::size_t checked = 0;
  void f16(float x) {
    ++checked;
    const std::uint16_t want = expect_f16(x);
    const std::uint16_t got = f32_to_f16_bits(x);
    if (got != want && ++f16_failures <= 10)
      ADD_FAILURE() << "f16(" << std::hex << bits(x) << ") = " << got << ", want " << want;
  }
  void bf16(float x) {
    ++checked;
    const std::uint16_t want = expect_bf16(x);
    const std::uint16_t got = f32_to_bf16_bits(x);
    if (got != want && ++bf16_failures <= 10)
      ADD_FAILURE() << "bf16(" << std::hex << bits(x) << ") = " << got << ", want " << want;
  }
  void both_signs_f16(float x) {
    f16(x);
    f16(-x);
  }
  void both_signs_bf16(float x) {
    bf16(x);
    bf16(-x);
  }
};

TEST(ConvertF16, StridedSweepOfRelevantRange) {
  // Every 37th f32 from 2^-26 to 2^17: covers zero results, subnormals, normals
  // and overflow, with all low-bit residues mod 37 hit across binades.
  SweepChecker c;
  for (std::uint32_t u = 0x32800000u; u <= 0x48000000u; u += 37) c.both_signs_f16(from_bits(u));
  EXPECT_GT(c.checked, 18'000'000u);
}

TEST(ConvertF16, HalfwayPointsAndNeighbours) {
  SweepChecker c;
  const Grid& g = f16_grid();
  for (std::size_t k = 0; k + 1 < g.value.size(); ++k) {
    // Each grid value and the exact midpoint to the next one are f32 values
    // (they need at most 12 significant bits).
    const auto v = static_cast<float>(g.value[k]);
    const auto mid = static_cast<float>((g.value[k] + g.value[k + 1]) / 2);
    ASSERT_EQ(static_cast<double>(mid), (g.value[k] + g.value[k + 1]) / 2);
    for (float x : {v, mid}) {
      float lo = x, hi = x;
      c.both_signs_f16(x);
      for (int j = 0; j < 3; ++j) {
        lo = std::nextafter(lo, 0.0f);
        hi = std::nextafter(hi, INFINITY);
        c.both_signs_f16(lo);
        c.both_signs_f16(hi);
      }
    }
  }
  // Overflow threshold and specials.
  for (float x : {65504.0f, 65519.0f, std::nextafter(65520.0f, 0.0f), 65520.0f,
                  std::nextafter(65520.0f, INFINITY), 65536.0f, 1e10f,
                  std::numeric_limits<float>::max(), 0.0f, std::numeric_limits<float>::infinity()})
    c.both_signs_f16(x);
  // f32 subnormals all round to zero.
  for (std::uint32_t u = 1; u < 0x00800000u; u += 4099) c.both_signs_f16(from_bits(u));
}

TEST(ConvertF16, NaNsWithVariousPayloads) {
  std::mt19937 rng(3);
  for (int i = 0; i < 20000; ++i) {
    std::uint32_t payload = rng() & 0x7FFFFFu;
    if (payload == 0) payload = 1;
    for (std::uint32_t sign : {0u, 0x80000000u}) {
      const float x = from_bits(sign | 0x7F800000u | payload);
      ASSERT_TRUE(std::isnan(x));
      ASSERT_EQ(f32_to_f16_bits(x), 0x7E00u) << std::hex << bits(x);
      ASSERT_EQ(f32_to_bf16_bits(x), 0x7FC0u) << std::hex << bits(x);
    }
  }
}

TEST(ConvertF16, RandomBitPatterns) {
  SweepChecker c;
  std::mt19937 rng(5);
  for (int i = 0; i < 2'000'000; ++i) c.f16(from_bits(rng()));
  // Random f32 with exponents concentrated in f16's range.
  std::uniform_int_distribution<std::uint32_t> exp(100, 145);
  for (int i = 0; i < 2'000'000; ++i) {
    const std::uint32_t u = (rng() & 0x807FFFFFu) | (exp(rng) << 23);
    c.f16(from_bits(u));
  }
}

TEST(ConvertBf16, HalfwayPointsAndNeighbours) {
  SweepChecker c;
  for (std::uint32_t h = 0; h < 0x7F80u; ++h)
    for (std::uint32_t lo :
         {0x0000u, 0x0001u, 0x7FFEu, 0x7FFFu, 0x8000u, 0x8001u, 0x8002u, 0xFFFFu})
      c.both_signs_bf16(from_bits((h << 16) | lo));
  c.both_signs_bf16(std::numeric_limits<float>::infinity());
}

TEST(ConvertBf16, StridedAndRandomSweep) {
  SweepChecker c;
  for (std::uint64_t u = 0; u < 0x100000000ull; u += 1021)
    c.bf16(from_bits(static_cast<std::uint32_t>(u)));
  std::mt19937 rng(9);
  for (int i = 0; i < 2'000'000; ++i) c.bf16(from_bits(rng()));
  EXPECT_GT(c.checked, 6'000'000u);
}

}  // namespace
