// Every optimizer unit the library builds: the engines instantiate their kernels for
// each (adding a unit adds it here; docs/adding-an-optimizer.md).
#pragma once

#include <type_traits>
#include <variant>

#include "core/optimizers/adagrad.hpp"
#include "core/optimizers/adam.hpp"
#include "core/optimizers/adamw.hpp"
#include "core/optimizers/lion.hpp"
#include "core/optimizers/sgd.hpp"
#include "core/optimizers/sign_sgd.hpp"
#include "core/optimizers/unit.hpp"

namespace stepcore::detail {

using AllUnits = UnitList<AdamW, SignSgd, Adam, Sgd, Adagrad, Lion>;

/// OptimizerConfig (stepcore/optim.hpp) holds the units' configurations in AllUnits'
/// order: alternative i is unit i's Config.
template <class List, class Variant>
inline constexpr bool kConfigsMatch = false;
template <class... Units>
inline constexpr bool kConfigsMatch<UnitList<Units...>, OptimizerConfig> =
    std::is_same_v<OptimizerConfig, std::variant<typename Units::Config...>>;
static_assert(kConfigsMatch<AllUnits, OptimizerConfig>,
              "OptimizerConfig must list every unit's Config in AllUnits' order");

}  // namespace stepcore::detail
