// CRC-32C (Castagnoli: reflected, polynomial 0x82F63B78, initial value and final xor
// 0xFFFFFFFF; the check value of "123456789" is 0xE3069283), the checksum of the
// checkpoint files: a portable slicing-by-8 version and the SSE4.2 instruction (three
// interleaved chains), chosen once at run time. Both give the same value for every input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace stepcore::detail {

/// Returns the CRC-32C of `bytes` continuing from `prev`, the CRC-32C of the bytes before
/// them (0 for none): crc32c(b, crc32c(a)) == crc32c(a followed by b). Uses SSE4.2 when
/// the CPU has it, else the portable tables.
std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t prev = 0) noexcept;

/// Returns what crc32c returns, always computed with the portable slicing-by-8 tables.
std::uint32_t crc32c_portable(std::span<const std::byte> bytes, std::uint32_t prev = 0) noexcept;

/// Returns the CRC register `reg` (pre-inverted, as the folding loops keep it) advanced
/// over `n` zero bytes: reg * x^(8n) mod P. Registers of pieces folded apart combine as
/// crc32c_shift(reg_a, size_b) ^ reg_b_from_zero.
std::uint32_t crc32c_shift(std::uint32_t reg, std::uint64_t n) noexcept;

/// Returns the CRC-32C of a followed by b from crc_a (of a), crc_b (of b alone) and
/// b_length: crc32c_shift(crc_a, b_length) ^ crc_b. Pieces checksummed apart (on several
/// threads) combine in order.
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                             std::uint64_t b_length) noexcept;

/// Returns true when this build and CPU can run crc32c_sse42 (x86-64 with SSE4.2).
bool crc32c_sse42_supported() noexcept;

/// Returns what crc32c returns, computed with the SSE4.2 crc32 instruction; only when
/// crc32c_sse42_supported() (else it returns crc32c_portable's value).
std::uint32_t crc32c_sse42(std::span<const std::byte> bytes, std::uint32_t prev = 0) noexcept;

}  // namespace stepcore::detail
