// stepcore-diff's entry point as a function, so that tests can run the whole program
// with an argv and read what it prints; and the same comparison as JSON text for the
// Python binding (python/src/diff_binding.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

namespace stepcore_diff {

/// Runs `stepcore-diff argv[1..argc)`: parses the options, loads and validates both
/// inputs, compares, and prints the report on `out` (human or --json); errors go to
/// `err`, and nothing is printed on `out` before both inputs are loaded and checked.
/// Returns the exit status: 0 identical (or all within --max-ulps), 1 different,
/// 2 bad arguments or an unreadable or corrupt input.
int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// The comparison of the paths `a` and `b` (what `run` loads and compares) for the Python
/// package, as one JSON text: {"kind": "recording" or "file", "runs": [A's run metadata,
/// B's] (nulls for files), "result": write_json's object, "details": write_details_json's
/// array, "human": write_human's text (every tensor listed with `all`)}. `threads` 0:
/// default_threads(). Throws InputError (a bad input) or UsageError (A and B of
/// different kinds), like `run` before it prints anything.
std::string compare_json(const std::string& a, const std::string& b,
                         std::optional<std::uint64_t> max_ulps, int threads, bool all = false);

}  // namespace stepcore_diff
