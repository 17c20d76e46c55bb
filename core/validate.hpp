// Argument validation shared by every implementation's public entry points.
// Each check throws stepcore::Error naming the argument; none writes anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "stepcore/error.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::detail {

/// Whether a validation reads the step counters (host memory) or checks only their
/// pointers (device memory, which the kernels read).
enum class StepCounters : std::uint8_t { read, unread };

/// The parameter dtypes an OptimizerTensor entry point computes: f32 only (the CUDA plans,
/// devices and managers refuse any other), or the model's (the CPU engine: f32, bf16 or
/// f16, every used state slot and source in the param's dtype, no compute output for a
/// bf16/f16 param; docs/numerics.md 7.3), or the model's and block-wise 8-bit state slots
/// (OptimizerTensor::q8, docs/numerics.md 8f: the reference, and the CPU engine for units
/// that take them; a tensor's used slots are then all 8-bit or none), or f32 parameters
/// with block-wise 8-bit state slots (the CUDA plans and devices for units that take them).
enum class ParamDTypes : std::uint8_t { f32, model, model_and_q8, f32_and_q8 };

/// "'torch' or 'torchao'": the names of the formulas in `set` (formula_bit), for errors.
std::string formula_names(std::uint8_t set);

/// The names of OptimizerTensor::q8[k] in errors ("tensors[i].q8[k]").
inline constexpr const char* kQ8SlotFields[kMaxOptimizerSlots] = {"q8[0]", "q8[1]", "q8[2]"};

/// Throws unless every argument of an AdamW step is valid (dtypes, sizes, pointers,
/// overlaps, hyper-parameter ranges, step counters, read scalars): state[0] exp_avg,
/// state[1] exp_avg_sq, state[2] max_exp_avg_sq with amsgrad (else empty, its source too);
/// amsgrad and maximize need the torch formula. An out-of-place source (param_src,
/// state_src) has its destination's dtype and size and either is the destination or
/// overlaps no written buffer of the call.
void validate_adamw_slots(std::span<const OptimizerTensor> tensors, const AdamWConfig& config,
                          GradientRead read, StepCounters counters = StepCounters::read,
                          ParamDTypes dtypes = ParamDTypes::f32);
/// Adam (L2 decay): every hyper-parameter finite, lr >= 0 (f32(lr) finite), betas in [0, 1),
/// eps > 0 (f32(eps) non-zero and finite), weight_decay >= 0 (f32 finite), tail width in
/// [0, 64]; slots as validate_adamw_slots.
void validate_adam(std::span<const OptimizerTensor> tensors, const AdamConfig& config,
                   GradientRead read, StepCounters counters = StepCounters::read,
                   ParamDTypes dtypes = ParamDTypes::f32);
/// Same for SignSGD (no slots, no counter; scale and clip must be finite and > 0), as
/// validate_unit<SignSgd>.
void validate_sign_sgd_slots(std::span<const OptimizerTensor> tensors, const SignSgdConfig& config,
                             GradientRead read, ParamDTypes dtypes = ParamDTypes::f32);
/// The hyper-parameter checks of validate_adamw_slots alone (errors name "config.<field>").
void validate_adamw_config(const AdamWConfig& config);
/// The hyper-parameter and read checks of validate_sign_sgd_slots alone.
void validate_sign_sgd_config(const SignSgdConfig& config, GradientRead read);
/// The hyper-parameter and read checks of validate_sgd, validate_adagrad and validate_adam
/// alone (errors name "config.<field>" and "read.<field>").
void validate_sgd_config(const SgdConfig& config, GradientRead read);
void validate_adagrad_config(const AdagradConfig& config, GradientRead read);
void validate_adam_config(const AdamConfig& config, GradientRead read);

/// The names of an optimizer's state slots in errors ("exp_avg") and of their sources
/// ("exp_avg_src"): static strings, one per slot the optimizer has.
struct SlotNames {
  const char* const* slot;
  const char* const* source;
};
/// Throws unless every tensor of an optimizer call is valid: param, grad and compute
/// output; the first `used_slots` state arrays (the param's dtype and size; named by
/// `names`) and their optional sources; the other slots empty; the step counter when the
/// optimizer counts steps (else null); no written range overlapping another range.
void validate_optimizer_tensors(std::span<const OptimizerTensor> tensors, const SlotNames& names,
                                int used_slots, bool counts_steps,
                                StepCounters counters = StepCounters::read,
                                ParamDTypes dtypes = ParamDTypes::f32);
