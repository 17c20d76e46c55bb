// libFuzzer harness: the comparer's readers (diff/) on any bytes. (1) The bytes as
// a safetensors file in /dev/shm (read through FileBytes): either InputError (naming the
// file) or a file whose every tensor lies inside the data with the size its dtype and
// shape give and no two non-empty tensors overlapping; such a file compared with itself
// is identical. (2) The bytes as a recording's journal (parse_journal, then a version-2
// recording whose step file holds a few small tensors, so lines may name them with or
// without a placement and exercise the gathering of shards): either InputError or
// entries that are objects, at most one per newline, and a recording identical to itself.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "diff/diff.hpp"
#include "diff/inputs.hpp"
#include "diff/safetensors.hpp"
#include "stepcore/diff.hpp"

namespace {

void write_file(const std::string& path, const void* data, std::size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) __builtin_trap();
  if (size != 0 && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
}

// A version-2 recording in /dev/shm whose step file has F32 tensors "p/a" [2], "p/b" [2, 2]
// and "p/c" [3] (the journal is written per input). Returns its directory.
std::string recording_dir() {
  const std::string dir = "/dev/shm/stepcore-fuzz-rec-" + std::to_string(getpid());
  ::mkdir(dir.c_str(), 0700);
  const std::string manifest =
      "{\"format\": \"stepcore-recording\", \"version\": 2, \"journal\": \"entries.jsonl\"}\n";
  write_file(dir + "/manifest.json", manifest.data(), manifest.size());
  std::string header =
      "{\"p/a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"p/b\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[8,24]},"
      "\"p/c\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[24,36]}}";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  bytes += header;
  for (int i = 0; i < 36; ++i) bytes += static_cast<char>(i % 5 == 0 ? 0x3F : i);
  write_file(dir + "/step000001-rank0.safetensors", bytes.data(), bytes.size());
  write_file(dir + "/step000001-rank1.safetensors", bytes.data(), bytes.size());
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path =
      "/dev/shm/stepcore-fuzz-" + std::to_string(getpid()) + ".safetensors";
  write_file(path, data, size);
  try {
    const stepcore::diff::SafetensorsFile file(path);
    std::uint64_t data_bytes = size;  // at most: the data start is past the header
    for (const auto& t : file.tensors()) {
      if (t.begin > t.end || t.end > data_bytes) __builtin_trap();
      std::uint64_t n = 1;
      for (std::int64_t d : t.shape) {
        if (d < 0) __builtin_trap();
        n *= static_cast<std::uint64_t>(d);
      }
      if (n != t.elements) __builtin_trap();
    }
    const stepcore::diff::Input in = stepcore::diff::load_input(path);
    const stepcore::diff::DiffResult r = stepcore::diff::diff_inputs(in, in, {});
    if (r.exit_status() != 0) __builtin_trap();  // a file against itself
  } catch (const stepcore::diff::InputError&) {
    // refused, naming the file: the expected outcome for most inputs
  }

  // The same bytes as a journal.
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto entries = stepcore::diff::parse_journal(text, "journal");
    if (entries.size() > static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')))
      __builtin_trap();
    for (const auto& e : entries)
      if (!e.is_object()) __builtin_trap();
  } catch (const stepcore::diff::InputError&) {
  }
  static const std::string dir = recording_dir();
  write_file(dir + "/entries.jsonl", data, size);
  try {
    const stepcore::diff::Input in = stepcore::diff::load_input(dir);
    for (const auto& item : in.items)
      if (item.tensor == nullptr || item.data == nullptr) __builtin_trap();
    const stepcore::diff::DiffResult r = stepcore::diff::diff_inputs(in, in, {});
    if (r.exit_status() != 0) __builtin_trap();  // a recording against itself
  } catch (const stepcore::diff::InputError&) {
  }
  return 0;
}
