// Optimizer and gradient-step descriptions shared by every implementation
// (reference, CPU engine, CUDA kernels): hyper-parameters, per-tensor argument
// records, the device-memory step inputs, and torch's clip coefficient.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <variant>

#include "stepcore/config.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore {

/// Which AdamW arithmetic to reproduce bit for bit (docs/numerics.md, "AdamW").
enum class AdamWFormula : std::uint8_t {
  /// The offload framework's CPU AdamW source formula: f32 hyper-parameters, no contraction.
  native = 0,
  /// The default: torch.optim.AdamW(fused=True) on CPU with f32 parameters (lerp with FMA).
  torch = 1,
  /// torchao.optim.AdamW8bit's (and Adam8bit's) arithmetic on the CPU (docs/numerics.md 8e):
  /// no FMA, the decay p - (lr*wd)*p first (Adam: g + wd*p), f32 bias corrections;
  /// amsgrad, no maximize.
  torchao = 2,
};

/// AdamWFormula's names, indexed by value (the Python and checkpoint spelling).
inline constexpr std::string_view kAdamWFormulaNames[] = {"native", "torch", "torchao"};

/// A set of formulas (HyperField::formulas): bit 1 << value for each AdamWFormula it holds.
constexpr std::uint8_t formula_bit(AdamWFormula f) {
  return static_cast<std::uint8_t>(1u << static_cast<unsigned>(f));
}

/// The build of torch's fused CPU kernels that the torch formulas follow by default: the
/// one torch runs on this library's target (docs/numerics.md 7.2, "Per platform"). x86-64:
/// the AVX2 build (also on AVX-512), 8 floats wide, whose vector body computes
/// v = fma(c*g, g, v*b2). aarch64: the NEON build (capabilities DEFAULT and SVE128, e.g.
/// Grace), 4 floats wide, which computes v = fma(v, b2, c*g*g) on every element. Both are
/// available on every target through the fields below; the defaults only pick one.
#if defined(__aarch64__)
inline constexpr int kTorchTailWidth = 4;
inline constexpr bool kTorchVFirst = true;
#else
inline constexpr int kTorchTailWidth = 8;
inline constexpr bool kTorchVFirst = false;
#endif

/// AdamW hyper-parameters. Values are given in double, as a Python trainer holds
/// them; each formula states which are rounded to f32 and when.
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  AdamWFormula formula = AdamWFormula::torch;
  // amsgrad, maximize and torch_v_first sit in the padding after `formula`, so
  // sizeof(AdamWConfig) is unchanged and no initialisation changes meaning.
  /// torch and torchao formulas only: keep max_exp_avg_sq (state slot 2) and divide by its
  /// square root (docs/numerics.md 8a, 8e). Needs an OptimizerTensor with three slots.
  bool amsgrad = false;
  /// torch formula only: step along +gradient (the read gradient is negated first).
  bool maximize = false;
  /// torch formula only: v = fma(v, b2, c*g*g) on every element, as torch's aarch64 NEON
  /// build computes it (true), or only in the scalar tail, the body computing
  /// fma(c*g, g, v*b2), as its x86 AVX2 build does (false). Default: this target's torch.
  bool torch_v_first = kTorchVFirst;
  /// torch formula only: torch's kernel runs its last (numel mod W) elements of each
  /// tensor through a scalar loop (v's tail form above; amsgrad's scalar maximum). W is
  /// the width in floats of the torch kernel that runs: 8 on every AVX2 and AVX-512
  /// processor (torch 2.15 dispatches its AVX2 build of fused AdamW on AVX-512), 4 on
  /// aarch64 with NEON (docs/numerics.md 7.2). 0 or 1: the vector-body form everywhere.
  /// Default: this target's torch.
  int torch_tail_width = kTorchTailWidth;
};

/// Adam hyper-parameters (L2 weight decay: the gradient becomes g + p*wd), reproducing
/// torch.optim.Adam(fused=True) on CPU with f32 parameters bit for bit (docs/numerics.md
/// 8a), or torchao.optim.Adam8bit's arithmetic (formula torchao, 8e). State slots:
/// exp_avg, exp_avg_sq, then max_exp_avg_sq with amsgrad.
struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;   ///< keep max_exp_avg_sq and divide by its square root
  bool maximize = false;  ///< step along +gradient
  /// v's form on every element or only in the tail (AdamWConfig::torch_v_first).
  bool torch_v_first = kTorchVFirst;
  /// Width of torch's vector body (AdamWConfig::torch_tail_width): 8 on x86, 4 on aarch64.
  int torch_tail_width = kTorchTailWidth;
  /// torch (the default) or torchao (docs/numerics.md 8e; no maximize); native is refused.
  AdamWFormula formula = AdamWFormula::torch;
};