/// Same for SGD (docs/numerics.md 8b): state[0] is the momentum buffer, required when
/// momentum != 0 and empty otherwise; state[1], state[2] and their sources empty;
/// param_src and state_src[0] as AdamW's sources; step counters as AdamW's.
void validate_sgd(std::span<const OptimizerTensor> tensors, const SgdConfig& config,
                  GradientRead read, StepCounters counters = StepCounters::read,
                  ParamDTypes dtypes = ParamDTypes::f32);
/// Throws unless every Adagrad argument is valid: hyper-parameters in torch's ranges (all
/// finite and >= 0; lr, weight_decay, eps and initial_accumulator_value finite in f32),
/// the read scalars, and per OptimizerTensor the param/grad/output as AdamW's, the f32
/// `sum` in state[0], state[1..] and their sources empty, sources and the step counter
/// as AdamW's, no written buffer overlapping another.
void validate_adagrad(std::span<const OptimizerTensor> tensors, const AdagradConfig& config,
                      GradientRead read, StepCounters counters = StepCounters::read,
                      ParamDTypes dtypes = ParamDTypes::f32);
/// The array a validated state buffer's old values are read from: its out-of-place
/// source when one is given (OptimizerTensor::param_src, ...), else the buffer itself.
inline const void* source_data_or(const ConstTensorView& src, const TensorView& dst) {
  const bool given = src.data != nullptr || src.numel != 0;
  return given ? src.data : dst.data;
}
/// source_data_or of an f32 buffer.
inline const float* source_or(const ConstTensorView& src, const TensorView& dst) {
  return static_cast<const float*>(source_data_or(src, dst));
}

void validate_accumulate(std::span<const AccumulatePair> pairs);
/// An in-place scale: check_scale_factor(scale, "scale"), validate_tensors, and no
/// tensor overlapping another (each is written).
void validate_scale(std::span<const TensorView> tensors, float scale);
/// The tensors of an in-place scale by a factor that is not on the host (validate_scale
/// without the factor).
void validate_scale_tensors(std::span<const TensorView> tensors);
/// A read-only norm: validate_read, then validate_tensors (overlaps are harmless).
void validate_norm(std::span<const ConstTensorView> tensors, GradientRead read);
/// Throws unless read.scale passes check_gradient_scale and read.clip check_clip,
/// naming "read.scale" / "read.clip".
void validate_read(const GradientRead& read, const char* name = "read");
/// validate_read for a device entry point, which reads in the gradient's dtype only:
/// also Errc::invalid_argument naming "read.as_f32" when it is set.
void validate_device_read(const GradientRead& read);

// ---- The scalar rules (docs/numerics.md section 9), one function per kind ------------
// Each throws Errc::non_finite when the value is NaN or +-Inf, then Errc::invalid_argument
// when it lies outside its range; `name` is the argument as the caller's API calls it.
// Every finite value in range is accepted (FLT_MAX included).

/// A gradient scale (GradientRead::scale, a manager's gradient_scale): finite, > 0.
void check_gradient_scale(float scale, std::string_view name);
/// A clip coefficient (GradientRead::clip): finite, in [0, 1].
void check_clip(float clip, std::string_view name);
/// An in-place scale factor (scale_, scale_and_norm_partial, emulate::scale): finite, >= 0.
void check_scale_factor(float factor, std::string_view name);
/// A clipping threshold (max_norm of finalize_and_clip, clip_grad_norm): finite, >= 0.
void check_max_norm(float max_norm, std::string_view name = "max_norm");

/// Throws unless every tensor of a list has a known dtype, at most 2^60 elements and
/// data unless it is empty, naming it "base[i]".
void validate_tensors(std::span<const TensorView> tensors, const char* base = "tensors");
void validate_tensors(std::span<const ConstTensorView> tensors, const char* base = "tensors");

/// The name of an argument, built into a string only when an error reports it
/// ("base", or "base[index].field"): validation of thousands of tensors allocates nothing.
struct Arg {
  const char* base;
  std::size_t index = static_cast<std::size_t>(-1);
  const char* field = nullptr;
  std::string str() const;
};

/// One memory range of a call, for the overlap check.
struct Range {
  std::uintptr_t begin;
  std::uintptr_t end;
  bool written;
  Arg name;
};

/// Throws Errc::overlap if a written range overlaps any other range.
void check_overlaps(std::span<Range> ranges);

/// Builds "base[i].field".
std::string arg_name(const char* base, std::size_t i, const char* field);

}  // namespace stepcore::detail
