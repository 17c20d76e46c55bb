// checkpoint::parse and its parts (managers/checkpoint_file.hpp): a pure function of the
// file's bytes that verifies the preamble (magic, version, lengths, checksums), then
// reads the binary header front to back, version 1, 2 or 3, checking every count, length and
// offset against the bytes left and the payload before anything is reserved or returned.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string_view>
#include <unordered_map>

#include "host/crc32c.hpp"
#include "managers/checkpoint_file.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail::checkpoint {

namespace {

/// Bytes in the binary header of the smallest group and parameter records: what a
/// count must fit in before anything is reserved for it.
constexpr std::uint64_t kMinGroupRecordBytes = 4 + 5 * 8;
constexpr std::uint64_t min_param_record_bytes(std::uint32_t arrays, std::uint32_t version) {
  return 4 + 8 + 4 + 4 + (version >= kFormatVersion ? 4 : 0) + std::uint64_t{8} * arrays;
}

// The versions this build reads, for messages.
const std::string kReadableVersions = std::to_string(kFormatVersion1) + ", " +
                                      std::to_string(kFormatVersion2) + " and " +
                                      std::to_string(kFormatVersion);

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIX32, v);
  return buf;
}

[[noreturn]] void corrupt(const std::string& name, const std::string& what) {
  throw Error(Errc::corrupt_file, "path", name + ": " + what);
}

/// Reads the binary header front to back; every read checks the bytes left first and
/// names the field (list[index].field) it could not read.
class HeaderReader {
 public:
  HeaderReader(std::span<const std::byte> bytes, const std::string& name)
      : bytes_(bytes), name_(name) {}

  std::size_t left() const noexcept { return bytes_.size() - pos_; }
  std::size_t position() const noexcept { return pos_; }

  std::uint32_t u32(const char* list, std::size_t i, const char* field) {
    const std::byte* p = take(4, list, i, field);
    return get_u32(p);
  }
  std::uint64_t u64(const char* list, std::size_t i, const char* field) {
    const std::byte* p = take(8, list, i, field);
    return get_u64(p);
  }
  double f64(const char* list, std::size_t i, const char* field) {
    return std::bit_cast<double>(u64(list, i, field));
  }
  std::string string(const char* list, std::size_t i, const char* field) {
    const std::uint32_t length = u32(list, i, field);
    if (length > kMaxNameBytes)
      corrupt(name_, "header field " + label(list, i, field) + " is " + std::to_string(length) +
                         " bytes long, more than the limit of " + std::to_string(kMaxNameBytes));
    const std::byte* p = take(length, list, i, field);
    return std::string(reinterpret_cast<const char*>(p), length);
  }

 private:
  static std::string label(const char* list, std::size_t i, const char* field) {
    return list[0] ? indexed(list, i, field) : std::string(field);
  }
  const std::byte* take(std::size_t n, const char* list, std::size_t i, const char* field) {
    if (n > left())
      corrupt(name_, "the header ends inside " + label(list, i, field) + " (" + std::to_string(n) +
                         " bytes needed at header byte " + std::to_string(pos_) + ", " +
                         std::to_string(left()) + " left)");
    const std::byte* p = bytes_.data() + pos_;
    pos_ += n;
    return p;
  }

