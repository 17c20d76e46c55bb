// libFuzzer harness: norm partials from random digits and records, finalised and merged,
// the order (2 or 1) a fuzzed choice. Oracle: the exact value S of the raw digits
// (tests/big_int.hpp, no stepcore digit code) and a check that the returned f32 is
// RN(sqrt(S * 2^-298)) (order 2) or RN(S * 2^-149) (order 1) by its rounding midpoints;
// never a finite result that is wrong (docs/numerics.md 6.4, 6.6: exact, or flagged).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "big_int.hpp"
#include "fuzz/fuzz_input.hpp"
#include "stepcore/norm.hpp"

namespace {

using stepcore::kNormDigits;
using stepcore::NormPartial;
using stepcore::NormResult;
using test_support::Big;
using test_support::cmp;

[[noreturn]] void fail(const char* what) {
  __builtin_trap();
  (void)what;
}

std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

Big value_of(const NormPartial& p) {
  Big s;
  for (int k = 0; k < kNormDigits; ++k) s = s + Big::of(p.digits[k]).shl(32 * k);
  return s;
}

// Returns whether r == RN_f32(S * 2^-149) (ties to even, overflow to +Inf), checked
// against the midpoints around r: (2m - 1) 2^(q-1) <= S 2^-149 <= (2m + 1) 2^(q-1).
bool correctly_rounded_one(const Big& s, float r) {
  if (std::isnan(r) || r < 0) return false;
  // Compare S * 2^-149 with c * 2^t as S * 4 with c * 2^(t + 151) (t >= -151).
  auto compare = [&](std::uint64_t c, int t) { return cmp(s.shl(2), Big::of(c).shl(t + 151)); };
  if (std::isinf(r)) return compare((std::uint64_t{1} << 25) - 1, 103) >= 0;
  if (r == 0.0f) return s.is_zero();
  std::uint64_t m;
  int q;
  if (r < std::numeric_limits<float>::min()) {
    m = static_cast<std::uint64_t>(std::ldexp(static_cast<double>(r), 149));
    q = -149;
  } else {
    int e = 0;
    const double f = std::frexp(static_cast<double>(r), &e);
    m = static_cast<std::uint64_t>(std::ldexp(f, 24));
    q = e - 24;
  }
  const bool even = (m & 1) == 0;
  const int up = compare(2 * m + 1, q - 1);
  if (up > 0 || (up == 0 && !even)) return false;
  const bool bottom = m == (std::uint64_t{1} << 23) && r > std::numeric_limits<float>::min();
  const int down = bottom ? compare(4 * m - 1, q - 2) : compare(2 * m - 1, q - 1);
  return down > 0 || (down == 0 && even);
}

// Returns whether r == RN_f32(sqrt(S * 2^-298)) (ties to even, overflow to +Inf), checked
// against the midpoints around r: ((2m - 1) 2^(q-1))^2 <= S 2^-298 <= ((2m + 1) 2^(q-1))^2.
bool correctly_rounded(const Big& s, float r) {
  if (std::isnan(r) || r < 0) return false;
  // Compare S * 2^-298 with (c * 2^t)^2 as S * 2^348 with c^2 * 2^(2t + 646) (t >= -175).
  auto at_least = [&](std::uint64_t c, int t) {  // S * 2^-298 >= (c 2^t)^2
    return cmp(s.shl(348), (Big::of(c) * Big::of(c)).shl(2 * t + 646)) >= 0;
  };
  auto equal = [&](std::uint64_t c, int t) {
    return cmp(s.shl(348), (Big::of(c) * Big::of(c)).shl(2 * t + 646)) == 0;
  };
  if (std::isinf(r))
    return at_least((std::uint64_t{1} << 25) - 1, 103);  // FLT_MAX's upper midpoint
  if (r == 0.0f) return s.is_zero();
  std::uint64_t m;
  int q;
  if (r < std::numeric_limits<float>::min()) {  // subnormal: the 2^-149 grid
    m = static_cast<std::uint64_t>(std::ldexp(static_cast<double>(r), 149));
    q = -149;
  } else {
    int e = 0;
    const double f = std::frexp(static_cast<double>(r), &e);  // r = f 2^e, f in [0.5, 1)
    m = static_cast<std::uint64_t>(std::ldexp(f, 24));
    q = e - 24;
  }
  const bool even = (m & 1) == 0;
  // Upper midpoint (2m + 1) 2^(q-1): S below it, or on it with m even.
  if (at_least(2 * m + 1, q - 1) && !(even && equal(2 * m + 1, q - 1))) return false;
  // Lower midpoint: (2m - 1) 2^(q-1), or (4m - 1) 2^(q-2) at a binade's bottom (m = 2^23,
  // a normal r above FLT_MIN: the float below is half an ulp closer).
  const bool bottom = m == (std::uint64_t{1} << 23) && r > std::numeric_limits<float>::min();
  const std::uint64_t c = bottom ? 4 * m - 1 : 2 * m - 1;
  const int t = bottom ? q - 2 : q - 1;
  if (!at_least(c, t)) return false;
  if (equal(c, t) && !even) return false;
  return true;
}

NormPartial decode(fuzz::Input& in) {
  NormPartial p;
  for (int k = 0; k < kNormDigits; ++k) {
    switch (in.byte() % 4) {
      case 0:
        p.digits[k] = 0;
        break;
      case 1:
        p.digits[k] = in.u32();
        break;
      case 2:
        p.digits[k] = in.u64();
        break;
      default:
        p.digits[k] = ~std::uint64_t{0} - in.byte();
        break;
    }
  }
  const std::uint8_t counts = in.byte();
  p.nan_count = (counts & 0x0F) == 1 ? in.byte() : 0;
  p.inf_count = (counts & 0xF0) == 0x10 ? in.byte() : 0;
  switch (in.byte() % 3) {
    case 0:
      p.max_abs_bits = in.u32();
      break;  // anything, NaN patterns too
    case 1:
      p.max_abs_bits = in.u32() & 0x7F7FFFFFu;
      break;  // a finite record
    default:
      p.max_abs_bits = 0;
      break;
  }
  p.approximate = in.flag() ? 1u : 0u;
  return p;
}

// Checks finalize(p, order) against S (the partial's exact value).
void check(const NormPartial& p, const Big& s, stepcore::NormOrder order) {
  const NormResult r = stepcore::finalize(p, order);
  if (r.nan_count != p.nan_count || r.inf_count != p.inf_count) fail("counts");
  if (p.nan_count != 0) {
    if (!std::isnan(r.norm) || r.finite) fail("NaN partial");
    return;
  }
  if (p.inf_count != 0) {
    if (!std::isinf(r.norm) || r.finite) fail("Inf partial");
    return;
  }
  if (p.max_abs_bits >= 0x7F800000u) {  // no finite value gives it: flagged
    if (r.finite || !std::isnan(r.norm)) fail("bad max_abs not flagged");
    return;
  }
  if (bits_of(r.max_abs) != p.max_abs_bits) fail("max_abs");
  if (r.needs_exact) {  // allowed for approximate partials only, never finite
    if (p.approximate == 0 || r.finite) fail("needs_exact");
    return;
  }
  const bool right = order == stepcore::NormOrder::one ? correctly_rounded_one(s, r.norm)
                                                       : correctly_rounded(s, r.norm);
  if (!right) fail("wrong norm");
  if (r.finite != !std::isinf(r.norm)) fail("finite flag");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  NormPartial a = decode(in);
  const NormPartial b = decode(in);
  // The order: the last byte (an input without it keeps its meaning: order 2).
  const auto order = in.flag() ? stepcore::NormOrder::one : stepcore::NormOrder::two;
  const Big sa = value_of(a), sb = value_of(b);
  check(a, sa, order);
  NormPartial m = a;
  stepcore::merge(m, b);
  // The merged value: S_a + S_b, or saturated at 2^640 - 1 when it needs more digits.
  Big sm = sa + sb;
  if (sm.bit_length() > 32 * kNormDigits) {
    sm = Big::of(1).shl(32 * kNormDigits) - Big::of(1);
  }
  check(m, sm, order);
  return 0;
}
