// stepcore-diff's entry point as a function, so that tests can run the whole program
// with an argv and read what it prints.
#pragma once

#include <ostream>

namespace stepcore_diff {

/// Runs `stepcore-diff argv[1..argc)`: parses the options, loads and validates both
/// inputs, compares, and prints the report on `out` (human or --json); errors go to
/// `err`, and nothing is printed on `out` before both inputs are loaded and checked.
/// Returns the exit status: 0 identical (or all within --max-ulps), 1 different,
/// 2 bad arguments or an unreadable or corrupt input.
int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace stepcore_diff
