// The codebooks of block-wise 8-bit slots (core/q8.hpp): each map's bucket table under
// each rule, built once from the rule's definition (docs/numerics.md 8f, 8f.1) and checked.
#include "core/q8.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <vector>

#include "core/q8_maps.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {
namespace {

float map_value(const std::uint32_t* map, int c) { return f32_from_bits(map[c]); }

// 8f's N(y) for a non-NaN y: the code whose value is nearest in exact arithmetic (the two
// distances to y's neighbouring values are exact in binary64), a tie to the larger
// magnitude; below the least value the least code, above the largest the largest.
std::uint32_t nearest_code(const std::uint32_t* map, float y) {
  int lo = -1;  // the last code whose value is <= y (binary search: the map ascends)
  int a = 0, b = 255;
  while (a <= b) {
    const int mid = (a + b) / 2;
    if (map_value(map, mid) <= y) {
      lo = mid;
      a = mid + 1;
    } else {
      b = mid - 1;
    }
  }
  if (lo < 0) return 0;
  if (lo == 255) return 255;
  const float below_value = map_value(map, lo), above_value = map_value(map, lo + 1);
  const double below = static_cast<double>(y) - below_value;
  const double above = static_cast<double>(above_value) - y;
  if (below != above) return static_cast<std::uint32_t>(below < above ? lo : lo + 1);
  return static_cast<std::uint32_t>(std::fabs(below_value) > std::fabs(above_value) ? lo : lo + 1);
}

// 8f.1's search for a non-NaN y: eight halving steps, then up one code when the f32
// residual reaches half the f32 gap.
std::uint32_t torchao_code(const std::uint32_t* map, float y) {
  int c = 0;
  for (int k = 128; k >= 1; k /= 2)
    if (y >= map_value(map, c + k)) c += k;
  const int u = c + 1 < 255 ? c + 1 : 255;
  const float residual = y - map_value(map, c);
  const float half = (map_value(map, u) - map_value(map, c)) * 0.5f;
  return static_cast<std::uint32_t>(residual >= half ? u : c);
}

struct Book {
  std::array<std::uint32_t, 2 * kQ8Buckets> buckets{};
  Q8Codebook codebook{};
};

[[noreturn]] void bad_table(const char* why) { throw Error(Errc::internal, "q8_codebook", why); }

// Fills `book` for the map under the rule `code_of` (non-NaN y -> code, non-decreasing).
template <class CodeOf>
void build(Book& book, CodeOf code_of) {
  constexpr std::int32_t kSpan = 1 << kQ8KeyShift;
  constexpr std::int32_t kNone = -1;
  for (std::uint32_t sign = 0; sign < 2; ++sign) {
    const auto y = [&](std::uint32_t m) { return f32_from_bits(m | (sign << 31)); };
    // Every value below the floor takes the floor's code (the key clamps to it).
    if (code_of(y(0)) != code_of(y(kQ8KeyFloor))) bad_table("a code changes below 2^-24");
    // Each bucket's base code and own threshold offset (kNone: none).
    std::array<std::uint32_t, kQ8Buckets> base{};
    std::array<std::int32_t, kQ8Buckets> own{};
    for (std::uint32_t k = 0; k < kQ8Buckets; ++k) {
      const std::uint32_t lowest = kQ8KeyFloor + (k << kQ8KeyShift);
      const std::uint32_t highest =
          lowest + kQ8KeyLowMask < kQ8KeyCeil ? lowest + kQ8KeyLowMask : kQ8KeyCeil;
      base[k] = code_of(y(lowest));
      const std::uint32_t top = code_of(y(highest));
      own[k] = kNone;
      if (top != base[k]) {
        if (top != (sign != 0 ? base[k] - 1u : base[k] + 1u))
          bad_table("a bucket holds more than one threshold");
        // The least magnitude in (lowest, highest] whose code moved.
        std::uint32_t lo = lowest, hi = highest;
        while (hi - lo > 1) {
          const std::uint32_t mid = lo + (hi - lo) / 2;
          (code_of(y(mid)) == base[k] ? lo : hi) = mid;
        }
        own[k] = static_cast<std::int32_t>(hi - lowest);
      }
    }
    // Every threshold's key (the first key of a new code): inside a bucket, or at the start
    // of the next one.
    std::vector<std::int64_t> thresholds;
    for (std::uint32_t k = 0; k < kQ8Buckets; ++k) {
      const std::int64_t start = static_cast<std::int64_t>(k) * kSpan;
      if (own[k] != kNone) thresholds.push_back(start + own[k]);
      if (k + 1 < kQ8Buckets) {
        const std::uint32_t last = code_of(y(kQ8KeyFloor + (k << kQ8KeyShift) + kQ8KeyLowMask));
        if (base[k + 1] != last) {
          if (base[k + 1] != (sign != 0 ? last - 1u : last + 1u))
            bad_table("a code skips one at a bucket boundary");
          thresholds.push_back(start + kSpan);
        }
      }
    }
    std::size_t first = 0;  // the first threshold not below the current window
    for (std::uint32_t k = 0; k < kQ8Buckets; ++k) {
      // The thresholds t a key K of this bucket is within kQ8Guard of (t - guard <= K <
      // t + guard): t in (start - guard, start + span - 1 + guard].
      const std::int64_t start = static_cast<std::int64_t>(k) * kSpan;
      while (first < thresholds.size() && thresholds[first] <= start - kQ8Guard) ++first;
      std::int32_t pos = kNone, near = 0;
      for (std::size_t t = first;
           t < thresholds.size() && thresholds[t] <= start + kSpan - 1 + kQ8Guard; ++t) {
        pos = static_cast<std::int32_t>(thresholds[t] - start);
        ++near;
      }
      if (near > 1) bad_table("two thresholds lie within the guard of one bucket");
      const std::uint32_t field =
          near == 0 ? kQ8PosNone : static_cast<std::uint32_t>(pos + kQ8PosBias);
      const std::uint32_t index = sign != 0 ? kQ8Buckets - 1u - k : kQ8Buckets + k;
      book.buckets[index] = (base[k] << 24) | (own[k] != kNone ? kQ8MovesBit : 0u) | field;
    }
  }
}

const Book& make(bool non_negative, Q8Rule rule, Book& book) {
  const std::uint32_t* map = non_negative ? kQ8UnsignedBits : kQ8SignedBits;
  if (rule == Q8Rule::torchao)
    build(book, [&](float y) { return torchao_code(map, y); });
  else
    build(book, [&](float y) { return nearest_code(map, y); });
  const std::uint32_t zero = non_negative ? kQ8UnsignedZero : kQ8SignedZero;
  book.codebook = Q8Codebook{map, book.buckets.data(), rule == Q8Rule::torchao ? 0u : zero,
                             rule == Q8Rule::torchao ? kQ8TorchaoFloorBits : 0u,
                             rule == Q8Rule::torchao ? kQ8TorchaoNanBits : 0x7FC00000u};
  return book;
}

}  // namespace

