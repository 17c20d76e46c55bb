// CRC-32C: the portable slicing-by-8 tables (built at compile time from the polynomial)
// and the SSE4.2 crc32 instruction (three interleaved chains combined by polynomial
// multiplication), dispatched once by __builtin_cpu_supports.
#include "host/crc32c.hpp"

#include <array>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace stepcore::detail {

namespace {

static_assert(std::endian::native == std::endian::little,
              "the slicing-by-8 loop reads little-endian words");

/// The reflected Castagnoli polynomial.
constexpr std::uint32_t kPolynomial = 0x82F63B78u;

/// tables[0][b]: the CRC of byte b alone (no init, no xorout); tables[k][b]: the CRC of
/// byte b followed by k zero bytes, so eight bytes are folded with eight lookups.
using SliceTables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr SliceTables make_slice_tables() {
  SliceTables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::uint32_t b = 0; b < 256; ++b)
      t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  return t;
}

constexpr SliceTables kTables = make_slice_tables();

/// Folds `n` bytes at `p` into the running (pre-inverted) register `crc`.
std::uint32_t update_portable(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    const std::uint32_t lo = static_cast<std::uint32_t>(word) ^ crc;
    const std::uint32_t hi = static_cast<std::uint32_t>(word >> 32);
    crc = kTables[7][lo & 0xFFu] ^ kTables[6][(lo >> 8) & 0xFFu] ^ kTables[5][(lo >> 16) & 0xFFu] ^
          kTables[4][lo >> 24] ^ kTables[3][hi & 0xFFu] ^ kTables[2][(hi >> 8) & 0xFFu] ^
          kTables[1][(hi >> 16) & 0xFFu] ^ kTables[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ kTables[0][(crc ^ *p++) & 0xFFu];
  return crc;
}

/// Returns a * b mod P for two polynomials in the reflected form (bit 31 is x^0, bit 0
/// is x^31): what combines CRC registers of separately folded pieces.
constexpr std::uint32_t multiply_mod(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t product = 0;
  for (int k = 31; k >= 0; --k) {
    if ((a >> k) & 1u) product ^= b;
    b = (b & 1u) ? (b >> 1) ^ kPolynomial : b >> 1;  // b * x
  }
  return product;
}

/// Returns x^(8 n) mod P (reflected): multiplying a register by it is folding n zero bytes.
constexpr std::uint32_t x_pow_8n(std::uint64_t n) noexcept {
  std::uint32_t result = 0x80000000u;  // x^0
  std::uint32_t base = 0x00800000u;    // x^8
  for (; n != 0; n >>= 1) {
    if (n & 1u) result = multiply_mod(result, base);
    base = multiply_mod(base, base);
  }
  return result;
}

}  // namespace

std::uint32_t crc32c_shift(std::uint32_t reg, std::uint64_t n) noexcept {
  return multiply_mod(reg, x_pow_8n(n));
}

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                             std::uint64_t b_length) noexcept {
  // The CRC is ~register; the register is linear in its start: the start's part of b's
  // register is shift(~crc_a) and b's own part is ~crc_b ^ shift(~0), so the whole is
  // shift(~crc_a) ^ ~crc_b ^ shift(~0) inverted = shift(crc_a) ^ crc_b.
  return crc32c_shift(crc_a, b_length) ^ crc_b;
}

namespace {

#if defined(__x86_64__)
/// Bytes of each of the three streams the interleaved loop folds side by side.
constexpr std::size_t kLane = 8192;
constexpr std::uint32_t kShiftLane = x_pow_8n(kLane);
constexpr std::uint32_t kShiftTwoLanes = x_pow_8n(2 * kLane);

/// The same fold with the crc32 instruction: bytes until `p` is 8-aligned, then blocks of
/// three lanes folded side by side (the instruction's latency is three times its issue
/// interval, so one chain would leave the unit idle two cycles in three) and combined by
/// multiplication, then single words and bytes.
__attribute__((target("sse4.2"))) std::uint32_t update_sse42(std::uint32_t crc,
                                                             const unsigned char* p,
                                                             std::size_t n) noexcept {
  while (n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  std::uint64_t c64 = crc;
  while (n >= 3 * kLane) {
    std::uint64_t c1 = 0, c2 = 0;
    for (std::size_t j = 0; j < kLane; j += 8) {
      std::uint64_t w0, w1, w2;
      std::memcpy(&w0, p + j, 8);
      std::memcpy(&w1, p + kLane + j, 8);
      std::memcpy(&w2, p + 2 * kLane + j, 8);
      c64 = _mm_crc32_u64(c64, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c64 = multiply_mod(static_cast<std::uint32_t>(c64), kShiftTwoLanes) ^
          multiply_mod(static_cast<std::uint32_t>(c1), kShiftLane) ^ static_cast<std::uint32_t>(c2);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
    p += 8;
    n -= 8;
  }
  crc = static_cast<std::uint32_t>(c64);
  while (n-- > 0) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}
#endif

/// Returns true when the CPU has SSE4.2, asked once (the first call may come from a
/// static initialiser, hence __builtin_cpu_init).
bool have_sse42() noexcept {
#if defined(__x86_64__)
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return have;
#else
  return false;
#endif
}

const unsigned char* bytes_of(std::span<const std::byte> bytes) noexcept {
  return reinterpret_cast<const unsigned char*>(bytes.data());
}

}  // namespace

bool crc32c_sse42_supported() noexcept { return have_sse42(); }

std::uint32_t crc32c_portable(std::span<const std::byte> bytes, std::uint32_t prev) noexcept {
  return ~update_portable(~prev, bytes_of(bytes), bytes.size());
}

std::uint32_t crc32c_sse42(std::span<const std::byte> bytes, std::uint32_t prev) noexcept {
#if defined(__x86_64__)
  if (have_sse42()) return ~update_sse42(~prev, bytes_of(bytes), bytes.size());
#endif
  return crc32c_portable(bytes, prev);
}

std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t prev) noexcept {
  return have_sse42() ? crc32c_sse42(bytes, prev) : crc32c_portable(bytes, prev);
}

}  // namespace stepcore::detail