  std::span<const std::byte> bytes_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

/// Reads version 1's fields before the groups: the optimizer as a number (0 AdamW with a
/// formula, 3 arrays; 1 SignSGD, 1 array), as the version 2 header that means the same.
void read_v1_prefix(HeaderReader& r, Header& h, const std::string& name) {
  const std::uint32_t optimizer = r.u32("", 0, "optimizer");
  const std::uint32_t formula = r.u32("", 0, "formula");
  h.saved_mode = r.u32("", 0, "saved_mode");
  const std::uint32_t arrays = r.u32("", 0, "arrays");
  h.rank = static_cast<std::int32_t>(r.u32("", 0, "rank"));
  h.world_size = static_cast<std::int32_t>(r.u32("", 0, "world_size"));
  h.layout_fingerprint = r.u64("", 0, "layout_fingerprint");
  h.library_version = r.string("", 0, "library_version");
  if (arrays != 1 && arrays != 3)
    corrupt(name, "the header says " + std::to_string(arrays) +
                      " arrays per parameter; a version 1 file holds 1 (SignSGD) or 3 (AdamW)");
  if (optimizer == 0) {
    // Version 1 wrote AdamW without amsgrad and maximize (it had neither).
    h.optimizer = "adamw";
    h.hyper = {{"formula", static_cast<double>(formula)}, {"amsgrad", 0.0}, {"maximize", 0.0}};
  } else if (optimizer == 1) {
    h.optimizer = "sign_sgd";
  } else {
    corrupt(name, "the header names optimizer " + std::to_string(optimizer) +
                      "; version 1 has 0 (adamw) and 1 (sign_sgd)");
  }
  h.slots.clear();
  if (arrays == 3) h.slots = {"exp_avg", "exp_avg_sq"};
}

/// Reads version 2's fields before the groups.
void read_v2_prefix(HeaderReader& r, Header& h, const std::string& name) {
  h.saved_mode = r.u32("", 0, "saved_mode");
  h.rank = static_cast<std::int32_t>(r.u32("", 0, "rank"));
  h.world_size = static_cast<std::int32_t>(r.u32("", 0, "world_size"));
  h.layout_fingerprint = r.u64("", 0, "layout_fingerprint");
  h.library_version = r.string("", 0, "library_version");
  h.optimizer = r.string("", 0, "optimizer");
  if (h.optimizer.empty()) corrupt(name, "the header's optimizer name is empty");
  const std::uint32_t hyper = r.u32("", 0, "hyper-parameter count");
  if (hyper > kMaxHyper)
    corrupt(name, "the header says " + std::to_string(hyper) +
                      " hyper-parameters, more than the limit of " + std::to_string(kMaxHyper));
  h.hyper.resize(hyper);
  for (std::uint32_t k = 0; k < hyper; ++k) {
    h.hyper[k].name = r.string("hyper", k, "name");
    h.hyper[k].value = r.f64("hyper", k, "value");
  }
  // Adam's formula came later: a file without it ran torch's, whatever the default is now.
  if (h.optimizer == "adam" &&
      std::none_of(h.hyper.begin(), h.hyper.end(),
                   [](const HyperRecord& f) { return f.name == "formula"; }))
    h.hyper.push_back({"formula", static_cast<double>(AdamWFormula::torch)});
  const std::uint32_t slots = r.u32("", 0, "slot count");
  if (slots > kMaxSlots)
    corrupt(name, "the header says " + std::to_string(slots) + " state slots, more than the " +
                      "limit of " + std::to_string(kMaxSlots));
  h.slots.resize(slots);
  for (std::uint32_t s = 0; s < slots; ++s) {
    h.slots[s] = r.string("slots", s, "");
    if (h.slots[s].empty()) corrupt(name, indexed("slots", s, "") + " is an empty name");
    for (std::uint32_t t = 0; t < s; ++t)
      if (h.slots[t] == h.slots[s])
        corrupt(name, indexed("slots", s, "") + " " + quoted(h.slots[s]) + " is also slots[" +
                          std::to_string(t) + "]");
  }
}

}  // namespace

