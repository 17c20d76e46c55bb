// The optimizer keyword arguments of stepcore._core's entry points (the CPU engine, the
// GPU launchers): one parser of `formula` and one AdamWConfig builder, which the library
// then validates (its errors name the fields: 'lr', 'beta1', ...).
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "stepcore/optim.hpp"

namespace stepcore::python {

namespace nb = nanobind;

/// Returns the formula named "torch" or "native"; else ValueError naming 'formula'.
inline AdamWFormula parse_formula(const std::string& name) {
  if (name == "torch") return AdamWFormula::torch;
  if (name == "native") return AdamWFormula::native;
  throw nb::value_error(
      ("stepcore: invalid_argument in 'formula': '" + name + "': expected 'torch' or 'native'")
          .c_str());
}

/// Returns the AdamW configuration of the keyword arguments (unvalidated: the call that
/// takes it validates every field before writing anything).
inline AdamWConfig adamw_config(double lr, double beta1, double beta2, double eps,
                                double weight_decay, const std::string& formula,
                                int torch_tail_width) {
  AdamWConfig config;
  config.lr = lr;
  config.beta1 = beta1;
  config.beta2 = beta2;
  config.eps = eps;
  config.weight_decay = weight_decay;
  config.formula = parse_formula(formula);
  config.torch_tail_width = torch_tail_width;
  return config;
}

}  // namespace stepcore::python
