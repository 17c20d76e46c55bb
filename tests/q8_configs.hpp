// The AdamW configurations the 8-bit state tests step (docs/numerics.md 8f): the native,
// torch and torchao formulas, torch's and torchao's with amsgrad (torch's also with
// maximize), decay on without amsgrad.
#pragma once

#include <vector>

#include "stepcore/optim.hpp"

namespace stepcore::testing_support {

inline std::vector<AdamWConfig> q8_adamw_configs() {
  std::vector<AdamWConfig> cs;
  for (AdamWFormula f : {AdamWFormula::native, AdamWFormula::torch, AdamWFormula::torchao})
    for (bool ams : {false, true}) {
      if (ams && f == AdamWFormula::native) continue;
      AdamWConfig c;
      c.formula = f;
      c.amsgrad = ams;
      c.lr = 1e-2;
      c.weight_decay = ams ? 0.0 : 0.1;
      c.maximize = f == AdamWFormula::torch && ams;
      c.torch_v_first = false;
      c.torch_tail_width = 8;
      cs.push_back(c);
    }
  return cs;
}

}  // namespace stepcore::testing_support