ParsedFile parse_header(std::span<const std::byte> header_bytes, std::uint64_t payload_length,
                        const std::string& name, std::uint32_t version) {
  ParsedFile out;
  Header& h = out.header;
  HeaderReader r(header_bytes, name);
  h.version = version;
  if (version == kFormatVersion1)
    read_v1_prefix(r, h, name);
  else if (version == kFormatVersion2 || version == kFormatVersion)
    read_v2_prefix(r, h, name);  // version 3 differs from 2 only in its parameter records
  else
    corrupt(name, "format version " + std::to_string(version) + ", this build reads " +
                      kReadableVersions);
  const std::uint32_t arrays = h.arrays();
  if (h.world_size < 1 || h.rank < 0 || h.rank >= h.world_size)
    corrupt(name, "the header says rank " + std::to_string(h.rank) + " of world size " +
                      std::to_string(h.world_size));

  const std::uint32_t group_count = r.u32("", 0, "group count");
  if (group_count > kMaxRecords || group_count * kMinGroupRecordBytes > r.left())
    corrupt(name, "the header says " + std::to_string(group_count) +
                      " groups, more than its remaining " + std::to_string(r.left()) +
                      " bytes can hold (or than the limit of " + std::to_string(kMaxRecords) + ")");
  h.groups.resize(group_count);
  for (std::uint32_t g = 0; g < group_count; ++g) {
    GroupRecord& rec = h.groups[g];
    rec.name = r.string("groups", g, "name");
    rec.lr = r.f64("groups", g, "lr");
    rec.weight_decay = r.f64("groups", g, "weight_decay");
    rec.beta1 = r.f64("groups", g, "beta1");
    rec.beta2 = r.f64("groups", g, "beta2");
    rec.eps = r.f64("groups", g, "eps");
  }

  const std::uint32_t param_count = r.u32("", 0, "parameter count");
  if (param_count > kMaxRecords || param_count * min_param_record_bytes(arrays, version) > r.left())
    corrupt(name, "the header says " + std::to_string(param_count) +
                      " parameters, more than its remaining " + std::to_string(r.left()) +
                      " bytes can hold (or than the limit of " + std::to_string(kMaxRecords) + ")");
  h.params.resize(param_count);
  out.array_offsets.resize(std::size_t{param_count} * arrays);
  for (std::uint32_t i = 0; i < param_count; ++i) {
    ParamRecord& p = h.params[i];
    p.name = r.string("params", i, "name");
    p.numel = r.u64("params", i, "numel");
    p.group = r.u32("params", i, "group");
    p.step = std::bit_cast<float>(r.u32("params", i, "step"));
    if (version >= kFormatVersion) {  // its state: 0 f32 slots, 1 8-bit slots
      const std::uint32_t state = r.u32("params", i, "state");
      if (state > 1 || (state == 1 && h.slots.empty()))
        corrupt(name, indexed("params", i, "state") + " is " + std::to_string(state) +
                          (state > 1 ? ": 0 (f32 slots) or 1 (8-bit slots)"
                                     : ": 8-bit slots, but the optimizer has no slots"));
      p.q8 = state == 1;
    }
    if (p.group >= group_count)
      corrupt(name, indexed("params", i, "group") + " is " + std::to_string(p.group) +
                        ", but the " + "file has " + std::to_string(group_count) + " groups");
    if (p.numel > std::numeric_limits<std::uint64_t>::max() / 4)
      corrupt(name, indexed("params", i, "numel") + " is " + std::to_string(p.numel) +
                        ": its bytes overflow 64 bits");
    for (std::uint32_t a = 0; a < arrays; ++a) {
      const std::uint64_t bytes = array_shape(h, p, a).bytes();
      const std::uint64_t offset = r.u64("params", i, "array offset");
      const std::string array = indexed("params", i, "") + " array " + std::to_string(a);
      if (offset % kPayloadAlignment != 0)
        corrupt(name, array + " is at payload offset " + std::to_string(offset) +
                          ", not a multiple of " + std::to_string(kPayloadAlignment));
      std::uint64_t end;
      if (__builtin_add_overflow(offset, bytes, &end) || end > payload_length)
        corrupt(name, array + " (" + std::to_string(bytes) + " bytes at payload offset " +
                          std::to_string(offset) + ") runs past the end of the " +
                          std::to_string(payload_length) + "-byte payload");
      out.array_offsets[std::size_t{i} * arrays + a] = offset;
    }
  }
  if (r.left() != 0)
    corrupt(name,
            std::to_string(r.left()) + " unread bytes follow the last parameter in the header");

  // Names are unique.
  std::unordered_map<std::string_view, std::uint32_t> seen;
  seen.reserve(param_count);
  for (std::uint32_t i = 0; i < param_count; ++i) {
    const auto [it, inserted] = seen.emplace(h.params[i].name, i);
    if (!inserted)
      corrupt(name, indexed("params", i, "name") + " " + quoted(h.params[i].name) +
                        " is also the name of params[" + std::to_string(it->second) + "]");
  }

  // No two (non-empty) arrays overlap: sorted by offset, each ends before the next starts.
  struct Extent {
    std::uint64_t begin, end;
    std::size_t index;  // i * arrays + a
  };
  std::vector<Extent> extents;
  extents.reserve(out.array_offsets.size());
  for (std::size_t k = 0; k < out.array_offsets.size(); ++k) {
    const std::uint64_t bytes =
        array_shape(h, h.params[k / arrays], static_cast<std::uint32_t>(k % arrays)).bytes();
    if (bytes > 0) extents.push_back({out.array_offsets[k], out.array_offsets[k] + bytes, k});
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& x, const Extent& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.index < y.index;
  });
  for (std::size_t k = 1; k < extents.size(); ++k) {
    const Extent& prev = extents[k - 1];
    const Extent& next = extents[k];
    if (next.begin < prev.end) {
      auto label = [&](const Extent& x) {
        return indexed("params", x.index / arrays, "") + " array " +
               std::to_string(x.index % arrays) + " (payload bytes [" + std::to_string(x.begin) +
               ", " + std::to_string(x.end) + "))";
      };
      corrupt(name, label(next) + " overlaps " + label(prev));
    }
  }
  return out;
}