/// SignSGD hyper-parameters.
struct SignSgdConfig {
  double lr = 1e-3;
  double weight_decay = 0.0;
};

/// SGD hyper-parameters: torch.optim.SGD(fused=True) on CPU with f32 parameters
/// (docs/numerics.md 8b). One state slot, momentum_buffer (OptimizerTensor::state[0]),
/// used only when momentum != 0. Values are given in double, as a Python trainer holds them.
struct SgdConfig {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;  ///< needs momentum > 0 and dampening == 0, as torch requires
  bool maximize = false;
  /// torch's last (numel mod W) elements of each tensor take its scalar loop's momentum
  /// update b = fma(b, mom, g*c) instead of the body's fma(g, c, b*mom). W = 8 on AVX2
  /// and AVX-512 (torch 2.15 runs its AVX2 build), 4 on aarch64 with NEON (docs/numerics.md
  /// 8b). 0 or 1: body form everywhere. Default: this target's torch.
  int torch_tail_width = kTorchTailWidth;
};

/// Adagrad hyper-parameters (torch.optim.Adagrad's, in double as a Python trainer holds
/// them; docs/numerics.md 8c). The state slot `sum` starts at initial_accumulator_value:
/// the caller fills it, as torch does when it constructs the optimizer. There is no tail
/// width: torch's fused CPU kernel computes the same function in its vector body and its
/// scalar tail (both contracted alike), so no element depends on where the tail starts.
struct AdagradConfig {
  double lr = 1e-2;
  double lr_decay = 0.0;
  double weight_decay = 0.0;
  double initial_accumulator_value = 0.0;
  double eps = 1e-10;
  bool maximize = false;
};

/// Lion hyper-parameters (Chen et al. 2023; docs/numerics.md 8d, stepcore's own bit-level
/// definition: torch has no Lion). Decoupled weight decay; one state slot, exp_avg; no step
/// counter. Values are given in double, as a Python trainer holds them.
struct LionConfig {
  double lr = 1e-4;
  double beta1 = 0.9;   ///< the update's interpolation: sign(beta1*m + (1-beta1)*g)
  double beta2 = 0.99;  ///< the momentum's: m = beta2*m + (1-beta2)*g
  double weight_decay = 0.0;
};

/// How a hyper-parameter relates to parameter groups and to checkpoints.
enum class HyperRole : std::uint8_t {
  schedule,  ///< lr, weight_decay: each group's, changed per step by a schedule
  betas,     ///< beta1, beta2, eps of the Adam family: each group's, fixed over training
  fixed,     ///< the rest of the optimizer's function (a checkpoint records it; must match)
  machine,   ///< which torch build to match (torch_tail_width, torch_v_first): not state
};

/// One hyper-parameter of configuration C: its name (the key of make_optimizer_config,
/// of checkpoints and of the Python `hyper` dict), its role, and the member it sets.
template <class C>
struct HyperField {
  const char* name;
  HyperRole role;
  std::variant<double C::*, bool C::*, int C::*, AdamWFormula C::*> member;
  std::uint8_t formulas = 0;  ///< an AdamWFormula member: the formulas it takes (formula_bit)
};

/// An optimizer's name and its hyper-parameters, declared once beside its Config: the
/// optimizer's unit (core/optimizers/), the managers, checkpoints and the Python binding
/// all read these. A Config without a specialisation is not an optimizer.
template <class C>
struct OptimizerTraits;

template <>
struct OptimizerTraits<AdamWConfig> {
  using C = AdamWConfig;
  static constexpr const char* kName = "adamw";
  static constexpr HyperField<C> kFields[] = {
      {"lr", HyperRole::schedule, &C::lr},
      {"beta1", HyperRole::betas, &C::beta1},
      {"beta2", HyperRole::betas, &C::beta2},
      {"eps", HyperRole::betas, &C::eps},
      {"weight_decay", HyperRole::schedule, &C::weight_decay},
      {"formula", HyperRole::fixed, &C::formula,
       formula_bit(AdamWFormula::native) | formula_bit(AdamWFormula::torch) |
           formula_bit(AdamWFormula::torchao)},
      {"amsgrad", HyperRole::fixed, &C::amsgrad},
      {"maximize", HyperRole::fixed, &C::maximize},
      {"torch_v_first", HyperRole::machine, &C::torch_v_first},
      {"torch_tail_width", HyperRole::machine, &C::torch_tail_width}};
};

