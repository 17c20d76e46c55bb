// OptimizerTraits (stepcore/optim.hpp), the one list of each optimizer's name and
// hyper-parameters that the units, managers, checkpoints and Python binding read: names
// distinct across optimizers, fields distinct and each setting its own member, lr and
// weight_decay present as schedule fields, betas-role fields exactly the Adam family's.
#include <gtest/gtest.h>

#include <cstddef>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "core/optimizers/all.hpp"
#include "managers/optimizer.hpp"
#include "stepcore/optim.hpp"

namespace {

using stepcore::HyperRole;
using stepcore::OptimizerConfig;
using stepcore::OptimizerTraits;

template <class... Units>
std::set<std::string> check_units(stepcore::detail::UnitList<Units...>) {
  std::set<std::string> names;
  const auto one = [&](auto unit) {
    using Unit = decltype(unit);
    using C = typename Unit::Config;
    const std::string name = OptimizerTraits<C>::kName;
    EXPECT_EQ(std::string_view(Unit::kName), name);
    EXPECT_TRUE(names.insert(name).second) << name << " names two optimizers";
    std::set<std::string> fields;
    std::set<std::ptrdiff_t> offsets;  // each member once
    std::set<std::string> schedule, betas;
    C c{};
    for (const auto& f : OptimizerTraits<C>::kFields) {
      EXPECT_TRUE(fields.insert(f.name).second) << name << ": field " << f.name << " twice";
      std::visit(
          [&](auto m) {
            const auto at =
                reinterpret_cast<const char*>(&(c.*m)) - reinterpret_cast<const char*>(&c);
            EXPECT_TRUE(offsets.insert(at).second)
                << name << ": field " << f.name << " sets a member another field sets";
          },
          f.member);
      if (f.role == HyperRole::schedule) schedule.insert(f.name);
      if (f.role == HyperRole::betas) betas.insert(f.name);
    }
    EXPECT_EQ(schedule, (std::set<std::string>{"lr", "weight_decay"})) << name;
    // The groups carry betas and eps exactly where the managers copy them (kHasBetas).
    if (stepcore::detail::kHasBetas<C>)
      EXPECT_EQ(betas, (std::set<std::string>{"beta1", "beta2", "eps"})) << name;
    else
      EXPECT_TRUE(betas.empty()) << name;
  };
  (one(Units{}), ...);
  return names;
}

TEST(OptimizerTraits, NamesAndFieldsAreDistinctAndRolesMatchTheGroups) {
  const std::set<std::string> names = check_units(stepcore::detail::AllUnits{});
  EXPECT_EQ(names.size(), std::variant_size_v<OptimizerConfig>);
}

// Every field round-trips through the managers' table by name: set to a distinct value,
// read back the same (the table and the members agree).
TEST(OptimizerTraits, EveryFieldSetsAndReadsItsOwnMember) {
  for (std::size_t i = 0; i < std::variant_size_v<OptimizerConfig>; ++i) {
    OptimizerConfig config = [&]<std::size_t... I>(std::index_sequence<I...>) {
      OptimizerConfig out;
      ((I == i ? (out = OptimizerConfig(std::in_place_index<I>), 0) : 0), ...);
      return out;
    }
    (std::make_index_sequence<std::variant_size_v<OptimizerConfig>>{});
    const auto fields = stepcore::detail::config_fields(config);
    double v = 2.0;
    for (const auto& f : fields) {
      const bool flag = f.value == 0.0 || f.value == 1.0;
      const double want = flag ? 1.0 - f.value : (v += 1.0);  // flags stay flags
      stepcore::detail::set_config_field(config, f.name, want, "x");
      bool seen = false;
      for (const auto& g : stepcore::detail::config_fields(config))
        if (g.name == f.name) {
          EXPECT_EQ(g.value, want) << stepcore::optimizer_name(config) << "." << f.name;
          seen = true;
        }
      EXPECT_TRUE(seen);
    }
  }
}

}  // namespace
