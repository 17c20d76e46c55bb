// Argument validation for every public entry point: all checks run before any
// write, so a failing call leaves every buffer as it was.
#include "core/validate.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/optimizers/all.hpp"

namespace stepcore::detail {
namespace {

[[noreturn]] void fail(Errc code, std::string arg, const std::string& msg) {
  throw Error(code, std::move(arg), msg);
}
[[noreturn]] void fail(Errc code, const Arg& arg, const std::string& msg) {
  throw Error(code, arg.str(), msg);
}

void check_view(const void* data, std::size_t numel, DType dtype, const Arg& name) {
  if (!dtype_valid(dtype))
    fail(
        Errc::unsupported_dtype, name,
        "dtype enumerator " + std::to_string(static_cast<int>(dtype)) + " is not f32, bf16 or f16");
  if (numel > (std::size_t{1} << 60))
    fail(Errc::out_of_range, name, "element count " + std::to_string(numel) + " exceeds 2^60");
  if (data == nullptr && numel != 0)
    fail(Errc::null_pointer, name, "null data with " + std::to_string(numel) + " elements");
  // Every kernel (scalar tails included) reads elements as their type: misaligned data
  // would be undefined behaviour, so it is refused here for every entry point.
  const auto address = reinterpret_cast<std::uintptr_t>(data);
  if (numel != 0 && address % dtype_size(dtype) != 0)
    fail(Errc::invalid_argument, name,
         "data is not aligned to its element size (" + std::to_string(dtype_size(dtype)) +
             " bytes; address mod " + std::to_string(dtype_size(dtype)) + " = " +
             std::to_string(address % dtype_size(dtype)) + ")");
}

void require_dtype(DType got, DType want, const Arg& name) {
  if (got != want)
    fail(Errc::unsupported_dtype, name,
         "must be " + std::string(dtype_name(want)) + ", got " + std::string(dtype_name(got)));
}

void require_numel(std::size_t got, std::size_t want, const Arg& name, const Arg& other) {
  if (got != want)
    fail(Errc::size_mismatch, name,
         std::to_string(got) + " elements, but " + other.str() + " has " + std::to_string(want));
}

void require_finite(double v, const char* name) {
  if (!std::isfinite(v)) fail(Errc::non_finite, name, "must be finite, got " + std::to_string(v));
}

void add_range(std::vector<Range>& out, const void* data, std::size_t bytes, bool written,
               const Arg& name) {
  if (bytes == 0 || data == nullptr) return;
  const auto b = reinterpret_cast<std::uintptr_t>(data);
  out.push_back(Range{b, b + bytes, written, name});
}

template <class View>
bool has_view(const View& v) {
  return v.data != nullptr || v.numel != 0;
}

// The range of a scalar argument, besides being finite.
enum class Bound : std::uint8_t { positive, non_negative, unit_interval };

// The one scalar rule: NaN and +-Inf are Errc::non_finite, a finite value outside its
// range Errc::invalid_argument (so FLT_MAX passes wherever large values are in range).
void check_scalar(double v, Bound bound, std::string_view name) {
  if (!std::isfinite(v))
    fail(Errc::non_finite, std::string(name), "must be finite, got " + std::to_string(v));
  bool ok = false;
  const char* want = "";
  switch (bound) {
    case Bound::positive:
      ok = v > 0.0;
      want = "must be > 0";
      break;
    case Bound::non_negative:
      ok = v >= 0.0;
      want = "must be >= 0";
      break;
    case Bound::unit_interval:
      ok = v >= 0.0 && v <= 1.0;
      want = "must be in [0, 1]";
      break;
  }
  if (!ok) fail(Errc::invalid_argument, std::string(name), want + (", got " + std::to_string(v)));
}

template <class View>
void check_list(std::span<const View> tensors, const char* base) {
  for (std::size_t i = 0; i < tensors.size(); ++i)
    check_view(tensors[i].data, tensors[i].numel, tensors[i].dtype, Arg{base, i, ""});
}

// Checks tensor i's f32 param, its read-only grad and its optional compute output,
// adds their memory ranges, and returns the element count.
std::size_t check_param_grad_output(std::size_t i, const TensorView& param,
                                    const ConstTensorView& grad, const TensorView& out,
                                    std::vector<Range>& ranges,
                                    ParamDTypes dtypes = ParamDTypes::f32) {
  const Arg p{"tensors", i, "param"};
  check_view(param.data, param.numel, param.dtype, p);
  if ((dtypes == ParamDTypes::f32 || dtypes == ParamDTypes::f32_and_q8) &&
      param.dtype != DType::f32)
    fail(Errc::unsupported_dtype, p,
         "must be f32 on this path, got " + std::string(dtype_name(param.dtype)) +
             " (bf16/f16 parameters: cpu::Engine::step and the reference only)");
  const std::size_t n = param.numel;
  const Arg g{"tensors", i, "grad"};
  check_view(grad.data, grad.numel, grad.dtype, g);
  require_numel(grad.numel, n, g, p);
  if (has_view(out)) {
    const Arg o{"tensors", i, "compute_param"};
    if (param.dtype != DType::f32)
      fail(Errc::invalid_argument, o,
           "must be empty for a " + std::string(dtype_name(param.dtype)) +
               " param (the param is the model's weight; compute outputs need f32 params)");
    check_view(out.data, out.numel, out.dtype, o);
    require_numel(out.numel, n, o, p);
    add_range(ranges, out.data, out.bytes(), true, o);
  }
  add_range(ranges, param.data, param.bytes(), true, p);
  add_range(ranges, grad.data, grad.bytes(), false, g);
  return n;
}

// Requires a state array or source of tensor i to have the dtype of its param: f32, or
// the param's bf16/f16 (params and state share one dtype, docs/numerics.md 7.3).
void require_param_dtype(DType got, DType param, const Arg& name) {
  if (got == param) return;
  if (param == DType::f32) require_dtype(got, param, name);
  fail(Errc::unsupported_dtype, name,
       "must be " + std::string(dtype_name(param)) +
           ", the param's dtype (a bf16/f16 param keeps its state in its own dtype), got " +
           std::string(dtype_name(got)));
}

// Checks a companion buffer (a moment) of tensor i, in the dtype `want` (its param's), and
// adds its range.
void check_moment(std::size_t i, const TensorView& v, std::size_t n, const char* field,
                  std::vector<Range>& ranges, DType want = DType::f32) {
  const Arg name{"tensors", i, field};
  check_view(v.data, v.numel, v.dtype, name);
  require_param_dtype(v.dtype, want, name);
  require_numel(v.numel, n, name, Arg{"tensors", i, "param"});
  add_range(ranges, v.data, v.bytes(), true, name);
}

// Checks the optional source of tensor i's f32 buffer `dst` (named dst_field): the old
// values, read only. A source must be f32 with dst's size; it is either dst itself (in
// place) or a separate read range, which check_overlaps keeps clear of every written
// buffer of the call, so an out-of-place step never reads what it (or another tensor)
// writes.
void check_source(std::size_t i, const ConstTensorView& src, const TensorView& dst,
                  const char* field, const char* dst_field, std::vector<Range>& ranges) {
  if (!has_view(src)) return;
  const Arg name{"tensors", i, field};
  check_view(src.data, src.numel, src.dtype, name);
  require_param_dtype(src.dtype, dst.dtype, name);
  require_numel(src.numel, dst.numel, name, Arg{"tensors", i, dst_field});
  if (src.data != dst.data) add_range(ranges, src.data, src.bytes(), false, name);
}

// Checks tensor i's f32 step counter (pointer, alignment and, when read, its value: an
// integer in [0, 2^24)) and adds its range (written).
void check_step_counter(std::size_t i, const float* step, StepCounters counters,
                        std::vector<Range>& ranges) {
  const Arg s{"tensors", i, "step"};
  if (step == nullptr) fail(Errc::null_pointer, s, "step counter is null");
  if (reinterpret_cast<std::uintptr_t>(step) % alignof(float) != 0)
    fail(Errc::invalid_argument, s, "step counter is not aligned to 4 bytes");
  if (counters == StepCounters::read) {
    const float v = *step;
    if (!std::isfinite(v)) fail(Errc::non_finite, s, "step counter is not finite");
    if (v < 0.0f || v != std::floor(v) || v >= 16777216.0f)
      fail(Errc::out_of_range, s, "step counter must be an integer in [0, 2^24)");
  }
  add_range(ranges, step, sizeof(float), true, s);
}

// The names of OptimizerTensor::state[s] in errors about a slot the optimizer lacks.
constexpr const char* kStateFields[kMaxOptimizerSlots] = {"state[0]", "state[1]", "state[2]"};

constexpr const char* kStateSourceFields[kMaxOptimizerSlots] = {"state_src[0]", "state_src[1]",
                                                                "state_src[2]"};

bool has_q8(const Q8Slot& q) { return q.codes != nullptr || q.absmax != nullptr; }

// Checks used slot s of tensor i stored in block-wise 8 bits (docs/numerics.md 8f): taken
// only where `dtypes` says so, in place (no state view, no source), codes and maxima
// present for a non-empty tensor, the maxima f32-aligned; adds both ranges (written).
void check_q8_slot(std::size_t i, const OptimizerTensor& t, int s, std::size_t n,
                   ParamDTypes dtypes, std::vector<Range>& ranges) {
  const Arg name{"tensors", i, kQ8SlotFields[s]};
  if (dtypes != ParamDTypes::model_and_q8 && dtypes != ParamDTypes::f32_and_q8)
    fail(Errc::unsupported_dtype, name,
         "block-wise 8-bit state is not computed by this entry point (the reference takes it)");
  if (has_view(t.state[s]))
    fail(Errc::invalid_argument, Arg{"tensors", i, kStateFields[s]},
         "must be empty: the slot is stored in 8 bits (q8)");
  if (has_view(t.state_src[s]))
    fail(Errc::invalid_argument, Arg{"tensors", i, kStateSourceFields[s]},
         "must be empty: an 8-bit slot steps in place");
  if (n == 0) return;
  if (t.q8[s].codes == nullptr) fail(Errc::invalid_argument, name, "codes must not be null");
  if (t.q8[s].absmax == nullptr) fail(Errc::invalid_argument, name, "absmax must not be null");
  if (reinterpret_cast<std::uintptr_t>(t.q8[s].absmax) % alignof(float) != 0)
    fail(Errc::invalid_argument, name, "absmax must be aligned to 4 bytes");
  const std::size_t blocks = (n + kQ8BlockSize - 1) / kQ8BlockSize;
  add_range(ranges, t.q8[s].codes, n, true, name);
  add_range(ranges, t.q8[s].absmax, blocks * sizeof(float), true, name);
}

}  // namespace

std::string Arg::str() const {
  if (index == static_cast<std::size_t>(-1)) return base;
  return arg_name(base, index, field);
}

std::string arg_name(const char* base, std::size_t i, const char* field) {
  std::string s = base;
  s += "[" + std::to_string(i) + "]";
  if (field && *field) {
    s += ".";
    s += field;
  }
  return s;
}

void check_overlaps(std::span<Range> ranges) {
  // Sort 16-byte (begin, index) keys, not the ranges (a call of 2,000 AdamW tensors has
  // ~10,000): the order of equal begins does not matter to the sweep's verdict.
  std::vector<std::pair<std::uintptr_t, std::size_t>> order(ranges.size());
  for (std::size_t i = 0; i < ranges.size(); ++i) order[i] = {ranges[i].begin, i};
  std::sort(order.begin(), order.end());
  // Sweep: any earlier range ending after cur.begin overlaps cur. Track the
  // furthest end of all earlier ranges and of earlier written ranges.
  const Range* furthest = nullptr;
  const Range* furthest_written = nullptr;
  for (const auto& [begin, index] : order) {
    const Range& cur = ranges[index];
    if (cur.written && furthest && cur.begin < furthest->end)
      fail(Errc::overlap, cur.name, "written buffer overlaps '" + furthest->name.str() + "'");
    if (furthest_written && cur.begin < furthest_written->end)
      fail(Errc::overlap, cur.name,
           "overlaps written buffer '" + furthest_written->name.str() + "'");
    if (!furthest || cur.end > furthest->end) furthest = &cur;
    if (cur.written && (!furthest_written || cur.end > furthest_written->end))
      furthest_written = &cur;
  }
}

void check_gradient_scale(float scale, std::string_view name) {
  check_scalar(scale, Bound::positive, name);
}
void check_clip(float clip, std::string_view name) {
  check_scalar(clip, Bound::unit_interval, name);
}
void check_scale_factor(float factor, std::string_view name) {
  check_scalar(factor, Bound::non_negative, name);
}
void check_max_norm(float max_norm, std::string_view name) {
  check_scalar(max_norm, Bound::non_negative, name);
}

void validate_tensors(std::span<const TensorView> tensors, const char* base) {
  check_list(tensors, base);
}
void validate_tensors(std::span<const ConstTensorView> tensors, const char* base) {
  check_list(tensors, base);
}

void validate_read(const GradientRead& read, const char* name) {
  const std::string base = name;
  check_gradient_scale(read.scale, base + ".scale");
  check_clip(read.clip, base + ".clip");
}

void validate_device_read(const GradientRead& read) {
  validate_read(read);
  if (read.as_f32)
    fail(Errc::invalid_argument, "read.as_f32",
         "device kernels round the read in the gradient's dtype; an f32-rounded read is "
         "the CPU engine's and the reference's");
}

// The Adam family's hyper-parameters (AdamConfig, AdamWConfig): every one finite.
template <class C>
void check_adam_finite(const C& c) {
  require_finite(c.lr, "config.lr");
  require_finite(c.beta1, "config.beta1");
  require_finite(c.beta2, "config.beta2");
  require_finite(c.eps, "config.eps");
  require_finite(c.weight_decay, "config.weight_decay");
}

// Their ranges: lr >= 0, the tail width, betas in [0, 1), eps > 0, weight decay >= 0.
template <class C>
void check_adam_ranges(const C& c) {
  if (c.lr < 0.0) fail(Errc::invalid_argument, "config.lr", "must be >= 0");
  if (c.torch_tail_width < 0 || c.torch_tail_width > 64)
    fail(Errc::out_of_range, "config.torch_tail_width", "must be in [0, 64]");
  if (!(c.beta1 >= 0.0 && c.beta1 < 1.0))
    fail(Errc::invalid_argument, "config.beta1", "must be in [0, 1)");
  if (!(c.beta2 >= 0.0 && c.beta2 < 1.0))
    fail(Errc::invalid_argument, "config.beta2", "must be in [0, 1)");
  if (!(c.eps > 0.0)) fail(Errc::invalid_argument, "config.eps", "must be > 0");
  if (c.weight_decay < 0.0) fail(Errc::invalid_argument, "config.weight_decay", "must be >= 0");
}

// The values the kernels round to f32: lr and eps finite there, eps not rounding to zero.
template <class C>
void check_adam_f32(const C& c) {
  if (!std::isfinite(static_cast<float>(c.lr)))
    fail(Errc::out_of_range, "config.lr", "must be finite in f32");
  if (!std::isfinite(static_cast<float>(c.eps)))
    fail(Errc::out_of_range, "config.eps", "must be finite in f32");
  if (static_cast<float>(c.eps) == 0.0f)
    fail(Errc::out_of_range, "config.eps", "rounds to zero in f32");
}

// Throws naming config.formula unless c.formula is one of those its optimizer's formula
// field takes (HyperField::formulas, include/stepcore/optim.hpp).
template <class C>
void check_formula(const C& c) {
  std::uint8_t taken = 0;
  for (const HyperField<C>& f : OptimizerTraits<C>::kFields) taken |= f.formulas;
  if (static_cast<std::size_t>(c.formula) >= std::size(kAdamWFormulaNames) ||
      (taken & formula_bit(c.formula)) == 0)
    fail(Errc::invalid_argument, "config.formula",
         std::string(OptimizerTraits<C>::kName) + "'s formula is " + formula_names(taken));
}

// The formulas that compute bias corrections in f32 (native, torchao): the betas must stay
// below 1 there too.
template <class C>
void check_f32_betas(const C& c) {
  if (static_cast<float>(c.beta1) >= 1.0f)
    fail(Errc::out_of_range, "config.beta1", "rounds to 1 in f32 (bias correction would be 0)");
  if (static_cast<float>(c.beta2) >= 1.0f)
    fail(Errc::out_of_range, "config.beta2", "rounds to 1 in f32 (bias correction would be 0)");
}

std::string formula_names(std::uint8_t set) {
  std::string out;
  int left = std::popcount(set);
  for (std::size_t k = 0; k < std::size(kAdamWFormulaNames); ++k) {
    if ((set & formula_bit(static_cast<AdamWFormula>(k))) == 0) continue;
    --left;
    const char* sep = left > 1 ? ", " : left == 1 ? " or " : "";
    out += "'" + std::string(kAdamWFormulaNames[k]) + "'" + sep;
  }
  return out;
}

void validate_adamw_config(const AdamWConfig& c) {
  check_adam_finite(c);
  check_formula(c);
  if (c.formula == AdamWFormula::native && c.amsgrad)
    fail(Errc::invalid_argument, "config.amsgrad", "needs the torch formula or the torchao one");
  if (c.formula != AdamWFormula::torch && c.maximize)
    fail(Errc::invalid_argument, "config.maximize", "needs the torch formula");
  check_adam_ranges(c);
  if (c.lr * c.weight_decay > 1.0)
    fail(Errc::invalid_argument, "config.weight_decay", "lr * weight_decay must be <= 1");
  if (c.formula != AdamWFormula::torch) {
    // The native and torchao formulas round the hyper-parameters to f32 first: re-check
    // there (torchao's lr * weight_decay is the product of the two f32 values).
    check_f32_betas(c);
    if (static_cast<double>(static_cast<float>(c.lr)) * static_cast<float>(c.weight_decay) > 1.0)
      fail(Errc::out_of_range, "config.weight_decay", "f32(lr) * f32(weight_decay) must be <= 1");
  }
  check_adam_f32(c);
}

void validate_optimizer_tensors(std::span<const OptimizerTensor> tensors, const SlotNames& names,
                                int used_slots, bool counts_steps, StepCounters counters,
                                ParamDTypes dtypes) {
  std::vector<Range> ranges;
  ranges.reserve(tensors.size() * (4 + 2 * static_cast<std::size_t>(used_slots)));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const OptimizerTensor& t = tensors[i];
    // The arrays, then their sources, then the counter.
    const std::size_t n =
        check_param_grad_output(i, t.param, t.grad, t.compute_param, ranges, dtypes);
    int q8_slots = 0;
    for (int s = 0; s < used_slots; ++s) {
      if (has_q8(t.q8[s])) {
        check_q8_slot(i, t, s, n, dtypes, ranges);
        ++q8_slots;
      } else {
        check_moment(i, t.state[s], n, names.slot[s], ranges, t.param.dtype);
      }
    }
    if (q8_slots != 0 && q8_slots != used_slots) {
      int s = 0;
      while (has_q8(t.q8[s])) ++s;
      fail(Errc::invalid_argument, Arg{"tensors", i, kQ8SlotFields[s]},
           "a tensor's used state slots are all 8-bit or none: this one must be set too");
    }
    check_source(i, t.param_src, t.param, "param_src", "param", ranges);
    for (int s = 0; s < kMaxOptimizerSlots; ++s) {
      if (s < used_slots) {
        if (!has_q8(t.q8[s]))
          check_source(i, t.state_src[s], t.state[s], names.source[s], names.slot[s], ranges);
      } else if (has_q8(t.q8[s])) {
        fail(Errc::invalid_argument, Arg{"tensors", i, kQ8SlotFields[s]},
             "this optimizer keeps " + std::to_string(used_slots) + " state arrays: state slot " +
                 std::to_string(s) + " must be empty");
      } else if (has_view(t.state[s])) {
        fail(Errc::invalid_argument, Arg{"tensors", i, kStateFields[s]},
             "this optimizer keeps " + std::to_string(used_slots) + " state arrays: state slot " +
                 std::to_string(s) + " must be empty");
      } else if (has_view(t.state_src[s])) {
        fail(Errc::invalid_argument, Arg{"tensors", i, kStateSourceFields[s]},
             "this optimizer keeps " + std::to_string(used_slots) +
                 " state arrays: the source of state slot " + std::to_string(s) + " must be empty");
      }
    }
    if (counts_steps) {
      check_step_counter(i, t.step, counters, ranges);
    } else if (t.step != nullptr) {
      fail(Errc::invalid_argument, Arg{"tensors", i, "step"},
           "this optimizer keeps no step counter: must be null");
    }
  }
  check_overlaps(ranges);
}

