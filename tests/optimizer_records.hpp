// Builders of the generic optimizer record (OptimizerTensor) for the two layouts most tests
// use: AdamW's (state[0] exp_avg, state[1] exp_avg_sq, a step counter) and SignSGD's (the
// parameter alone: no state slot, no counter).
#pragma once

#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace test_support {

using stepcore::ConstTensorView;
using stepcore::OptimizerTensor;
using stepcore::TensorView;

/// Returns an AdamW tensor (two state slots, a step counter), in place.
inline OptimizerTensor adamw_tensor(TensorView param, TensorView exp_avg, TensorView exp_avg_sq,
                                    float* step, ConstTensorView grad,
                                    TensorView compute_param = {}) {
  OptimizerTensor t;
  t.param = param;
  t.state[0] = exp_avg;
  t.state[1] = exp_avg_sq;
  t.step = step;
  t.grad = grad;
  t.compute_param = compute_param;
  return t;
}

/// Returns a SignSGD tensor (no state slot, no step counter), in place.
inline OptimizerTensor sign_sgd_tensor(TensorView param, ConstTensorView grad,
                                       TensorView compute_param = {}) {
  OptimizerTensor t;
  t.param = param;
  t.grad = grad;
  t.compute_param = compute_param;
  return t;
}

}  // namespace test_support
