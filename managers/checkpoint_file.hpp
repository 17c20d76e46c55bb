// The checkpoint file of one rank (docs/checkpoint.md is the format): what a gradient
// manager's save_checkpoint writes and load_checkpoint reads — a versioned header (the
// optimizer by name with its fixed hyper-parameters and state slot names, the parameter
// groups, every parameter's name, size, group and step counter) and the f32 arrays (the
// master, then each state slot) — written atomically and verified completely (sizes,
// offsets, checksums) before anything is handed to the manager: by File, which holds the
// whole file, or by the streamed load's two passes (verify, then import_pass), which hold
// a few pieces of it (managers/checkpoint_buffers.hpp). Version 1 files (AdamW or
// SignSGD, the optimizer as a number) are read as their version 2 equivalent; version 2
// files have no 8-bit state (version 3 records each parameter's, and its arrays). The layout
// and the records are managers/checkpoint_format.hpp's; save is checkpoint_writer.cpp,
// parse checkpoint_parser.cpp, File and the streamed passes checkpoint_reader.cpp,
// check_compatible
// checkpoint_compatible.cpp; the save faults are managers/testing.hpp's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "managers/checkpoint_buffers.hpp"
#include "managers/checkpoint_format.hpp"

namespace stepcore::detail {
class FileReader;
}  // namespace stepcore::detail

namespace stepcore::detail::checkpoint {

/// Supplies array `a` of parameter `i` (array_shape: 0 the master, then the slots, then
/// version 3's block maxima) as its bytes: elements × width, valid until the next call (a
/// view of host state, or a copy the source owns).
using ArraySource = std::function<std::span<const std::byte>(std::size_t i, std::size_t a)>;

/// Writes `header` and the arrays `source` supplies (params in order, arrays in order) to
/// `path`, atomically: a temporary file in the same directory, written in full (short
/// writes and EINTR retried; on the calling thread, the payload CRC on a helper thread),
/// fsync'ed, renamed over `path`, then the directory fsync'ed.
/// On any failure the temporary file is removed and `path` is what it was before
/// (Errc::io_error naming "path" with the system's reason). Throws Errc::invalid_argument
/// for a header that cannot be written (more than kMaxSlots slots or kMaxHyper
/// hyper-parameters, an empty or repeated slot name, a group index out of range,
/// duplicate parameter names) before creating anything, and naming "source" for a source span of
/// the wrong size (found while writing, each array is read once; the temporary file is
/// removed and `path` is untouched).
void save(const std::string& path, const Header& header, const ArraySource& source);

/// Supplies elements [offset, offset + count) of array `a` of parameter `i`: count × width
/// bytes (array_shape), valid until the next call.
using RangeSource = std::function<std::span<const std::byte>(
    std::size_t i, std::size_t a, std::size_t offset, std::size_t count)>;

/// save, with each array asked for in ranges of at most `range_elements` floats (> 0), in
/// order: what a source that copies state out uses to bound its buffers. A span of the
/// wrong size is Errc::invalid_argument naming "source", as above.
void save(const std::string& path, const Header& header, const RangeSource& source,
          std::size_t range_elements);

/// A checkpoint file, opened and verified: magic, format version, every length and offset
/// inside the file, no two arrays overlapping, the header's and the payload's CRC-32C.
/// Any disagreement is Errc::corrupt_file naming "path" and what is wrong (a file that
/// cannot be opened or read, or that shrinks while read: Errc::io_error). The arrays are
/// read-only views of the file's contents, valid while the File lives.
class File {
 public:
  /// Reads and verifies the file in one pass (the payload's CRC folded on a helper thread
  /// while the next piece is read). With `scan_values`, the same pass scans every array's
  /// values for values_clean.
  static File open(const std::string& path, bool scan_values = false);
  ~File();
  File(File&&) noexcept;
  File& operator=(File&&) noexcept;

  const Header& header() const noexcept;
  /// Returns array `a` of parameter `i` (a < header().arrays()) as f32 values (array_shape's
  /// elements; an array of codes is Errc::invalid_argument naming "a").
  std::span<const float> array(std::size_t i, std::size_t a) const;
  /// Returns array `a` of parameter `i` as its bytes (array_shape's elements × width).
  std::span<const std::byte> bytes(std::size_t i, std::size_t a) const;
  /// Returns true when open's value scan found array `a` of parameter `i` free of NaN and
  /// Inf (and, for a slot that is never negative — slot_non_negative — of values below
  /// -0); false when it found one, or when open was not asked to scan.
  bool values_clean(std::size_t i, std::size_t a) const noexcept;