void validate_adagrad_config(const AdagradConfig& c, GradientRead read) {
  // torch.optim.Adagrad's own bounds: every value >= 0 (eps = 0 included).
  check_scalar(c.lr, Bound::non_negative, "config.lr");
  check_scalar(c.lr_decay, Bound::non_negative, "config.lr_decay");
  check_scalar(c.weight_decay, Bound::non_negative, "config.weight_decay");
  check_scalar(c.initial_accumulator_value, Bound::non_negative,
               "config.initial_accumulator_value");
  check_scalar(c.eps, Bound::non_negative, "config.eps");
  // The values the kernel rounds to f32 (clr <= lr) and the sum's starting value.
  if (!std::isfinite(static_cast<float>(c.lr)))
    fail(Errc::out_of_range, "config.lr", "must be finite in f32");
  if (!std::isfinite(static_cast<float>(c.weight_decay)))
    fail(Errc::out_of_range, "config.weight_decay", "must be finite in f32");
  if (!std::isfinite(static_cast<float>(c.initial_accumulator_value)))
    fail(Errc::out_of_range, "config.initial_accumulator_value", "must be finite in f32");
  if (!std::isfinite(static_cast<float>(c.eps)))
    fail(Errc::out_of_range, "config.eps", "must be finite in f32");
  validate_read(read);
}