ParsedFile parse_prefix(std::span<const std::byte> prefix, std::uint64_t size,
                        const std::string& name, std::uint32_t* payload_crc) {
  if (size < kPreambleBytes)
    corrupt(name, size == 0 ? std::string("the file is empty")
                            : "the file is " + std::to_string(size) + " bytes, shorter than the " +
                                  std::to_string(kPreambleBytes) + "-byte preamble (truncated)");
  if (prefix.size() < kPreambleBytes)
    throw Error(Errc::internal, "prefix", name + ": parse_prefix given less than the preamble");
  if (std::memcmp(prefix.data(), kMagic, sizeof kMagic) != 0)
    corrupt(name, "not a stepcore checkpoint (the magic is not \"STEPCKPT\")");
  const Preamble pre = decode_preamble(prefix.data());
  if (pre.version != kFormatVersion && pre.version != kFormatVersion2 &&
      pre.version != kFormatVersion1)
    corrupt(name, "format version " + std::to_string(pre.version) + ", this build reads " +
                      kReadableVersions);
  if (pre.reserved != 0)
    corrupt(name, "the reserved preamble field is " + hex32(pre.reserved) + ", not 0");

  if (pre.header_length > size - kPreambleBytes)
    corrupt(name, "the header length " + std::to_string(pre.header_length) +
                      " runs past the end of the " + std::to_string(size) + "-byte file");
  std::uint64_t payload_start, file_end;
  if (!align_up(kPreambleBytes + pre.header_length, &payload_start) ||
      __builtin_add_overflow(payload_start, pre.payload_length, &file_end) || file_end != size)
    corrupt(name, "the header length " + std::to_string(pre.header_length) +
                      " and the payload length " + std::to_string(pre.payload_length) +
                      " do not add up to the file's " + std::to_string(size) +
                      " bytes (truncated?)");
  if (prefix.size() < payload_start)
    throw Error(Errc::internal, "prefix", name + ": parse_prefix given less than the header");

  const std::span<const std::byte> header = prefix.subspan(kPreambleBytes, pre.header_length);
  const std::span<const std::byte> padding = prefix.subspan(
      kPreambleBytes + pre.header_length, payload_start - kPreambleBytes - pre.header_length);
  if (std::any_of(padding.begin(), padding.end(), [](std::byte b) { return b != std::byte{0}; }))
    corrupt(name, "the padding between the header and the payload is not zero");
  const std::uint32_t header_crc = crc32c(header);
  if (header_crc != pre.header_crc)
    corrupt(name, "header checksum mismatch (CRC-32C " + hex32(header_crc) +
                      ", the preamble says " + hex32(pre.header_crc) + ")");
  ParsedFile out = parse_header(header, pre.payload_length, name, pre.version);
  out.payload_start = payload_start;
  *payload_crc = pre.payload_crc;
  return out;
}

ParsedFile parse_prefix(std::span<const std::byte> bytes, const std::string& name,
                        std::uint32_t* payload_crc) {
  return parse_prefix(bytes, bytes.size(), name, payload_crc);
}

std::uint64_t prefix_bytes(std::span<const std::byte> preamble, std::uint64_t size) {
  if (preamble.size() < kPreambleBytes || size < kPreambleBytes) return preamble.size();
  const std::uint64_t header_length = decode_preamble(preamble.data()).header_length;
  std::uint64_t start;
  if (header_length <= size - kPreambleBytes && align_up(kPreambleBytes + header_length, &start) &&
      start <= size)
    return start;
  return preamble.size();  // parse_prefix refuses the file from its preamble
}

void check_payload_crc(std::uint32_t got, std::uint32_t wanted, const std::string& name) {
  if (got != wanted)
    corrupt(name, "payload checksum mismatch (CRC-32C " + hex32(got) + ", the preamble says " +
                      hex32(wanted) + ")");
}

ParsedFile parse(std::span<const std::byte> bytes, const std::string& name) {
  std::uint32_t wanted = 0;
  ParsedFile out = parse_prefix(bytes, name, &wanted);
  check_payload_crc(crc32c(bytes.subspan(out.payload_start)), wanted, name);
  return out;
}

}  // namespace stepcore::detail::checkpoint
