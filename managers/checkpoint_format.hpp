// The checkpoint file's layout (docs/checkpoint.md has it byte by byte): the format
// versions, the preamble, the payload's alignment and the limits; the records of the
// header; the little-endian encoding of its fields; and how an error names a field. What
// the writer, the parser and the reader share (managers/checkpoint_file.hpp is their API).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "stepcore/optim.hpp"  // kQ8BlockSize

namespace stepcore::detail::checkpoint {

static_assert(std::endian::native == std::endian::little,
              "the payload's floats are written and mapped as little-endian bytes");
static_assert(sizeof(float) == 4 && std::numeric_limits<float>::is_iec559);

/// The format version this build writes; it reads this one, kFormatVersion2 and
/// kFormatVersion1.
inline constexpr std::uint32_t kFormatVersion = 3;
/// The version before 8-bit state: every parameter's arrays are the master and its f32 slots.
inline constexpr std::uint32_t kFormatVersion2 = 2;
/// The first version: AdamW (optimizer 0, 3 arrays) or SignSGD (1, 1 array) only.
inline constexpr std::uint32_t kFormatVersion1 = 1;

/// The fixed preamble at the start of every file.
inline constexpr char kMagic[8] = {'S', 'T', 'E', 'P', 'C', 'K', 'P', 'T'};
inline constexpr std::size_t kPreambleBytes = 40;
/// The payload starts, and every array starts, at a multiple of this many bytes.
inline constexpr std::uint64_t kPayloadAlignment = 64;
/// The longest name (of a parameter, a group, the library version) a file may hold.
inline constexpr std::uint32_t kMaxNameBytes = 4096;
/// The most parameters, and the most groups, a file may hold.
inline constexpr std::uint32_t kMaxRecords = std::uint32_t{1} << 24;
/// The most state slots, and the most hyper-parameters, a file may hold.
inline constexpr std::uint32_t kMaxSlots = 16;
inline constexpr std::uint32_t kMaxHyper = 64;

/// One parameter group as the file records it.
struct GroupRecord {
  std::string name;
  double lr = 0.0;
  double weight_decay = 0.0;
  double beta1 = 0.0;  ///< optimizers with betas only (else 0)
  double beta2 = 0.0;  ///< optimizers with betas only
  double eps = 0.0;    ///< optimizers with betas only
};

/// One parameter (this rank's shard) as the file records it; its arrays are in the payload.
struct ParamRecord {
  std::string name;
  std::uint64_t numel = 0;
  std::uint32_t group = 0;  ///< index into Header::groups
  float step = 0.0f;        ///< step counter (0 for an optimizer without one)
  /// Version 3: its state slots are block-wise 8-bit (codes and block maxima arrays).
  bool q8 = false;
};

/// One fixed hyper-parameter of the optimizer (a field of its configuration as a double).
struct HyperRecord {
  std::string name;
  double value = 0.0;
};

/// Everything in the file but the arrays.
struct Header {
  /// The file's format version (parse sets it; save writes kFormatVersion).
  std::uint32_t version = kFormatVersion;
  std::string optimizer = "adamw";  ///< the optimizer unit's name
  /// The optimizer's hyper-parameters that are neither a group's nor the schedule's.
  std::vector<HyperRecord> hyper;
  /// The names of the state slots, in order: array 1 + s of a parameter is slot s.
  std::vector<std::string> slots = {"exp_avg", "exp_avg_sq"};
  std::uint32_t saved_mode = 0;  ///< OffloadMode of the manager that saved (informational)
  std::int32_t rank = 0;
  std::int32_t world_size = 1;
  std::uint64_t layout_fingerprint = 0;
  std::string library_version;  ///< informational
  std::vector<GroupRecord> groups;
  std::vector<ParamRecord> params;
  /// Arrays per parameter: the master and each slot; version 3 adds each slot's block
  /// maxima (empty for a parameter whose slots are f32). array_shape says what each holds.
  std::uint32_t arrays() const noexcept {
    return 1 + (version >= kFormatVersion ? 2 : 1) * static_cast<std::uint32_t>(slots.size());
  }
};

/// What array `a` of a parameter holds: `elements` values of `width` bytes (4: f32, 1: the
/// codes of an 8-bit slot), the slot it belongs to (-1: the master), and whether it is the
/// slot's block maxima. Version 3: arrays 1..Z are the slots (f32 values, or an 8-bit
/// parameter's codes), arrays Z+1..2Z their block maxima (an 8-bit parameter's
/// ceil(numel / 256) f32 values, else none).
struct ArrayShape {
  std::uint64_t elements = 0;
  std::uint32_t width = 4;
  int slot = -1;
  bool absmax = false;
  std::uint64_t bytes() const noexcept { return elements * width; }
};
inline ArrayShape array_shape(const Header& h, const ParamRecord& p, std::uint32_t a) {
  const auto z = static_cast<std::uint32_t>(h.slots.size());
  if (a == 0) return {p.numel, 4, -1, false};
  if (a <= z) return {p.numel, p.q8 ? 1u : 4u, static_cast<int>(a - 1), false};
  const std::uint64_t blocks = (p.numel + kQ8BlockSize - 1) / kQ8BlockSize;
  return {p.q8 ? blocks : 0, 4, static_cast<int>(a - 1 - z), true};
}
/// The array's name in messages: "master", the slot's name, "<slot>.codes" (an 8-bit
/// parameter's codes) or "<slot>.absmax".
inline std::string array_name(const Header& h, const ParamRecord& p, std::uint32_t a) {
  const ArrayShape s = array_shape(h, p, a);
  if (s.slot < 0) return "master";
  const std::string& slot = h.slots[static_cast<std::size_t>(s.slot)];
  return s.absmax ? slot + ".absmax" : p.q8 ? slot + ".codes" : slot;
}

// ---- the little-endian encoding ---------------------------------------------------------

inline void put_u32(std::vector<std::byte>& out, std::uint32_t v) {
  for (int b = 0; b < 4; ++b) out.push_back(static_cast<std::byte>(v >> (8 * b)));
}
inline void put_u64(std::vector<std::byte>& out, std::uint64_t v) {
  for (int b = 0; b < 8; ++b) out.push_back(static_cast<std::byte>(v >> (8 * b)));
}
inline void put_f64(std::vector<std::byte>& out, double v) {
  put_u64(out, std::bit_cast<std::uint64_t>(v));
}
/// A string: its length (u32), then its bytes.
inline void put_string(std::vector<std::byte>& out, const std::string& s) {
  put_u32(out, static_cast<std::uint32_t>(s.size()));
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}

inline std::uint32_t get_u32(const std::byte* p) {
  std::uint32_t v = 0;
  for (int b = 0; b < 4; ++b) v |= std::uint32_t{std::to_integer<std::uint8_t>(p[b])} << (8 * b);
  return v;
}
inline std::uint64_t get_u64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int b = 0; b < 8; ++b) v |= std::uint64_t{std::to_integer<std::uint8_t>(p[b])} << (8 * b);
  return v;
}