void validate_adagrad(std::span<const OptimizerTensor> tensors, const AdagradConfig& c,
                      GradientRead read, StepCounters counters, ParamDTypes dtypes) {
  validate_unit<Adagrad>(tensors, c, read, counters, dtypes);
}

void validate_adamw_slots(std::span<const OptimizerTensor> tensors, const AdamWConfig& c,
                          GradientRead read, StepCounters counters, ParamDTypes dtypes) {
  validate_unit<AdamW>(tensors, c, read, counters, dtypes);
}

void validate_adam_config(const AdamConfig& c, GradientRead read) {
  check_adam_finite(c);
  check_formula(c);
  if (c.formula == AdamWFormula::torchao && c.maximize)
    fail(Errc::invalid_argument, "config.maximize", "needs the torch formula");
  check_adam_ranges(c);
  // torchao's bias corrections are 1 - P(f32(beta), t) in f32: re-check the betas there.
  if (c.formula == AdamWFormula::torchao) check_f32_betas(c);
  check_adam_f32(c);
  if (!std::isfinite(static_cast<float>(c.weight_decay)))
    fail(Errc::out_of_range, "config.weight_decay", "must be finite in f32");
  validate_read(read);
}

void validate_adam(std::span<const OptimizerTensor> tensors, const AdamConfig& c, GradientRead read,
                   StepCounters counters, ParamDTypes dtypes) {
  validate_unit<Adam>(tensors, c, read, counters, dtypes);
}

