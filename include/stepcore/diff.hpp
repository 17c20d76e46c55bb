// The comparer of stepcore-diff (docs/diff.md): two recordings or two safetensors files
// compared bit for bit, and where they first diverge. What a program or a binding calls:
// the whole command line as a function, the same comparison as JSON text, and the two
// ways it refuses to compare. Installed only when the comparer was built (it needs
// nlohmann-json: STEPCORE_DIFF; the package's component `diff`).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>

namespace stepcore::diff {

/// An unreadable or corrupt input (a file or directory that is missing, unreadable or
/// corrupt): what() is "<path>: <what is wrong>". Exit status 2.
struct InputError : std::runtime_error {
  InputError(const std::string& path, const std::string& problem)
      : std::runtime_error(path + ": " + problem) {}
};

/// A bad command line, or A and B of different kinds: what() says which argument and
/// why. Exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Runs `stepcore-diff argv[1..argc)`: parses the options, loads and validates both
/// inputs, compares, and prints the report on `out` (human or --json); errors go to
/// `err`, and nothing is printed on `out` before both inputs are loaded and checked.
/// Returns the exit status: 0 identical (or all within --max-ulps), 1 different,
/// 2 bad arguments or an unreadable or corrupt input.
int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// The comparison of the paths `a` and `b` (what `run` loads and compares) as one JSON
/// text: {"kind": "recording" or "file", "runs": [A's run metadata, B's] (nulls for
/// files), "result": the --json object, "details": each compared tensor's figures,
/// "human": the report's text (every tensor listed with `all`)}. `threads` 0: the CPUs
/// of the affinity mask. Throws InputError (a bad input) or UsageError (A and B of
/// different kinds), like `run` before it prints anything.
std::string compare_json(const std::string& a, const std::string& b,
                         std::optional<std::uint64_t> max_ulps, int threads, bool all = false);

}  // namespace stepcore::diff
