// The Python binding's optimizer table (python/src/optimizer_table.hpp) against the units:
// each OptimizerConfig alternative's Python name is its unit's kName (core/optimizers/), and
// each table's keys are distinct and name distinct members.
#include <gtest/gtest.h>

#include <cstddef>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

#include "core/optimizers/all.hpp"
#include "python/src/optimizer_table.hpp"
#include "stepcore/optim.hpp"

namespace {

using stepcore::OptimizerConfig;
using stepcore::python::OptimizerFields;

template <class... Units>
std::size_t check_names(stepcore::detail::UnitList<Units...>) {
  std::size_t i = 0;
  const auto one = [&](auto unit) {
    using Unit = decltype(unit);
    using C = typename Unit::Config;
    EXPECT_EQ(std::string_view(OptimizerFields<C>::kName), std::string_view(Unit::kName))
        << "alternative " << i;
    std::set<std::string> keys;
    std::set<std::string> members;  // each member once: its address as text
    const C c{};
    for (const auto& f : OptimizerFields<C>::kFields) {
      EXPECT_TRUE(keys.insert(f.key).second) << Unit::kName << ": key " << f.key << " twice";
      std::visit(
          [&](auto m) {
            const auto* addr = reinterpret_cast<const char*>(&(c.*m));
            const auto offset = addr - reinterpret_cast<const char*>(&c);
            EXPECT_TRUE(members.insert(std::to_string(offset)).second)
                << Unit::kName << ": key " << f.key << " sets a member another key sets";
          },
          f.member);
    }
    ++i;
  };
  (one(Units{}), ...);
  return i;
}

TEST(PythonOptimizerTable, NamesAreTheUnitsAndKeysAreDistinct) {
  const std::size_t n = check_names(stepcore::detail::AllUnits{});
  EXPECT_EQ(n, std::variant_size_v<OptimizerConfig>);
  std::string names;
  stepcore::python::for_each_optimizer([&](auto i) {
    using C = std::variant_alternative_t<decltype(i)::value, OptimizerConfig>;
    names += std::string(names.empty() ? "" : ", ") + OptimizerFields<C>::kName;
  });
  EXPECT_EQ(names, stepcore::python::optimizer_names());
  EXPECT_EQ(names, "adamw, sign_sgd, adam, sgd, adagrad");
}

}  // namespace
