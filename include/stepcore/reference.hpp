// The scalar reference: docs/numerics.md implemented literally, one element at a
// time, compiled with -ffp-contract=off. It is the oracle every fast path (SIMD
// ISA, thread count, CUDA launch shape) is compared against, bit for bit.
//
// Every function validates all of its arguments first and throws stepcore::Error
// (naming the argument) before writing anything. It is slow by design.
#pragma once

#include <cstdint>
#include <span>

#include "stepcore/determinism.hpp"  // the levels named in "Determinism:" lines
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::reference {

/// One AdamW update (docs/numerics.md 7; amsgrad and maximize: 8a) of every tensor: the
/// param and its state slots exp_avg, exp_avg_sq and, with amsgrad, max_exp_avg_sq
/// (state[0..2]), in place or out of place from param_src / state_src, in f32, bf16 or f16
/// (7.3). Gradients are read with `read`; when `found_inf` is non-null and *found_inf != 0
/// nothing is written (out-of-place destinations included) and no step counter advances.
/// amsgrad and maximize need the torch formula (the native formula refuses them).
/// Determinism: bitwise (the definition itself).
void adamw_step(std::span<const OptimizerTensor> tensors, const AdamWConfig& config,
                GradientRead read = {}, const std::int32_t* found_inf = nullptr);

/// One Adam (L2 weight decay) update of every tensor, torch.optim.Adam(fused=True)'s
/// arithmetic (docs/numerics.md 8a); found_inf and read as adamw_step.
/// Determinism: bitwise (the definition itself).
void adam_step(std::span<const OptimizerTensor> tensors, const AdamConfig& config,
               GradientRead read = {}, const std::int32_t* found_inf = nullptr);

/// One SignSGD update (docs/numerics.md 8) of every tensor: the param alone (no state
/// slot, no step counter), in place or out of place from param_src, in f32, bf16 or f16
/// (7.3: math in f32, the new param rounded once when stored). The positive `read` scale
/// and clip do not change a sign and are not applied (they are still validated: finite,
/// > 0). Determinism: bitwise (the definition itself).
void sign_sgd_step(std::span<const OptimizerTensor> tensors, const SignSgdConfig& config,
                   GradientRead read = {}, const std::int32_t* found_inf = nullptr);

/// One SGD update of every tensor (torch's fused CPU SGD, docs/numerics.md 8b): state[0]
/// is the momentum buffer (empty when momentum == 0; not read on the first step, the
/// call where the step counter becomes 1). In place, or out of place from param_src and
/// state_src[0]. Gradients are read with `read`; when `found_inf` is non-null and
/// *found_inf != 0 nothing is written and no step counter advances.
/// Determinism: bitwise (the definition itself).
void sgd_step(std::span<const OptimizerTensor> tensors, const SgdConfig& config,
              GradientRead read = {}, const std::int32_t* found_inf = nullptr);
/// One Adagrad update (docs/numerics.md 8c: torch.optim.Adagrad(fused=True) on CPU) of
/// every tensor: param and its `sum` (state[0]; state[1], state[2] empty), in place or out
/// of place from param_src / state_src[0]. Gradients are read with `read`; when
/// `found_inf` is non-null and *found_inf != 0 nothing is written and no step counter
/// advances. Determinism: bitwise (the definition itself).
void adagrad_step(std::span<const OptimizerTensor> tensors, const AdagradConfig& config,
                  GradientRead read = {}, const std::int32_t* found_inf = nullptr);

/// One Lion update (docs/numerics.md 8d, stepcore's own definition) of every tensor: param
/// and its exp_avg (state[0]; no step counter), in place or out of place from param_src /
/// state_src[0], in f32, bf16 or f16 (7.3). Gradients are read with `read`; when
/// `found_inf` is non-null and *found_inf != 0 nothing is written.
/// Determinism: bitwise (the definition itself).
void lion_step(std::span<const OptimizerTensor> tensors, const LionConfig& config,
               GradientRead read = {}, const std::int32_t* found_inf = nullptr);

/// One step of the optimizer `config` holds (the function of that optimizer above).
/// Determinism: bitwise (the definition itself).
void optimizer_step(std::span<const OptimizerTensor> tensors, const OptimizerConfig& config,
                    GradientRead read = {}, const std::int32_t* found_inf = nullptr);

/// acc = acc + f32(src), or acc = f32(src) for pairs marked copy.
void accumulate(std::span<const AccumulatePair> pairs);

/// g = R_T(f32(g) * scale) in place for every tensor.
void scale_(std::span<const TensorView> tensors, float scale);

/// Returns the exact norm partial of the given order of the values x = read(g) over all
/// tensors (S = sum of x^2 * 2^298, or of |x| * 2^149 for NormOrder::one).
NormPartial norm_partial(std::span<const ConstTensorView> tensors, GradientRead read = {},
                         NormOrder order = NormOrder::two);

/// Returns the p-norm of the values x = read(g) over all tensors, docs/numerics.md 6.6 (p = 2
/// and 1: finalize of the exact partial). Throws Errc::invalid_argument naming 'p' for NaN.
NormResult p_norm(std::span<const ConstTensorView> tensors, double p, GradientRead read = {});

}  // namespace stepcore::reference
