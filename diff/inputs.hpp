// The two kinds of input stepcore-diff compares, loaded and validated whole before any
// comparison: a safetensors file (its tensors in ascending data offset) or a recording
// (a directory whose manifest.json lists entries in recording order, or names the
// journal that does, each a key in one of its safetensors files; the shards of a
// sharded tensor, recorded with their placement, gathered into the whole tensor).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "diff/safetensors.hpp"

namespace stepcore::diff {

/// One tensor of an input. Recording entries carry step, rank and point; a file's
/// tensors do not (and their key is their name). A tensor gathered from the shards of
/// several ranks has rank 0, its first shard's key, and `shards` > 0.
struct Item {
  std::optional<std::int64_t> step;
  std::optional<std::int64_t> rank;
  std::optional<std::string> point;
  std::string name;
  std::string key;
  const TensorInfo* tensor = nullptr;
  const std::byte* data = nullptr;  ///< the tensor's first byte (in a file or a gathered buffer)
  std::uint32_t shards = 0;         ///< how many recorded shards were gathered (0: none)
};

/// A whole tensor gathered from recorded shards: its description and its bytes.
struct GatheredTensor {
  TensorInfo info;
  std::unique_ptr<std::byte[]> bytes;
};

enum class InputKind { safetensors, recording };

/// A loaded input; its files' bytes stay in memory while it lives (items point into them).
struct Input {
  InputKind kind = InputKind::safetensors;
  std::string path;
  std::vector<Item> items;  ///< recording order, or ascending data offset
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<std::unique_ptr<GatheredTensor>> gathered;
  std::string run_json = "{}";  ///< a recording's run metadata (JSON text of an object)
};

/// The entries of a recording's journal (`text`, the file `path`): one JSON object per
/// line, each ended by a newline. A last line without its newline is a write in progress
/// (a torn append) and is ignored. Throws InputError(path, "line N: ...") when a complete
/// line is empty, not valid JSON or not an object.
std::vector<nlohmann::json> parse_journal(std::string_view text, const std::string& path);

/// Loads `path`: a directory is a recording, a regular file a safetensors file. Throws
/// InputError naming the path (or the manifest, or the entry's file) and the problem:
/// the path is missing or neither; the manifest (or its journal) is missing, not valid
/// JSON, not an object, of another format or version, or malformed; an entry repeats
/// another's (step, rank, point, name), names a file that is missing or corrupt, a key
/// that is not in it, or a dtype/shape that disagrees with the file's header; the shards
/// of a tensor disagree on dtype or global shape, lie outside it, leave an element
/// uncovered, or hold different bits for an element two of them cover.
Input load_input(const std::string& path);

/// Loads the recording in the directory `dir` (see load_input).
Input load_recording(const std::string& dir);

/// Loads the safetensors file `path` (see load_input).
Input load_safetensors(const std::string& path);

/// "step 2, rank 0, point after_step, name w" for a recording entry; "name w" for a file's.
std::string item_label(const Item& item);

}  // namespace stepcore::diff
