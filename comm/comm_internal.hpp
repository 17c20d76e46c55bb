// Internals shared by the communicators: the host record a norm partial travels in,
// its combination, polling against a deadline, and error helpers.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>

#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"

namespace stepcore::comm::detail {

// all_reduce_partial reduces the struct in place on the device; the host transports
// carry the same words in one uint64 record. Both rely on this layout.
static_assert(offsetof(NormPartial, digits) == 0);
static_assert(offsetof(NormPartial, nan_count) == 8 * kNormDigits);
static_assert(offsetof(NormPartial, inf_count) == 8 * kNormDigits + 8);
static_assert(offsetof(NormPartial, max_abs_bits) == 8 * kNormDigits + 16);
static_assert(offsetof(NormPartial, approximate) == 8 * kNormDigits + 20);
static_assert(sizeof(NormPartial) == 8 * kNormDigits + 24);
static_assert(sizeof(LayoutCheck) == 24);

/// uint64 words summed: the digits, nan_count, inf_count.
inline constexpr std::size_t kSumWords = kNormDigits + 2;
/// uint32 words combined with max, starting at NormPartial::max_abs_bits.
inline constexpr std::size_t kMaxU32Words = 2;
/// Words combined with max in the host record: max_abs_bits, approximate, the check.
inline constexpr std::size_t kMaxWords = kMaxU32Words + 3;
inline constexpr std::size_t kRecordWords = kSumWords + kMaxWords;
using Record = std::array<std::uint64_t, kRecordWords>;

/// Returns the record of a partial and an optional check (a null check is neutral).
Record pack(const NormPartial& partial, const LayoutCheck* check) noexcept;
/// Writes a reduced record back.
void unpack(const Record& record, NormPartial& partial, LayoutCheck* check) noexcept;
/// into = into (+ on the sum words, max on the others) from. Exact and commutative.
inline void combine(std::uint64_t* into, const std::uint64_t* from) noexcept {
  for (std::size_t i = 0; i < kSumWords; ++i) into[i] += from[i];
  for (std::size_t i = kSumWords; i < kRecordWords; ++i)
    into[i] = into[i] > from[i] ? into[i] : from[i];
}

/// Returns the size of one word.
std::size_t word_bytes(Word word) noexcept;
/// Returns "u32", "u64", "f32", "f64".
const char* word_name(Word word) noexcept;
/// Returns "sum", "max", "min".
const char* op_name(Op op) noexcept;
/// into[i] = op(into[i], from[i]) for `count` words.
void reduce_words(void* into, const void* from, std::size_t count, Word word, Op op) noexcept;

/// Throws Errc::invalid_argument for a word/op enum outside its values and
/// Errc::null_pointer for a null `data` with count > 0.
void validate_all_reduce(const void* data, std::size_t count, Word word, Op op);

/// Calls done() until it returns true (then returns true) or the deadline passes
/// (then returns false after a last try). Spins for the first 20 us (the latency of a
/// small collective between idle ranks), then yields until 2 ms (so that ranks sharing
/// cores let their peers run), then sleeps 50 us between tries.
template <class Done>
bool poll_until(std::chrono::steady_clock::time_point deadline, Done&& done) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (;;) {
    if (done()) return true;
    const auto now = clock::now();
    if (now >= deadline) return done();
    const auto waited = now - start;
    if (waited < std::chrono::microseconds(20)) continue;
    if (waited < std::chrono::milliseconds(2))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

/// Returns "N ms" for messages.
std::string format_ms(std::chrono::milliseconds t);

}  // namespace stepcore::comm::detail