void validate_sign_sgd_config(const SignSgdConfig& c, GradientRead read) {
  require_finite(c.lr, "config.lr");
  require_finite(c.weight_decay, "config.weight_decay");
  if (c.lr < 0.0) fail(Errc::invalid_argument, "config.lr", "must be >= 0");
  if (c.weight_decay < 0.0) fail(Errc::invalid_argument, "config.weight_decay", "must be >= 0");
  if (c.lr * c.weight_decay > 1.0)
    fail(Errc::invalid_argument, "config.weight_decay", "lr * weight_decay must be <= 1");
  if (!std::isfinite(static_cast<float>(c.lr)))
    fail(Errc::out_of_range, "config.lr", "must be finite in f32");
  validate_read(read);
  if (!(read.clip > 0.0f))
    fail(Errc::invalid_argument, "read.clip", "SignSGD needs a positive clip coefficient");
}

void validate_sign_sgd_slots(std::span<const OptimizerTensor> tensors, const SignSgdConfig& c,
                             GradientRead read, ParamDTypes dtypes) {
  validate_unit<SignSgd>(tensors, c, read, StepCounters::read, dtypes);
}

void validate_sgd_config(const SgdConfig& c, GradientRead read) {
  require_finite(c.lr, "config.lr");
  require_finite(c.momentum, "config.momentum");
  require_finite(c.dampening, "config.dampening");
  require_finite(c.weight_decay, "config.weight_decay");
  if (c.lr < 0.0) fail(Errc::invalid_argument, "config.lr", "must be >= 0");
  if (c.momentum < 0.0) fail(Errc::invalid_argument, "config.momentum", "must be >= 0");
  if (!(c.dampening >= 0.0 && c.dampening <= 1.0))
    fail(Errc::invalid_argument, "config.dampening", "must be in [0, 1]");
  if (c.weight_decay < 0.0) fail(Errc::invalid_argument, "config.weight_decay", "must be >= 0");
  if (c.nesterov && !(c.momentum > 0.0 && c.dampening == 0.0))
    fail(Errc::invalid_argument, "config.nesterov", "needs momentum > 0 and dampening == 0");
  if (c.torch_tail_width < 0 || c.torch_tail_width > 64)
    fail(Errc::out_of_range, "config.torch_tail_width", "must be in [0, 64]");
  if (!std::isfinite(static_cast<float>(c.lr)))
    fail(Errc::out_of_range, "config.lr", "must be finite in f32");
  if (!std::isfinite(static_cast<float>(c.momentum)))
    fail(Errc::out_of_range, "config.momentum", "must be finite in f32");
  if (!std::isfinite(static_cast<float>(c.weight_decay)))
    fail(Errc::out_of_range, "config.weight_decay", "must be finite in f32");
  validate_read(read);
}

