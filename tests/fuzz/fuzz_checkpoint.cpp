// libFuzzer harness: the checkpoint file parser (managers/checkpoint_file.hpp) on any
// bytes. Each input is parsed twice: as a whole file (parse: preamble, checksums, header,
// payload layout; format version 1 or 2, as the preamble says) and as a bare header past
// the checksums (parse_header of version 1 or 2, the fuzzer's way around the CRC). Either
// returns a result whose arrays lie inside the bytes and agree with the header, or throws
// stepcore::Error with Errc::corrupt_file; anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
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
    if (h.params[i].group >= h.groups.size()) __builtin_trap();
    for (std::size_t a = 0; a < arrays; ++a) {
      const std::uint64_t off = f.array_offsets[i * arrays + a];
      const std::uint64_t n = h.params[i].numel;
      if (n > payload_length / 4 || off > payload_length - 4 * n) __builtin_trap();
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  refused_or_valid([&] {
    const ck::ParsedFile f = ck::parse(bytes, "fuzz.ckpt");
    if (f.payload_start > size) __builtin_trap();
    check(f, size - f.payload_start);
  });
  // Past the checksums: the first 8 bytes choose the payload length, the ninth's shift also
  // the version (its low bit: 1 or 2; now and then another, which is refused).
  fuzz::Input in(data, size);
  const std::uint8_t pick = in.byte();
  const std::uint64_t payload = in.u64() >> (pick % 64);
  const std::uint32_t version =
      pick >= 0xF0 ? pick : (pick & 0x40 ? ck::kFormatVersion1 : ck::kFormatVersion);
  const std::size_t skip = size < 9 ? size : 9;
  refused_or_valid([&] {
    const ck::ParsedFile f = ck::parse_header(bytes.subspan(skip), payload, "fuzz.ckpt", version);
    check(f, payload);
  });
  return 0;
}
