// libFuzzer harness: stepcore-diff's safetensors reader (tools/diff) on any bytes, written
// to a file in /dev/shm (the reader maps files). Either InputError (naming the file) or a
// file whose every tensor lies inside the data with the size its dtype and shape give and
// no two non-empty tensors overlapping; such a file compared with itself is identical.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "diff/diff.hpp"
#include "diff/error.hpp"
#include "diff/inputs.hpp"
#include "diff/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path =
      "/dev/shm/stepcore-fuzz-" + std::to_string(getpid()) + ".safetensors";
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    if (size != 0 && std::fwrite(data, 1, size, f) != size) __builtin_trap();
    std::fclose(f);
  } else {
    __builtin_trap();
  }
  try {
    const stepcore_diff::SafetensorsFile file(path);
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
    const stepcore_diff::Input in = stepcore_diff::load_input(path);
    const stepcore_diff::DiffResult r = stepcore_diff::diff_inputs(in, in, {});
    if (r.exit_status() != 0) __builtin_trap();  // a file against itself
  } catch (const stepcore_diff::InputError&) {
    // refused, naming the file: the expected outcome for most inputs
  }
  return 0;
}
