// Every optimizer unit the library builds: the engines instantiate their kernels for
// each (adding a unit adds it here; docs/adding-an-optimizer.md).
#pragma once

#include "core/optimizers/adagrad.hpp"
#include "core/optimizers/adam.hpp"
#include "core/optimizers/adamw.hpp"
#include "core/optimizers/sgd.hpp"
#include "core/optimizers/sign_sgd.hpp"
#include "core/optimizers/unit.hpp"

namespace stepcore::detail {

using AllUnits = UnitList<AdamW, SignSgd, Adam, Sgd, Adagrad>;

}  // namespace stepcore::detail