const Q8Codebook& q8_codebook(bool non_negative, Q8Rule rule) {
  static_assert(kQ8TorchaoFloorBits == 0x2B8CBCCCu, "1e-12f");
  static Book books[4];
  static const Book* built[4] = {
      &make(false, Q8Rule::nearest, books[0]), &make(true, Q8Rule::nearest, books[1]),
      &make(false, Q8Rule::torchao, books[2]), &make(true, Q8Rule::torchao, books[3])};
  return built[(rule == Q8Rule::torchao ? 2 : 0) + (non_negative ? 1 : 0)]->codebook;
}

std::vector<std::uint32_t> q8_codebook_image() {
  std::vector<std::uint32_t> image;
  image.reserve(kQ8ImageWords);
  for (Q8Rule rule : {Q8Rule::nearest, Q8Rule::torchao})
    for (bool non_negative : {false, true}) {
      const Q8Codebook& cb = q8_codebook(non_negative, rule);
      image.insert(image.end(), cb.map, cb.map + 256);
      image.insert(image.end(), cb.buckets, cb.buckets + 2 * std::size_t{kQ8Buckets});
      image.push_back(cb.nan_code);
      image.push_back(cb.floor_bits);
      image.push_back(cb.nan_max_bits);
    }
  return image;
}

}  // namespace stepcore::detail

namespace stepcore {

std::span<const float, 256> q8_map(bool non_negative) noexcept {
  // The header's bit patterns as floats, made once (the maps are not recomputed).
  static const auto maps = [] {
    std::array<std::array<float, 256>, 2> m{};
    for (int c = 0; c < 256; ++c) {
      m[0][c] = std::bit_cast<float>(detail::kQ8SignedBits[c]);
      m[1][c] = std::bit_cast<float>(detail::kQ8UnsignedBits[c]);
    }
    return m;
  }();
  return maps[non_negative ? 1 : 0];
}

}  // namespace stepcore