 private:
  struct Impl;
  explicit File(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// A file's bytes, verified: the header and where each array lies.
struct ParsedFile {
  Header header;
  std::uint64_t payload_start = 0;  ///< file offset of the payload (a multiple of 64)
  /// Offset of array a of parameter i from the payload start, at [i * header.arrays() + a].
  std::vector<std::uint64_t> array_offsets;
};

/// Verifies `bytes` as a whole file, everything File::open verifies, and returns what it
/// holds; `name` (the path) names the file in the errors (Errc::corrupt_file naming
/// "path"). A pure function of `bytes` that never reads outside them, for any input:
/// tests and fuzzers call it directly.
ParsedFile parse(std::span<const std::byte> bytes, const std::string& name);

/// Verifies the binary header alone (its bytes between the preamble and the payload,
/// `payload_length` the payload's size; no checksum) of format `version` (kFormatVersion1
/// or kFormatVersion; another is Errc::corrupt_file) and returns it, payload_start 0.
/// What parse does after the checksums agree: a fuzzer's way past the CRC.
ParsedFile parse_header(std::span<const std::byte> header_bytes, std::uint64_t payload_length,
                        const std::string& name, std::uint32_t version = kFormatVersion);

/// Everything parse verifies but the payload's checksum, from the bytes before the payload
/// alone (`bytes` spans the whole file, whose payload need not be read yet): returns what
/// the header holds and sets `payload_crc` to the checksum the preamble records for the
/// payload. File::open's first step.
ParsedFile parse_prefix(std::span<const std::byte> bytes, const std::string& name,
                        std::uint32_t* payload_crc);

/// parse_prefix of a file of `file_size` bytes of which `prefix` holds the first ones:
/// all of them when there are fewer than kPreambleBytes; else at least kPreambleBytes,
/// and the whole of [0, payload start) when the preamble's header length fits the file
/// (payload start = kPreambleBytes + header length rounded up to kPayloadAlignment, at
/// most file_size). Never reads past `prefix`.
ParsedFile parse_prefix(std::span<const std::byte> prefix, std::uint64_t file_size,
                        const std::string& name, std::uint32_t* payload_crc);

/// Returns how many of a file's first bytes parse_prefix needs, given its size and its
/// first min(size, kPreambleBytes) bytes `preamble`: the payload's start, or what is
/// already there when the preamble does not describe a file of that size.
std::uint64_t prefix_bytes(std::span<const std::byte> preamble, std::uint64_t file_size);

/// Throws Errc::corrupt_file naming "path" (the file `name`) unless the payload's
/// checksum `got` is the one its preamble records, `wanted`.
void check_payload_crc(std::uint32_t got, std::uint32_t wanted, const std::string& name);

// ---- the streamed load: two passes over the file, a few pieces in memory ---------------

/// A file as the streamed load reads it.
struct ByteSource {
  std::uint64_t size = 0;  ///< the file's size when it was opened
  /// Reads bytes [from, to) (to <= size) into dst[0, to - from); called by several
  /// threads at once for disjoint ranges. Throws (Errc::io_error naming "path") when it
  /// cannot.
  std::function<void(std::byte* dst, std::uint64_t from, std::uint64_t to)> read;
  /// Throws unless the file's size is still `size` (empty: nothing to check).
  std::function<void()> check_size;
};

/// `file`'s bytes through its reader (host/file_reader.hpp), which must outlive the
/// source.
ByteSource source_of(const FileReader& file);

/// What the verifying pass found: the header and the arrays' places, the checksums the
/// importing pass checks again, and the first bad value of each array.
struct Verified {
  static constexpr std::uint64_t kClean = ~std::uint64_t{0};
  ParsedFile parsed;
  std::uint64_t size = 0;        ///< the file's size
  std::uint32_t prefix_crc = 0;  ///< CRC-32C of the preamble, header and padding
  /// CRC-32C of each block of the payload: block k is payload bytes
  /// [k * kLoadPieceBytes, (k + 1) * kLoadPieceBytes), the last one shorter.
  std::vector<std::uint32_t> block_crcs;
  /// Per array ([i * arrays + a]): the index of its first element that is NaN or Inf
  /// (or, for a slot that is never negative — slot_non_negative — below -0), or kClean.
  std::vector<std::uint64_t> first_bad;
  /// Per array: that element's value (0 where clean).
  std::vector<float> first_bad_value;
};

/// The verifying pass: reads `file` once, front to back in pieces of kLoadPieceBytes
/// (kLoadPieces of them in memory at once, the next ones read by helper threads while
/// one is checked), and verifies everything File::open does (the same errors, `name`
/// naming the file), scans every value and records each block's checksum. The header is
/// read whole (its size is the file's metadata, not its state).
Verified verify(const ByteSource& file, const std::string& name);

/// Receives elements [offset, offset + n) of array `a` of parameter `i` as their bytes
/// (n × the array's width, array_shape).
using RangeSink = std::function<void(std::size_t i, std::size_t a, std::uint64_t offset,
                                     std::span<const std::byte> values)>;

/// The importing pass: reads `file` again in pieces, as verify does, and hands every
/// array's values to `take` in the file's order, the values of each block only once that
/// block's bytes have the checksum `verified` recorded (and, before the first block, the
/// file its size and the header its checksum). A difference is Errc::corrupt_file naming
/// "path" (a file that shrank or grew, or cannot be read: Errc::io_error), `take` having
/// been called for the blocks before it.
void import_pass(const ByteSource& file, const Verified& verified, const std::string& name,
                 const RangeSink& take);

/// Throws unless the file's header (`file`, read from `path`) can be loaded by the manager
/// whose header is `mine`: the same optimizer ("checkpoint.optimizer"), the same state
/// slots by name and order ("checkpoint.slots"), the same hyper-parameters, each recorded
/// in both with the same bits ("checkpoint.hyper.<name>"); the same groups (count, names,
/// betas and eps; lr and weight decay may differ: they are the schedule's state and are
/// restored); the same rank, world size and layout fingerprint; the same parameters
/// (count, and each one's name, numel, group and state: 8-bit or f32 slots). The error
/// names the first difference,
/// e.g. Errc::invalid_argument naming "checkpoint.params[3].name" with "'w2' in <path>,
/// 'w3' in this manager"; differing sizes are Errc::size_mismatch.
void check_compatible(const Header& file, const Header& mine, const std::string& path);

}  // namespace stepcore::detail::checkpoint