template <>
struct OptimizerTraits<SignSgdConfig> {
  using C = SignSgdConfig;
  static constexpr const char* kName = "sign_sgd";
  static constexpr HyperField<C> kFields[] = {
      {"lr", HyperRole::schedule, &C::lr}, {"weight_decay", HyperRole::schedule, &C::weight_decay}};
};

template <>
struct OptimizerTraits<AdamConfig> {
  using C = AdamConfig;
  static constexpr const char* kName = "adam";
  static constexpr HyperField<C> kFields[] = {
      {"lr", HyperRole::schedule, &C::lr},
      {"beta1", HyperRole::betas, &C::beta1},
      {"beta2", HyperRole::betas, &C::beta2},
      {"eps", HyperRole::betas, &C::eps},
      {"weight_decay", HyperRole::schedule, &C::weight_decay},
      {"formula", HyperRole::fixed, &C::formula,
       formula_bit(AdamWFormula::torch) | formula_bit(AdamWFormula::torchao)},
      {"amsgrad", HyperRole::fixed, &C::amsgrad},
      {"maximize", HyperRole::fixed, &C::maximize},
      {"torch_v_first", HyperRole::machine, &C::torch_v_first},
      {"torch_tail_width", HyperRole::machine, &C::torch_tail_width}};
};

template <>
struct OptimizerTraits<SgdConfig> {
  using C = SgdConfig;
  static constexpr const char* kName = "sgd";
  static constexpr HyperField<C> kFields[] = {
      {"lr", HyperRole::schedule, &C::lr},
      {"momentum", HyperRole::fixed, &C::momentum},
      {"dampening", HyperRole::fixed, &C::dampening},
      {"weight_decay", HyperRole::schedule, &C::weight_decay},
      {"nesterov", HyperRole::fixed, &C::nesterov},
      {"maximize", HyperRole::fixed, &C::maximize},
      {"torch_tail_width", HyperRole::machine, &C::torch_tail_width}};
};

template <>
struct OptimizerTraits<AdagradConfig> {
  using C = AdagradConfig;
  static constexpr const char* kName = "adagrad";
  static constexpr HyperField<C> kFields[] = {
      {"lr", HyperRole::schedule, &C::lr},
      {"lr_decay", HyperRole::fixed, &C::lr_decay},
      {"weight_decay", HyperRole::schedule, &C::weight_decay},
      {"initial_accumulator_value", HyperRole::fixed, &C::initial_accumulator_value},
      {"eps", HyperRole::fixed, &C::eps},
      {"maximize", HyperRole::fixed, &C::maximize}};
};

template <>
struct OptimizerTraits<LionConfig> {
  using C = LionConfig;
  static constexpr const char* kName = "lion";
  static constexpr HyperField<C> kFields[] = {
      {"lr", HyperRole::schedule, &C::lr},
      {"beta1", HyperRole::fixed, &C::beta1},
      {"beta2", HyperRole::fixed, &C::beta2},
      {"weight_decay", HyperRole::schedule, &C::weight_decay}};
};

/// Any optimizer's hyper-parameters: one alternative per optimizer unit, in the order of
/// core/optimizers/all.hpp (a static_assert there keeps the two lists equal). The
/// generic entry points (devices, managers, the Python binding) take this; the
/// alternative held selects the optimizer.
using OptimizerConfig =
    std::variant<AdamWConfig, SignSgdConfig, AdamConfig, SgdConfig, AdagradConfig, LionConfig>;

/// How a hyper-parameter's value is held: its Config member's type.
enum class HyperKind : std::uint8_t {
  real,     ///< double
  flag,     ///< bool (0 or 1 as a number)
  integer,  ///< int
  formula,  ///< AdamWFormula (its value as a number: 0 native, 1 torch, 2 torchao)
};

