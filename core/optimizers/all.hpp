// Every optimizer unit the library builds: the engines instantiate their kernels for
// each (adding a unit adds it here; docs/adding-an-optimizer.md).
#pragma once

#include "core/optimizers/adamw.hpp"
#include "core/optimizers/sign_sgd.hpp"
#include "core/optimizers/unit.hpp"

namespace stepcore::detail {

using AllUnits = UnitList<AdamW, SignSgd>;

}  // namespace stepcore::detail
