// libFuzzer harness: the checkpoint file parser (managers/checkpoint_file.hpp) on any
// bytes. Each input is parsed three times: as a whole file (parse: preamble, checksums,
// header, payload layout; format version 1, 2 or 3, as the preamble says), by the streamed
// load's verifying pass over the same bytes in memory (verify, which must agree with
// parse: the same verdict and header, a checksum per block, a first bad value only where
// there is one), and as a bare header past the checksums (parse_header of version 1, 2 or 3,
// the fuzzer's way around the CRC). Each returns a result whose arrays lie inside the
// bytes and agree with the header, or throws stepcore::Error with Errc::corrupt_file;
// anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>

#include "fuzz/fuzz_input.hpp"
#include "managers/checkpoint_file.hpp"
#include "stepcore/error.hpp"

namespace {

namespace ck = stepcore::detail::checkpoint;

// Checks what a successful parse promises for `payload_length` bytes of payload.
void check(const ck::ParsedFile& f, std::uint64_t payload_length) {
  const ck::Header& h = f.header;
  const std::size_t arrays = h.arrays();
  if (h.slots.size() > ck::kMaxSlots || h.hyper.size() > ck::kMaxHyper) __builtin_trap();
  if (h.version == ck::kFormatVersion1 && arrays != 1 && arrays != 3) __builtin_trap();
  if (h.optimizer.empty()) __builtin_trap();
  if (f.array_offsets.size() != h.params.size() * arrays) __builtin_trap();
  for (std::size_t i = 0; i < h.params.size(); ++i) {
    const ck::ParamRecord& p = h.params[i];
    if (p.group >= h.groups.size()) __builtin_trap();
    if (p.q8 && (h.version < ck::kFormatVersion || h.slots.empty())) __builtin_trap();
    for (std::size_t a = 0; a < arrays; ++a) {
      // Array a's bytes, written out here from docs/checkpoint.md: the master and f32
      // slots 4 per element, an 8-bit slot's codes 1, its maxima 4 per block of 256.
      const std::uint64_t z = h.slots.size(), n = p.numel;
      const std::uint64_t bytes = a == 0   ? 4 * n
                                  : a <= z ? (p.q8 ? n : 4 * n)
                                           : (p.q8 ? 4 * ((n + 255) / 256) : 0);
      const std::uint64_t off = f.array_offsets[i * arrays + a];
      if (bytes > payload_length || off > payload_length - bytes) __builtin_trap();
    }
  }
}

template <class Fn>
void refused_or_valid(Fn&& parse_it) {
  try {
    parse_it();
  } catch (const stepcore::Error& e) {
    if (e.code() != stepcore::Errc::corrupt_file) __builtin_trap();
  }
  // Any other exception escapes: libFuzzer reports it as a crash.
}

// Checks what a successful verify promises beside parse's promises, against `parsed`
// (parse of the same bytes; null when it refused them).
void check_verified(const ck::Verified& v, const ck::ParsedFile* parsed,
                    std::span<const std::byte> bytes) {
  if (parsed == nullptr || v.parsed.payload_start != parsed->payload_start ||
      v.parsed.array_offsets != parsed->array_offsets ||
      v.parsed.header.params.size() != parsed->header.params.size() || v.size != bytes.size())
    __builtin_trap();
  check(v.parsed, bytes.size() - v.parsed.payload_start);
  const std::uint64_t payload = bytes.size() - v.parsed.payload_start;
  if (v.block_crcs.size() != (payload + ck::kLoadPieceBytes - 1) / ck::kLoadPieceBytes)
    __builtin_trap();
  const ck::Header& h = v.parsed.header;
  if (v.first_bad.size() != v.parsed.array_offsets.size()) __builtin_trap();
  for (std::size_t k = 0; k < v.first_bad.size(); ++k) {
    if (v.first_bad[k] == ck::Verified::kClean) continue;
    if (v.first_bad[k] >= h.params[k / h.arrays()].numel) __builtin_trap();
    std::uint32_t word;
    std::memcpy(
        &word,
        bytes.data() + v.parsed.payload_start + v.parsed.array_offsets[k] + 4 * v.first_bad[k], 4);
    const bool not_finite = (word & 0x7F800000u) == 0x7F800000u;
    if (!not_finite && word <= 0x80000000u) __builtin_trap();  // neither NaN/Inf nor negative
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  std::optional<ck::ParsedFile> parsed;
  refused_or_valid([&] {
    parsed = ck::parse(bytes, "fuzz.ckpt");
    if (parsed->payload_start > size) __builtin_trap();
    check(*parsed, size - parsed->payload_start);
  });
  ck::ByteSource source;
  source.size = size;
  source.read = [&](std::byte* dst, std::uint64_t from, std::uint64_t to) {
    if (from > to || to > size) __builtin_trap();
    std::memcpy(dst, bytes.data() + from, to - from);
  };
  bool verified = false;
  refused_or_valid([&] {
    const ck::Verified v = ck::verify(source, "fuzz.ckpt");
    check_verified(v, parsed ? &*parsed : nullptr, bytes);
    verified = true;
  });
  if (verified != parsed.has_value()) __builtin_trap();  // the same verdict
  // Past the checksums: the first 8 bytes choose the payload length, the ninth's shift also
  // the version (bits 6-7: 1, 2 or 3; now and then another, which is refused).
  fuzz::Input in(data, size);
  const std::uint8_t pick = in.byte();
  const std::uint64_t payload = in.u64() >> (pick % 64);
  static const std::uint32_t versions[] = {ck::kFormatVersion, ck::kFormatVersion1,
                                           ck::kFormatVersion2, ck::kFormatVersion};
  const std::uint32_t version = pick >= 0xF0 ? pick : versions[pick >> 6];
  const std::size_t skip = size < 9 ? size : 9;
  refused_or_valid([&] {
    const ck::ParsedFile f = ck::parse_header(bytes.subspan(skip), payload, "fuzz.ckpt", version);
    check(f, payload);
  });
  return 0;
}