void validate_sgd(std::span<const OptimizerTensor> tensors, const SgdConfig& c, GradientRead read,
                  StepCounters counters, ParamDTypes dtypes) {
  validate_unit<Sgd>(tensors, c, read, counters, dtypes);
}

void validate_accumulate(std::span<const AccumulatePair> pairs) {
  std::vector<Range> ranges;
  ranges.reserve(pairs.size() * 2);
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const AccumulatePair& pr = pairs[i];
    const Arg a{"pairs", i, "acc"};
    check_view(pr.acc.data, pr.acc.numel, pr.acc.dtype, a);
    require_dtype(pr.acc.dtype, DType::f32, a);
    const Arg s{"pairs", i, "src"};
    check_view(pr.src.data, pr.src.numel, pr.src.dtype, s);
    require_numel(pr.src.numel, pr.acc.numel, s, a);
    add_range(ranges, pr.acc.data, pr.acc.bytes(), true, a);
    add_range(ranges, pr.src.data, pr.src.bytes(), false, s);
  }
  check_overlaps(ranges);
}

void validate_scale(std::span<const TensorView> tensors, float scale) {
  check_scale_factor(scale, "scale");
  validate_scale_tensors(tensors);
}

void validate_scale_tensors(std::span<const TensorView> tensors) {
  validate_tensors(tensors);
  std::vector<Range> ranges;
  ranges.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i)
    add_range(ranges, tensors[i].data, tensors[i].bytes(), true, Arg{"tensors", i, ""});
  check_overlaps(ranges);
}

void validate_norm(std::span<const ConstTensorView> tensors, GradientRead read) {
  validate_read(read);
  validate_tensors(tensors);
}

}  // namespace stepcore::detail