/// One hyper-parameter of an optimizer: OptimizerTraits' field, its kind and the Config's
/// default as a double (a flag 0 or 1, a formula its value).
struct HyperInfo {
  const char* name;
  HyperRole role;
  HyperKind kind;
  double default_value;
  std::uint8_t formulas;  ///< a formula: the formulas it takes (formula_bit); else 0
};

/// One state slot of an optimizer: its name (torch's: exp_avg, momentum_buffer, sum, ...)
/// and the real hyper-parameter whose value, rounded to the slot's dtype, it starts from
/// (Adagrad's sum: initial_accumulator_value); nullptr: it starts at +0. A non-negative
/// slot (a second moment, its maximum, a sum of squares) refuses loaded values below zero.
struct SlotInfo {
  const char* name;
  const char* initial;
  bool non_negative;
};

/// One optimizer as an integrator or a binding drives it by name: what it is called, what
/// it takes, what it keeps beside each parameter, and how it reads the gradient.
struct OptimizerInfo {
  const char* name;                  ///< OptimizerTraits<Config>::kName
  std::span<const HyperInfo> hyper;  ///< its hyper-parameters, in OptimizerTraits' order
  /// Every state slot it may keep, in its slot order; a configuration uses the first few
  /// (optimizer_slot_names in stepcore/managers.hpp: e.g. max_exp_avg_sq only with amsgrad).
  std::span<const SlotInfo> slots;
  bool counts_steps;  ///< each tensor has an f32 step counter, incremented before use
  /// Its gradient read applies the scale and clip coefficient (GradientRead); false: it
  /// reads f32(g) (SignSGD: the sign of a positive multiple is the same).
  bool reads_scaled;
  /// Its state slots may be block-wise 8-bit (OptimizerTensor::q8, docs/numerics.md 8f) in
  /// the reference and the CPU engine.
  bool q8;
};

/// Every optimizer the library implements, entry i for alternative i of OptimizerConfig.
std::span<const OptimizerInfo> optimizer_table() noexcept;

/// How a gradient element g of storage type T is read by every operation that
/// accepts it (docs/numerics.md, "Gradient read"):
///   x = R_T( R_T( f32(g) * scale ) * clip )
/// i.e. exactly what scaling in place by `scale`, then clipping in place by
/// `clip`, would have stored. With the defaults the read is exact: x = f32(g).
/// With as_f32, R_T is R_f32 whatever T: the read of the gradient widened exactly into an
/// f32 buffer first (an accumulator's), without that buffer. The CPU engine's steps and
/// norms and the reference take it; the device entry points refuse it
/// (Errc::invalid_argument naming "read.as_f32"); for f32 gradients it changes nothing.
struct GradientRead {
  float scale = 1.0f;   ///< the step's gradient scale (e.g. 1 / loss tokens); finite, > 0
  float clip = 1.0f;    ///< the clip coefficient; in [0, 1]
  bool as_f32 = false;  ///< round the products in f32, not in the gradient's dtype
};

/// The most state arrays an optimizer keeps beside each parameter.
inline constexpr int kMaxOptimizerSlots = 3;

/// Elements per block of a state slot in block-wise 8-bit storage (docs/numerics.md 8f).
inline constexpr std::size_t kQ8BlockSize = 256;

/// The map of block-wise 8-bit slots (docs/numerics.md 8f): code c of a slot stands for
/// q8_map(non_negative)[c] times its block's maximum. SlotInfo::non_negative slots use the
/// unsigned map, the others the signed one (both bitsandbytes' and torchao's dynamic maps).
std::span<const float, 256> q8_map(bool non_negative) noexcept;

/// A state slot in block-wise 8-bit storage (docs/numerics.md 8f): one code byte per
/// element, and one f32 maximum per block of kQ8BlockSize consecutive elements of the
/// tensor (ceil(numel / kQ8BlockSize) of them; the last block may be shorter). Empty when
/// both pointers are null.
struct Q8Slot {
  std::uint8_t* codes = nullptr;
  float* absmax = nullptr;
};

