// The two kinds of input stepcore-diff compares, loaded and validated whole before any
// comparison: a safetensors file (its tensors in ascending data offset) or a recording
// (a directory whose manifest.json lists entries in recording order, each a key in one
// of its safetensors files).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "safetensors.hpp"

namespace stepcore_diff {

/// One tensor of an input. Recording entries carry step, rank and point; a file's
/// tensors do not (and their key is their name).
struct Item {
  std::optional<std::int64_t> step;
  std::optional<std::int64_t> rank;
  std::optional<std::string> point;
  std::string name;
  std::string key;
  const SafetensorsFile* file = nullptr;
  const TensorInfo* tensor = nullptr;
};

enum class InputKind { safetensors, recording };

/// A loaded input; its files stay mapped while it lives (items point into them).
struct Input {
  InputKind kind = InputKind::safetensors;
  std::string path;
  std::vector<Item> items;  ///< recording order, or ascending data offset
  std::vector<std::unique_ptr<SafetensorsFile>> files;
};

/// Loads `path`: a directory is a recording, a regular file a safetensors file. Throws
/// InputError naming the path (or the manifest, or the entry's file) and the problem:
/// the path is missing or neither; the manifest is missing, not valid JSON, not an
/// object, of another format or version, or malformed; an entry repeats another's
/// (step, rank, point, name), names a file that is missing or corrupt, a key that is not
/// in it, or a dtype/shape that disagrees with the file's header.
Input load_input(const std::string& path);

/// Loads the recording in the directory `dir` (see load_input).
Input load_recording(const std::string& dir);

/// Loads the safetensors file `path` (see load_input).
Input load_safetensors(const std::string& path);

/// "step 2, rank 0, point after_step, name w" for a recording entry; "name w" for a file's.
std::string item_label(const Item& item);

}  // namespace stepcore_diff
