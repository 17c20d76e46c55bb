// CRC-32C: the portable slicing-by-8 tables (built at compile time from the polynomial)
// and the SSE4.2 crc32 instruction, dispatched once by __builtin_cpu_supports.
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

#if defined(__x86_64__)
/// The same fold with the crc32 instruction: bytes until `p` is 8-aligned, then words.
__attribute__((target("sse4.2"))) std::uint32_t update_sse42(std::uint32_t crc,
                                                             const unsigned char* p,
                                                             std::size_t n) noexcept {
  while (n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  std::uint64_t c64 = crc;
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
