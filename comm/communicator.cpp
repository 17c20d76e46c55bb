// The communicator base class, the host record of a norm partial, word-wise
// reductions and the layout check shared by every transport.
#include <cstring>
#include <string>

#include "comm/comm_internal.hpp"

namespace stepcore::comm {

Communicator::Communicator(std::chrono::milliseconds timeout) : timeout_(timeout) {
  if (timeout.count() <= 0)
    throw Error(Errc::out_of_range, "timeout", "the collective timeout must be positive");
}

Communicator::~Communicator() = default;

void Communicator::set_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0)
    throw Error(Errc::out_of_range, "timeout", "the collective timeout must be positive");
  timeout_ = timeout;
}

void check_reduced(const LayoutCheck& reduced, std::uint64_t fingerprint) {
  if (reduced.failure != 0) {
    const auto rank = (reduced.failure >> 8) - 1;
    auto code = static_cast<Errc>(reduced.failure & 0xFF);
    if (errc_name(code) == "unknown") code = Errc::internal;
    throw Error(code, "rank " + std::to_string(rank),
                "rank " + std::to_string(rank) + " could not compute its norm partial (" +
                    std::string(errc_name(code)) + ")");
  }
  if (reduced.fingerprint != ~reduced.inverse || reduced.fingerprint != fingerprint) {
    throw Error(Errc::invalid_argument, "layout",
                "the ranks disagree on the global layout (fingerprints range over at least "
                "two values; every rank must add the same groups in the same order)");
  }
}

namespace detail {

Record pack(const NormPartial& partial, const LayoutCheck* check) noexcept {
  Record r{};
  std::memcpy(r.data(), partial.digits, sizeof partial.digits);
  r[kNormDigits] = partial.nan_count;
  r[kNormDigits + 1] = partial.inf_count;
  r[kSumWords] = partial.max_abs_bits;
  r[kSumWords + 1] = partial.approximate;
  if (check) {
    r[kSumWords + 2] = check->fingerprint;
    r[kSumWords + 3] = check->inverse;
    r[kSumWords + 4] = check->failure;
  }
  return r;
}

void unpack(const Record& r, NormPartial& partial, LayoutCheck* check) noexcept {
  std::memcpy(partial.digits, r.data(), sizeof partial.digits);
  partial.nan_count = r[kNormDigits];
  partial.inf_count = r[kNormDigits + 1];
  partial.max_abs_bits = static_cast<std::uint32_t>(r[kSumWords]);
  partial.approximate = static_cast<std::uint32_t>(r[kSumWords + 1]);
  if (check) {
    check->fingerprint = r[kSumWords + 2];
    check->inverse = r[kSumWords + 3];
    check->failure = r[kSumWords + 4];
  }
}

std::size_t word_bytes(Word word) noexcept {
  return word == Word::u32 || word == Word::f32 ? 4 : 8;
}

const char* word_name(Word word) noexcept {
  switch (word) {
    case Word::u32:
      return "u32";
    case Word::u64:
      return "u64";
    case Word::f32:
      return "f32";
    case Word::f64:
      return "f64";
  }
  return "?";
}

const char* op_name(Op op) noexcept {
  switch (op) {
    case Op::sum:
      return "sum";
    case Op::max:
      return "max";
    case Op::min:
      return "min";
  }
  return "?";
}

namespace {
template <class T>
void reduce_typed(void* into, const void* from, std::size_t count, Op op) noexcept {
  auto* a = static_cast<T*>(into);
  const auto* b = static_cast<const T*>(from);
  for (std::size_t i = 0; i < count; ++i) {
    T x, y;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    const T z = op == Op::sum   ? static_cast<T>(x + y)
                : op == Op::max ? (x < y ? y : x)
                                : (y < x ? y : x);
    std::memcpy(a + i, &z, sizeof z);
  }
}
}  // namespace

void reduce_words(void* into, const void* from, std::size_t count, Word word, Op op) noexcept {
  switch (word) {
    case Word::u32:
      return reduce_typed<std::uint32_t>(into, from, count, op);
    case Word::u64:
      return reduce_typed<std::uint64_t>(into, from, count, op);
    case Word::f32:
      return reduce_typed<float>(into, from, count, op);
    case Word::f64:
      return reduce_typed<double>(into, from, count, op);
  }
}

void validate_all_reduce(const void* data, std::size_t count, Word word, Op op) {
  if (static_cast<unsigned>(word) > static_cast<unsigned>(Word::f64))
    throw Error(Errc::invalid_argument, "word", "not a Word");
  if (static_cast<unsigned>(op) > static_cast<unsigned>(Op::min))
    throw Error(Errc::invalid_argument, "op", "not an Op");
  if (data == nullptr && count > 0)
    throw Error(Errc::null_pointer, "data", "null with a non-zero count");
}

std::string format_ms(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

}  // namespace detail
}  // namespace stepcore::comm
