// An independent unsigned big integer (32-bit limbs, little endian) and the exact
// rounding RN_f32(sqrt(S) * 2^-149) of one: the norm's oracle for the unit tests and the
// fuzz harnesses, written without any of stepcore's digit code.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <vector>

namespace test_support {

struct Big {
  std::vector<std::uint32_t> limb;

  void trim() {
    while (!limb.empty() && limb.back() == 0) limb.pop_back();
  }
  bool is_zero() const { return limb.empty(); }
  static Big of(std::uint64_t v) {
    Big b;
    b.limb = {static_cast<std::uint32_t>(v), static_cast<std::uint32_t>(v >> 32)};
    b.trim();
    return b;
  }
  int bit_length() const {
    if (limb.empty()) return 0;
    return static_cast<int>(32 * (limb.size() - 1)) + (32 - std::countl_zero(limb.back()));
  }
  Big shl(int s) const {
    if (is_zero()) return *this;
    Big r;
    const int w = s / 32, b = s % 32;
    r.limb.assign(limb.size() + w + 1, 0);
    for (std::size_t i = 0; i < limb.size(); ++i) {
      const std::uint64_t v = static_cast<std::uint64_t>(limb[i]) << b;
      r.limb[i + w] |= static_cast<std::uint32_t>(v);
      r.limb[i + w + 1] |= static_cast<std::uint32_t>(v >> 32);
    }
    r.trim();
    return r;
  }
  Big shr(int s) const {
    Big r;
    const int w = s / 32, b = s % 32;
    if (static_cast<std::size_t>(w) >= limb.size()) return r;
    r.limb.assign(limb.size() - w, 0);
    for (std::size_t i = 0; i < r.limb.size(); ++i) {
      std::uint64_t v = limb[i + w];
      if (i + w + 1 < limb.size()) v |= static_cast<std::uint64_t>(limb[i + w + 1]) << 32;
      r.limb[i] = static_cast<std::uint32_t>(v >> b);
    }
    r.trim();
    return r;
  }
  std::uint64_t low64() const {
    std::uint64_t v = 0;
    if (limb.size() > 0) v |= limb[0];
    if (limb.size() > 1) v |= static_cast<std::uint64_t>(limb[1]) << 32;
    return v;
  }
};

inline Big operator+(const Big& a, const Big& b) {
  Big r;
  r.limb.assign(std::max(a.limb.size(), b.limb.size()) + 1, 0);
  std::uint64_t carry = 0;
  for (std::size_t i = 0; i < r.limb.size(); ++i) {
    std::uint64_t v = carry;
    if (i < a.limb.size()) v += a.limb[i];
    if (i < b.limb.size()) v += b.limb[i];
    r.limb[i] = static_cast<std::uint32_t>(v);
    carry = v >> 32;
  }
  r.trim();
  return r;
}

inline Big operator*(const Big& a, const Big& b) {
  Big r;
  if (a.is_zero() || b.is_zero()) return r;
  r.limb.assign(a.limb.size() + b.limb.size(), 0);
  for (std::size_t i = 0; i < a.limb.size(); ++i) {
    std::uint64_t carry = 0;
    for (std::size_t j = 0; j < b.limb.size(); ++j) {
      const std::uint64_t v =
          static_cast<std::uint64_t>(a.limb[i]) * b.limb[j] + r.limb[i + j] + carry;
      r.limb[i + j] = static_cast<std::uint32_t>(v);
      carry = v >> 32;
    }
    r.limb[i + b.limb.size()] = static_cast<std::uint32_t>(carry);
  }
  r.trim();
  return r;
}

// a - b for a >= b.
inline Big operator-(const Big& a, const Big& b) {
  Big r = a;
  std::int64_t borrow = 0;
  for (std::size_t i = 0; i < r.limb.size(); ++i) {
    std::int64_t v =
        static_cast<std::int64_t>(r.limb[i]) - (i < b.limb.size() ? b.limb[i] : 0) - borrow;
    borrow = v < 0 ? 1 : 0;
    if (v < 0) v += std::int64_t{1} << 32;
    r.limb[i] = static_cast<std::uint32_t>(v);
  }
  if (borrow != 0) std::abort();  // a < b: a bug in the caller
  r.trim();
  return r;
}

inline int cmp(const Big& a, const Big& b) {
  if (a.limb.size() != b.limb.size()) return a.limb.size() < b.limb.size() ? -1 : 1;
  for (std::size_t i = a.limb.size(); i-- > 0;)
    if (a.limb[i] != b.limb[i]) return a.limb[i] < b.limb[i] ? -1 : 1;
  return 0;
}

// floor(sqrt(s)), bit by bit from the top.
inline Big isqrt(const Big& s) {
  Big r;
  for (int b = (s.bit_length() + 1) / 2; b >= 0; --b) {
    Big cand = r + Big::of(1).shl(b);
    if (cmp(cand * cand, s) <= 0) r = cand;
  }
  return r;
}

// RN_f32(sqrt(S) * 2^-149), ties to even, overflow to +Inf.
inline float round_sqrt(const Big& s) {
  if (s.is_zero()) return 0.0f;
  const Big q = isqrt(s);
  const int L = q.bit_length();
  const int c = std::max(L - 24, 0);   // the result's grid is 2^(c - 149)
  std::uint64_t k = q.shr(c).low64();  // floor(sqrt(S) / 2^c)
  // Compare sqrt(S) / 2^c with k + 1/2, i.e. 4 S with (2k+1)^2 * 4^c.
  const Big odd = Big::of(2 * k + 1);
  const int r = cmp(s.shl(2), (odd * odd).shl(2 * c));
  if (r > 0 || (r == 0 && (k & 1))) ++k;
  const double v = std::ldexp(static_cast<double>(k), c - 149);  // exact: k <= 2^24
  if (v >= std::ldexp(1.0, 128)) return std::numeric_limits<float>::infinity();
  return static_cast<float>(v);  // exact
}

}  // namespace test_support