/// Returns `x` rounded up to a multiple of kPayloadAlignment; false when that overflows.
inline bool align_up(std::uint64_t x, std::uint64_t* out) {
  std::uint64_t sum;
  if (__builtin_add_overflow(x, kPayloadAlignment - 1, &sum)) return false;
  *out = sum & ~(kPayloadAlignment - 1);
  return true;
}

// ---- the preamble -------------------------------------------------------------------------

/// The fixed preamble (kPreambleBytes), as written and as read: the magic, then these.
struct Preamble {
  std::uint32_t version = kFormatVersion;
  std::uint32_t reserved = 0;
  std::uint64_t header_length = 0;
  std::uint64_t payload_length = 0;
  std::uint32_t header_crc = 0;
  std::uint32_t payload_crc = 0;
};

inline std::vector<std::byte> encode_preamble(const Preamble& p) {
  std::vector<std::byte> out;
  out.reserve(kPreambleBytes);
  for (char c : kMagic) out.push_back(static_cast<std::byte>(c));
  put_u32(out, p.version);
  put_u32(out, p.reserved);
  put_u64(out, p.header_length);
  put_u64(out, p.payload_length);
  put_u32(out, p.header_crc);
  put_u32(out, p.payload_crc);
  return out;
}

/// The fields after the magic of kPreambleBytes bytes at `p` (the magic is not checked).
inline Preamble decode_preamble(const std::byte* p) {
  Preamble pre;
  pre.version = get_u32(p + 8);
  pre.reserved = get_u32(p + 12);
  pre.header_length = get_u64(p + 16);
  pre.payload_length = get_u64(p + 24);
  pre.header_crc = get_u32(p + 32);
  pre.payload_crc = get_u32(p + 36);
  return pre;
}

// ---- names in messages --------------------------------------------------------------------

/// "list[i].field" ("list[i]" for an empty field): the field an error names.
inline std::string indexed(const char* list, std::size_t i, const char* field) {
  return std::string(list) + "[" + std::to_string(i) + "]" + (field[0] ? "." : "") + field;
}

inline std::string quoted(const std::string& s) { return "'" + s + "'"; }

}  // namespace stepcore::detail::checkpoint
