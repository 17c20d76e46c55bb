// The two ways stepcore-diff refuses to compare, both exit status 2: bad input (a file
// or directory that is missing, unreadable or corrupt; the message names it and what is
// wrong) and a bad command line.
#pragma once

#include <stdexcept>
#include <string>

namespace stepcore_diff {

/// An unreadable or corrupt input: what() is "<path>: <what is wrong>".
struct InputError : std::runtime_error {
  InputError(const std::string& path, const std::string& problem)
      : std::runtime_error(path + ": " + problem) {}
};

/// A bad command line: what() says which argument and why.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace stepcore_diff