/// One tensor of an optimizer step, for any optimizer: the parameter, the optimizer's
/// state arrays in its slot order (docs/numerics.md names each optimizer's slots, e.g.
/// AdamW: exp_avg, exp_avg_sq, then max_exp_avg_sq with amsgrad; slots the optimizer does
/// not use are empty), its step counter (optimizers that count steps), the read-only grad,
/// and the optional compute-parameter output. In place, or out of place from the optional
/// sources (read only, left intact). The parameter, its state and their sources are f32;
/// the CPU engine (cpu::Engine::step) and the reference also take them all in bf16 or all
/// in f16, the model's dtype, as torch's fused CPU optimizers do (math in f32, each
/// stored value rounded to nearest even; no compute output; docs/numerics.md 7.3). A view
/// is empty when data == nullptr and numel == 0.
struct OptimizerTensor {
  TensorView param;
  TensorView state[kMaxOptimizerSlots] = {};
  float* step = nullptr;  ///< per-tensor f32 step counter, incremented before use
  ConstTensorView grad = {};
  TensorView compute_param = {};
  /// The old param is read from here (the param's dtype, numel elements); empty: in place.
  ConstTensorView param_src = {};
  /// The old state arrays are read from here (the param's dtype); an empty entry: in place.
  ConstTensorView state_src[kMaxOptimizerSlots] = {};
  /// A used slot stored in block-wise 8 bits instead (docs/numerics.md 8f; state[k] and
  /// state_src[k] then empty: in place; a tensor's used slots all 8-bit or none). AdamW
  /// and Adam take them in the reference and the CPU engine; the other entry points refuse
  /// them (Errc::unsupported_dtype naming tensors[i].q8[k]).
  Q8Slot q8[kMaxOptimizerSlots] = {};
};

/// One pair of an accumulate call: acc (f32) = copy ? f32(src) : acc + f32(src).
struct AccumulatePair {
  TensorView acc;
  ConstTensorView src;
  bool copy = false;
};

/// The per-step hyper-parameters a device step reads from device memory when it runs:
/// a trainer's schedule writes them there before each step (or each replay of a
/// captured CUDA graph), with no host synchronisation.
struct StepHyper {
  double lr = 1e-3;
  double weight_decay = 0.0;
};

/// A GradientRead in device memory: the f32 scale and clip a device kernel reads when it
/// runs (not when it is enqueued), so a replayed CUDA graph reads the values there at
/// replay. Neither value is checked (they are not on the host). Constructed explicitly
/// (DeviceGradientRead{d_scale, d_clip}), so `{}` still means a host GradientRead.
struct DeviceGradientRead {
  explicit DeviceGradientRead(const float* d_scale, const float* d_clip) noexcept
      : scale(d_scale), clip(d_clip) {}
  const float* scale;  ///< the step's gradient scale (required)
  const float* clip;   ///< the clip coefficient (required; a 1.0f in device memory for none)
};

/// The device-memory inputs of a device step of any optimizer (Device::optimizer_step,
/// gpu::optimizer_step), all read when the kernels run (not when they are enqueued), so a
/// captured graph replays with the values there at replay. Step counters
/// (OptimizerTensor::step) are device memory too: each is read as t - 1 and set to t by
/// the step, on the device.
struct OptimizerDeviceArgs {
  /// The read's gradient scale and clip coefficient: required by the optimizers whose
  /// gradient read applies them (all but SignSGD, whose sign does not change), else unused.
  const float* scale = nullptr;
  const float* clip = nullptr;
  const std::int32_t* found_inf = nullptr;  ///< optional: != 0 writes nothing, counters kept
  const StepHyper* hyper = nullptr;         ///< optional: lr and weight decay (else config's)
  /// gpu::make_optimizer_table(config) in device memory: required when that table is not
  /// empty (AdamW and Adam: their bias corrections), else unused.
  const double* table = nullptr;
  /// gpu::q8_codebooks() in device memory: required when a tensor has 8-bit slots
  /// (OptimizerTensor::q8), else unused.
  const std::uint32_t* q8_codebooks = nullptr;
  /// Returns the gradient read (scale, clip) as a DeviceGradientRead.
  DeviceGradientRead read() const noexcept { return DeviceGradientRead{scale, clip}; }
};

/// Returns min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_
/// computes it on an f32 norm: (1 / (norm + 1e-6f)) * max_norm, each operation one
/// correctly rounded f32 op (docs/numerics.md 6.5), so host and device give the same
/// bits. A NaN norm gives NaN; +Inf gives 0.
STEPCORE_HD_INLINE float clip_coefficient(float norm, float max_norm) {
  const float denom = norm + 1e-6f;
  const float recip = 1.0f / denom;
  const float q = recip * max_norm;
  if (q != q) return q;  // NaN propagates (torch's clamp does the same)
  return q < 1.0f ? q : 1.0f;
}

}  // namespace stepcore
