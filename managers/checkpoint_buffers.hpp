// The bounded buffers of a checkpoint's save and load (managers/checkpoint.cpp,
// checkpoint_reader.cpp, checkpoint_writer.cpp): the most host memory a save or a load holds
// beyond the manager's own, whatever the model's size (docs/checkpoint.md), for memory
// accounting.
#pragma once

#include <cstddef>
#include <cstdint>

namespace stepcore::detail::checkpoint {

/// Bytes of one read of a load, and the block of the payload whose CRC-32C the verifying
/// pass records and the importing pass checks again before it imports the block.
inline constexpr std::size_t kLoadPieceBytes = std::size_t{4} << 20;
/// Pieces a load holds at once: the one being checked or imported and those read ahead.
inline constexpr std::size_t kLoadPieces = 4;
/// A load's buffers: its pieces, and one piece more for the mode's staging of one range
/// (compute weights rounded from a range of the master: at most a piece). 20 MiB.
inline constexpr std::size_t kLoadBufferBytes = (kLoadPieces + 1) * kLoadPieceBytes;

/// Bytes of the verifying pass's table of block checksums for a payload of
/// `payload_bytes`: 4 per block of kLoadPieceBytes (1 byte per MiB of payload).
constexpr std::uint64_t load_block_table_bytes(std::uint64_t payload_bytes) noexcept {
  return (payload_bytes + kLoadPieceBytes - 1) / kLoadPieceBytes * 4;
}

/// Bytes of device-resident state a save copies out at once (a range of one array), two
/// ranges in turn (one written while the next is copied).
inline constexpr std::size_t kSavePieceBytes = std::size_t{8} << 20;
/// The writer's buffer, where small pieces of the file are gathered into one write.
inline constexpr std::size_t kWriteBufferBytes = std::size_t{1} << 20;
/// A save's buffers: two ranges of device state and the writer's buffer. 17 MiB.
inline constexpr std::size_t kSaveBufferBytes = 2 * kSavePieceBytes + kWriteBufferBytes;

}  // namespace stepcore::detail::checkpoint
