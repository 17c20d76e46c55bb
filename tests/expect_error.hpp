// The one check every test uses for a refused call: it must throw stepcore::Error with
// the expected code, naming the expected argument. Checks that nothing changed stay with
// the caller (they know what was passed).
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "stepcore/error.hpp"

namespace test_support {

using stepcore::Errc;
using stepcore::errc_name;
using stepcore::Error;

/// The argument names a refusal may carry: one ("scale"), any of several
/// ({"tensors[0]", "tensors"}), or none given ("" or {}): any argument.
struct ArgumentNames {
  ArgumentNames() = default;
  ArgumentNames(const char* one) : ArgumentNames(std::string(one)) {}
  ArgumentNames(std::string one) {
    if (!one.empty()) names.push_back(std::move(one));
  }
  ArgumentNames(std::initializer_list<std::string> any) : names(any) {}
  ArgumentNames(std::vector<std::string> any) : names(std::move(any)) {}
  std::vector<std::string> names;
};

/// Runs f, which must throw stepcore::Error with `code` whose argument() is one of
/// `arguments` (any argument when none are given); a failure names what was expected.
template <class F>
void expect_error(F&& f, Errc code, const ArgumentNames& arguments = {}) {
  const std::string want =
      arguments.names.empty() ? "any argument" : "'" + arguments.names[0] + "'";
  try {
    std::forward<F>(f)();
    ADD_FAILURE() << "no exception; expected " << errc_name(code) << " naming " << want;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    bool named = arguments.names.empty();
    for (const std::string& a : arguments.names) named = named || e.argument() == a;
    EXPECT_TRUE(named) << "argument() = '" << e.argument() << "', expected " << want << " ("
                       << e.what() << ")";
  }
}

}  // namespace test_support
