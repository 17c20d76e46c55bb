// stepcore._core.gpu: the binding of the GPU launchers of stepcore/gpu.hpp on device arrays (torch
// CUDA tensors, or any DLPack array in CUDA memory), thin: every array and device scalar is checked
// (arrays.hpp: CUDA memory, C-contiguous, dtype, size, one device) and named
// ("params[3]", "found_inf") before the library is called, the stream argument is an int,
// an object with __cuda_stream__ or None (the first tensor's framework's current stream),
// the GIL is released around each launch, and nothing is allocated on the device or
// synchronised: workspaces, partials, results and scalars are the caller's buffers. The
// dtype dispatch and the arithmetic stay in the library. Built without CUDA, the launchers
// raise NotImplementedError (after the same argument checks).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "arrays.hpp"      // this extension's one checker of array and stream arguments
#include "optim_args.hpp"  // the formula and AdamW keyword arguments
#include "partials.hpp"    // a norm partial as PARTIAL_WORDS int64 words
#include "stepcore/cuda_host.hpp"
#include "stepcore/dtype.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace nb = nanobind;
using namespace stepcore;

namespace {

using Objects = std::vector<nb::object>;  // a Python list of arrays, converted one by one
using python::Access;
using python::adamw_config;
using python::ArgName;
using python::BufferArg;
using python::Memory;
using python::parse_formula;

// The device layouts Python code indexes (docs/python.md, "GPU launchers").
constexpr std::size_t kSumWords = kNormDigits + 2;  // digits, nan_count, inf_count: SUM
constexpr std::size_t kMaxInt32 = 2 * kSumWords;    // max_abs_bits, approximate: MAX (int32)
static_assert(sizeof(NormPartial) == 8 * kSumWords + 8);
static_assert(offsetof(NormPartial, nan_count) == 8 * kNormDigits);
static_assert(offsetof(NormPartial, max_abs_bits) == 4 * kMaxInt32);
static_assert(offsetof(NormPartial, approximate) == 4 * kMaxInt32 + 4);
static_assert(sizeof(StepHyper) == 2 * sizeof(double) && offsetof(StepHyper, lr) == 0 &&
              offsetof(StepHyper, weight_decay) == sizeof(double));
static_assert(std::is_trivially_copyable_v<NormPartial> &&
              std::is_trivially_copyable_v<NormResult>);

[[noreturn]] void bad(const char* code, const ArgName& name, const std::string& why) {
  throw nb::value_error(
      ("stepcore: " + std::string(code) + " in '" + name.str() + "': " + why).c_str());
}

// Throws ValueError naming `name` unless `got` == `want` list entries.
void same_length(std::size_t got, std::size_t want, const char* name) {
  if (got != want)
    bad("size_mismatch", ArgName{name},
        std::to_string(got) + " entries for " + std::to_string(want) + " tensors");
}

// The arrays of one launch, checked one by one (arrays.hpp) and required to be on one
// CUDA device: the launch goes to the calling thread's current device, which must be it.
class Launch {
 public:
  // Returns the view of the f32/bf16/f16 CUDA array `h`.
  TensorView tensor(nb::handle h, ArgName name, Access access) {
    const python::ArrayArg a = python::array_arg(h, name, Memory::cuda, access);
    on_device(a.device_id, name);
    return a.view;
  }

  // Returns the CUDA buffer `h` with one of `dtypes`.
  BufferArg buffer(nb::handle h, ArgName name, Access access, unsigned dtypes) {
    const BufferArg b = python::buffer_arg(h, name, Memory::cuda, access, dtypes);
    on_device(b.device_id, name);
    return b;
  }

  // Returns the CUDA buffer `h` of exactly `numel` elements of one of `dtypes`.
  BufferArg exact(nb::handle h, ArgName name, Access access, unsigned dtypes, std::size_t numel,
                  const char* what) {
    const BufferArg b = buffer(h, name, access, dtypes);
    if (b.numel != numel)
      bad("size_mismatch", name,
          "has " + std::to_string(b.numel) + " elements, not " + std::to_string(numel) + ": " +
              what);
    return b;
  }

  // Returns the one float32 value at `h` (a scale, clip or factor; 0-dim or one element).
  float* f32_scalar(nb::handle h, ArgName name, Access access) {
    return static_cast<float*>(
        exact(h, name, access, python::kF32, 1, "one float32 value (0-dim or shape (1,))").data);
  }

  // Returns the int32 found-inf flag at `h`.
  std::int32_t* found_inf(nb::handle h, ArgName name, Access access) {
    return static_cast<std::int32_t*>(
        exact(h, name, access, python::kI32, 1, "one int32 value (0-dim or shape (1,))").data);
  }

  // Returns the StepHyper at `h`: two float64 values, lr then weight decay.
  const StepHyper* hyper(nb::handle h, ArgName name) {
    return static_cast<const StepHyper*>(
        exact(h, name, Access::read, python::kF64, 2, "two float64 values (lr, weight_decay)")
            .data);
  }

  // Returns the struct T at `h`: a uint8 or int64 buffer of exactly sizeof(T) bytes,
  // aligned for T; `what` names T and its size constant.
  template <class T>
  T* record(nb::handle h, ArgName name, Access access, const char* what) {
    const BufferArg b = buffer(h, name, access, python::kU8 | python::kI64);
    if (b.bytes() != sizeof(T))
      bad("size_mismatch", name,
          "has " + std::to_string(b.bytes()) + " bytes, not " + std::to_string(sizeof(T)) + ": " +
              what + ", as uint8 or int64");
    if (reinterpret_cast<std::uintptr_t>(b.data) % alignof(T) != 0)
      bad("invalid_argument", name,
          "is not aligned to " + std::to_string(alignof(T)) + " bytes (a fresh allocation is)");
    return static_cast<T*>(b.data);
  }

  // The workspace: any dtype, aligned for NormPartial (the per-block partials); None is an
  // empty one (enough when the tensors are empty).
  std::pair<void*, std::size_t> workspace(nb::handle h) {
    if (h.is_none()) return {nullptr, 0};
    const ArgName name{"workspace"};
    const BufferArg b = buffer(h, name, Access::write, python::kAnyDtype);
    if (reinterpret_cast<std::uintptr_t>(b.data) % alignof(NormPartial) != 0)
      bad("invalid_argument", name,
          "is not aligned to " + std::to_string(alignof(NormPartial)) +
              " bytes (a fresh allocation is)");
    return {b.data, b.bytes()};
  }

  // The views of a list's arrays, each named base[i].
  std::vector<TensorView> tensors(const Objects& list, const char* base, Access access) {
    std::vector<TensorView> out;
    out.reserve(list.size());
    for (std::size_t i = 0; i < list.size(); ++i)
      out.push_back(tensor(list[i], ArgName{base, static_cast<std::ptrdiff_t>(i)}, access));
    return out;
  }

 private:
  void on_device(int id, const ArgName& name) {
    if (!have_device_) {
      have_device_ = true;
      device_ = id;
      first_ = name;
      return;
    }
    if (id != device_)
      bad("invalid_argument", name,
          "is on CUDA device " + std::to_string(id) + " but '" + first_.str() + "' is on " +
              std::to_string(device_) + "; a launch's arrays share one device");
  }

  bool have_device_ = false;
  int device_ = 0;
  ArgName first_{""};
};

// A per-step scalar argument (a gradient scale or clip): a number, the host-value form,
// fixed when the launch is enqueued (a captured CUDA graph replays the captured value), or
// a float32 device array of one value (0-dim or shape (1,)), read when the kernels run.
// An object with __dlpack__ is an array; anything else is converted to float.
struct Scalar {
  float value = 1.0f;
  const float* device = nullptr;  // the device form when not null
};
Scalar scalar_arg(Launch& l, nb::handle h, ArgName name) {
  if (nb::hasattr(h, "__dlpack__")) return Scalar{0.0f, l.f32_scalar(h, name, Access::read)};
  Scalar out;
  if (!nb::try_cast(h, out.value))
    throw nb::type_error(("stepcore: invalid_argument in '" + name.str() + "': a " +
                          std::string(nb::type_name(h.type()).c_str()) +
                          " is neither a number nor a float32 device array")
                             .c_str());
  return out;
}

// The gradient read (grad_scale, clip) of the norm passes: both numbers (GradientRead) or
// both float32 device arrays (DeviceGradientRead); a mix raises naming the number.
struct Read {
  GradientRead host;
  const float* scale = nullptr;  // device form when not null (clip too)
  const float* clip = nullptr;
};
Read read_arg(Launch& l, nb::handle grad_scale, nb::handle clip) {
  const Scalar s = scalar_arg(l, grad_scale, ArgName{"grad_scale"});
  const Scalar c = scalar_arg(l, clip, ArgName{"clip"});
  if ((s.device == nullptr) != (c.device == nullptr))
    bad("invalid_argument", ArgName{s.device == nullptr ? "grad_scale" : "clip"},
        std::string("is a number while '") + (s.device == nullptr ? "clip" : "grad_scale") +
            "' is a device array: pass both as float32 device arrays (a 1.0 for no clip) or "
            "both as numbers");
  return Read{GradientRead{s.value, c.value}, s.device, c.device};
}

// The stream of a launch: parsed before any array (an invalid stream raises naming
// 'stream' whatever the arrays), None meaning `producer`'s current stream.
cudaStream_t launch_stream(nb::handle stream, nb::handle producer) {
  return python::stream_arg(stream, producer);
}

// Returns the first entry of `list`, else `fallback` (the producer of a stream of None).
nb::handle first_of(const Objects& list, nb::handle fallback) {
  return list.empty() ? fallback : nb::handle(list.front());
}

// Returns the entries of make_adamw_bias_table(config): computed once per distinct
// (beta1, beta2, formula) of the last few (under the GIL), so each step can check a
// table's length without rebuilding it.
std::size_t bias_table_numel(const AdamWConfig& config) {
  struct Entry {
    double beta1, beta2;
    AdamWFormula formula;
    std::size_t numel;
  };
  static std::array<Entry, 4> cache{};
  static std::size_t used = 0, next = 0;
  for (std::size_t k = 0; k < used; ++k)
    if (cache[k].beta1 == config.beta1 && cache[k].beta2 == config.beta2 &&
        cache[k].formula == config.formula)
      return cache[k].numel;
  const std::size_t numel = gpu::make_adamw_bias_table(config).size();
  cache[next] = Entry{config.beta1, config.beta2, config.formula, numel};
  next = (next + 1) % cache.size();
  if (used < cache.size()) ++used;
  return numel;
}

// A host copy of a device record, for the read-back helpers: a CPU uint8/int64 buffer of
// exactly sizeof(T) bytes.
template <class T>
T host_record(nb::handle h, const char* name, const char* what) {
  const BufferArg b =
      python::buffer_arg(h, ArgName{name}, Memory::cpu, Access::read, python::kU8 | python::kI64);
  if (b.bytes() != sizeof(T))
    bad("size_mismatch", ArgName{name},
        "has " + std::to_string(b.bytes()) + " bytes, not " + std::to_string(sizeof(T)) + ": " +
            what + ", as uint8 or int64");
  T out;
  std::memcpy(&out, b.data, sizeof(T));
  return out;
}

// The binding of finalize_and_clip and finalize_exact_and_clip (the same arguments: a
// partial named `partial_name`, max_norm, result, clip, found_inf, stream).
template <class Launcher>
auto finalize_binding(Launcher launch, const char* partial_name) {
  return [launch, partial_name](nb::handle partial, float max_norm, nb::handle result,
                                nb::handle clip, nb::handle found_inf, nb::handle stream) {
    const cudaStream_t s = launch_stream(stream, partial);
    Launch l;
    const auto* p = l.record<NormPartial>(partial, ArgName{partial_name}, Access::read,
                                          "a NormPartial (NORM_PARTIAL_BYTES)");
    auto* r = l.record<NormResult>(result, ArgName{"result"}, Access::write,
                                   "a NormResult (NORM_RESULT_BYTES)");
    float* c = l.f32_scalar(clip, ArgName{"clip"}, Access::write);
    std::int32_t* f = l.found_inf(found_inf, ArgName{"found_inf"}, Access::write);
    nb::gil_scoped_release release;
    launch(p, max_norm, r, c, f, s);
  };
}

}  // namespace

void bind_gpu(nb::module_& parent) {
  nb::module_ m = parent.def_submodule(
      "gpu",
      "stepcore's GPU launchers on device arrays (thin binding of stepcore/gpu.hpp): no "
      "allocation, no synchronisation, streams as int, __cuda_stream__ or None.");
  m.attr("NORM_PARTIAL_BYTES") = sizeof(NormPartial);
  m.attr("NORM_RESULT_BYTES") = sizeof(NormResult);
  m.attr("PARTIAL_SUM_WORDS") = kSumWords;
  m.attr("PARTIAL_MAX_INT32") = kMaxInt32;
  m.attr("BLOCK_ELEMENTS") = gpu::kBlockElements;
  m.attr("FOUND_INF_NONE") = gpu::kFoundInfNone;
  m.attr("FOUND_INF_NON_FINITE") = gpu::kFoundInfNonFinite;
  m.attr("FOUND_INF_NEEDS_EXACT") = gpu::kFoundInfNeedsExact;
  m.attr("MAX_BIAS_TABLE_STEPS") = gpu::kMaxBiasTableSteps;

  m.def("built_with_cuda", &cuda::built_with_cuda,
        "True when stepcore was built with its CUDA kernels (else the launchers raise "
        "NotImplementedError).");
  m.def("device_count", &cuda::device_count,
        "The number of usable CUDA devices (0 without CUDA, a driver or a GPU).");
  m.def("unavailable_reason", &cuda::unavailable_reason,
        "Why no CUDA device is usable ('' when one is).");

  m.def(
      "make_adamw_bias_table",
      [](double beta1, double beta2, const std::string& formula) {
        AdamWConfig config;
        config.beta1 = beta1;
        config.beta2 = beta2;
        config.formula = parse_formula(formula);
        auto* table = new std::vector<double>(gpu::make_adamw_bias_table(config));
        nb::capsule owner(table,
                          [](void* t) noexcept { delete static_cast<std::vector<double>*>(t); });
        return nb::ndarray<nb::numpy, double, nb::shape<-1>>(table->data(), {table->size()}, owner);
      },
      nb::arg("beta1"), nb::arg("beta2"), nb::kw_only(), nb::arg("formula") = "torch",
      "The AdamW bias table of these betas as a float64 numpy array (copy it to the device "
      "once, e.g. torch.from_numpy(t).cuda()): {len1, len2, 1 - beta1^t..., 1 - beta2^t...}, "
      "the host's values bit for bit.");

  m.def(
      "scale_and_norm_workspace_bytes",
      [](const Objects& tensors) {
        std::vector<TensorView> v;
        v.reserve(tensors.size());
        for (std::size_t i = 0; i < tensors.size(); ++i)
          v.push_back(python::array_arg(tensors[i],
                                        ArgName{"tensors", static_cast<std::ptrdiff_t>(i)},
                                        Memory::any, Access::read)
                          .view);
        return gpu::scale_and_norm_workspace_bytes(v);
      },
      nb::arg("tensors"),
      "The workspace bytes scale_and_norm_partial, norm_partial and "
      "exact_norm_partial_if_needed need for these tensors (CPU or CUDA: only sizes count).");

  m.def(
      "scale_and_norm_partial",
      [](const Objects& tensors, nb::handle scale, nb::handle partial, nb::handle workspace,
         nb::handle stream) {
        const cudaStream_t s = launch_stream(stream, first_of(tensors, partial));
        Launch l;
        const std::vector<TensorView> v = l.tensors(tensors, "tensors", Access::write);
        const Scalar sc = scalar_arg(l, scale, ArgName{"scale"});
        auto* p = l.record<NormPartial>(partial, ArgName{"partial"}, Access::write,
                                        "a NormPartial (NORM_PARTIAL_BYTES)");
        const auto [w, w_bytes] = l.workspace(workspace);
        nb::gil_scoped_release release;
        if (sc.device != nullptr)
          gpu::scale_and_norm_partial(v, sc.device, p, w, w_bytes, s);
        else
          gpu::scale_and_norm_partial(v, sc.value, p, w, w_bytes, s);
      },
      nb::arg("tensors"), nb::arg("scale"), nb::arg("partial"), nb::arg("workspace").none(),
      nb::kw_only(), nb::arg("stream").none() = nb::none(),
      "In place g = R(f32(g) * scale) and the norm partial of the stored values into "
      "`partial` (NORM_PARTIAL_BYTES of device memory), in one pass. `scale`: a float32 "
      "device array (read when the kernels run: what a captured graph needs) or a number "
      "(fixed at enqueue time, so a graph replays the captured value; skipped when 1).");

  m.def(
      "norm_partial",
      [](const Objects& tensors, nb::handle partial, nb::handle workspace, nb::handle grad_scale,
         nb::handle clip, nb::handle stream) {
        const cudaStream_t s = launch_stream(stream, first_of(tensors, partial));
        Launch l;
        const std::vector<TensorView> v = l.tensors(tensors, "tensors", Access::read);
        auto* p = l.record<NormPartial>(partial, ArgName{"partial"}, Access::write,
                                        "a NormPartial (NORM_PARTIAL_BYTES)");
        const auto [w, w_bytes] = l.workspace(workspace);
        const Read r = read_arg(l, grad_scale, clip);
        const std::vector<ConstTensorView> cv(v.begin(), v.end());
        nb::gil_scoped_release release;
        if (r.scale != nullptr)
          gpu::norm_partial(cv, DeviceGradientRead{r.scale, r.clip}, p, w, w_bytes, s);
        else
          gpu::norm_partial(cv, r.host, p, w, w_bytes, s);
      },
      nb::arg("tensors"), nb::arg("partial"), nb::arg("workspace").none(), nb::kw_only(),
      nb::arg("grad_scale") = 1.0f, nb::arg("clip") = 1.0f, nb::arg("stream").none() = nb::none(),
      "The norm partial of the values read as R(R(g*grad_scale)*clip) into `partial`; "
      "nothing else is written. grad_scale and clip: both float32 device arrays (read when "
      "the kernels run) or both numbers (fixed at enqueue time).");

  m.def(
      "scale_",
      [](const Objects& tensors, nb::handle factor, nb::handle stream) {
        const cudaStream_t s = launch_stream(stream, first_of(tensors, factor));
        Launch l;
        const std::vector<TensorView> v = l.tensors(tensors, "tensors", Access::write);
        const float* f = l.f32_scalar(factor, ArgName{"factor"}, Access::read);
        nb::gil_scoped_release release;
        gpu::scale_(v, f, s);
      },
      nb::arg("tensors"), nb::arg("factor"), nb::kw_only(), nb::arg("stream").none() = nb::none(),
      "In place g = R(f32(g) * factor), the factor one float32 in device memory (read when "
      "the kernel runs: the clip coefficient of finalize_and_clip).");

  m.def(
      "accumulate",
      [](const Objects& accs, const Objects& srcs, bool copy, nb::handle stream) {
        const cudaStream_t s = launch_stream(stream, first_of(accs, nb::handle()));
        same_length(srcs.size(), accs.size(), "srcs");
        Launch l;
        std::vector<AccumulatePair> pairs(accs.size());
        for (std::size_t i = 0; i < accs.size(); ++i) {
          const auto k = static_cast<std::ptrdiff_t>(i);
          pairs[i].acc = l.tensor(accs[i], ArgName{"accs", k}, Access::write);
          pairs[i].src = l.tensor(srcs[i], ArgName{"srcs", k}, Access::read);
          pairs[i].copy = copy;
        }
        nb::gil_scoped_release release;
        gpu::accumulate(pairs, s);
      },
      nb::arg("accs"), nb::arg("srcs"), nb::arg("copy") = false, nb::kw_only(),
      nb::arg("stream").none() = nb::none(),
      "acc = acc + f32(src) for every pair (acc = f32(src) with copy=True).");

  m.def("finalize_and_clip", finalize_binding(&gpu::finalize_and_clip, "partial"),
        nb::arg("partial"), nb::arg("max_norm"), nb::arg("result"), nb::arg("clip"),
        nb::arg("found_inf"), nb::kw_only(), nb::arg("stream").none() = nb::none(),
        "On the device: result = finalize(partial); found_inf = FOUND_INF_NONE, "
        "FOUND_INF_NON_FINITE or FOUND_INF_NEEDS_EXACT; clip = clip_coefficient(norm, "
        "max_norm) when the norm is certified and finite, else 0.");

  m.def(
      "exact_norm_partial_if_needed",
      [](const Objects& tensors, nb::handle found_inf, nb::handle exact_partial,
         nb::handle workspace, nb::handle grad_scale, nb::handle clip, nb::handle stream) {
        const cudaStream_t s = launch_stream(stream, first_of(tensors, exact_partial));
        Launch l;
        const std::vector<TensorView> v = l.tensors(tensors, "tensors", Access::read);
        const std::int32_t* f = l.found_inf(found_inf, ArgName{"found_inf"}, Access::read);
        auto* p = l.record<NormPartial>(exact_partial, ArgName{"exact_partial"}, Access::write,
                                        "a NormPartial (NORM_PARTIAL_BYTES)");
        const auto [w, w_bytes] = l.workspace(workspace);
        const Read r = read_arg(l, grad_scale, clip);
        const std::vector<ConstTensorView> cv(v.begin(), v.end());
        nb::gil_scoped_release release;
        if (r.scale != nullptr)
          gpu::exact_norm_partial_if_needed(cv, DeviceGradientRead{r.scale, r.clip}, f, p, w,
                                            w_bytes, s);
        else
          gpu::exact_norm_partial_if_needed(cv, r.host, f, p, w, w_bytes, s);
      },
      nb::arg("tensors"), nb::arg("found_inf"), nb::arg("exact_partial"),
      nb::arg("workspace").none(), nb::kw_only(), nb::arg("grad_scale") = 1.0f,
      nb::arg("clip") = 1.0f, nb::arg("stream").none() = nb::none(),
      "When found_inf == FOUND_INF_NEEDS_EXACT: the exact partial of the values read as "
      "R(R(g*grad_scale)*clip) into exact_partial; otherwise a zero partial there. "
      "grad_scale and clip as norm_partial's.");

  m.def("finalize_exact_and_clip", finalize_binding(&gpu::finalize_exact_and_clip, "exact_partial"),
        nb::arg("exact_partial"), nb::arg("max_norm"), nb::arg("result"), nb::arg("clip"),
        nb::arg("found_inf"), nb::kw_only(), nb::arg("stream").none() = nb::none(),
        "When found_inf == FOUND_INF_NEEDS_EXACT: result, clip and found_inf from the "
        "(reduced) exact partial, as finalize_and_clip; otherwise nothing changes.");

  m.def(
      "adamw_step",
      [](const Objects& params, const Objects& exp_avgs, const Objects& exp_avg_sqs,
         const Objects& steps, const Objects& grads, std::optional<Objects> computes,
         nb::handle scale, nb::handle clip, nb::handle bias_table, nb::handle found_inf,
         nb::handle hyper, double lr, double beta1, double beta2, double eps, double weight_decay,
         const std::string& formula, int torch_tail_width, bool torch_v_first, nb::handle stream) {
        const cudaStream_t s = launch_stream(stream, first_of(params, scale));
        const std::size_t n = params.size();
        same_length(exp_avgs.size(), n, "exp_avgs");
        same_length(exp_avg_sqs.size(), n, "exp_avg_sqs");
        same_length(steps.size(), n, "steps");
        same_length(grads.size(), n, "grads");
        if (computes) same_length(computes->size(), n, "computes");
        const AdamWConfig config = adamw_config(lr, beta1, beta2, eps, weight_decay, formula,
                                                torch_tail_width, torch_v_first);
        Launch l;
        std::vector<AdamWTensor> t(n);
        for (std::size_t i = 0; i < n; ++i) {
          const auto k = static_cast<std::ptrdiff_t>(i);
          t[i].param = l.tensor(params[i], ArgName{"params", k}, Access::write);
          t[i].exp_avg = l.tensor(exp_avgs[i], ArgName{"exp_avgs", k}, Access::write);
          t[i].exp_avg_sq = l.tensor(exp_avg_sqs[i], ArgName{"exp_avg_sqs", k}, Access::write);
          t[i].step = l.f32_scalar(steps[i], ArgName{"steps", k}, Access::write);
          t[i].grad = l.tensor(grads[i], ArgName{"grads", k}, Access::read);
          if (computes && !(*computes)[i].is_none())
            t[i].compute_param = l.tensor((*computes)[i], ArgName{"computes", k}, Access::write);
        }
        AdamWDeviceArgs d;
        d.scale = l.f32_scalar(scale, ArgName{"scale"}, Access::read);
        d.clip = l.f32_scalar(clip, ArgName{"clip"}, Access::read);
        d.bias_table = static_cast<const double*>(
            l.exact(bias_table, ArgName{"bias_table"}, Access::read, python::kF64,
                    bias_table_numel(config),
                    "the length of make_adamw_bias_table(beta1, beta2, formula=formula)")
                .data);
        if (!found_inf.is_none())
          d.found_inf = l.found_inf(found_inf, ArgName{"found_inf"}, Access::read);
        if (!hyper.is_none()) d.hyper = l.hyper(hyper, ArgName{"hyper"});
        nb::gil_scoped_release release;
        gpu::adamw_step(t, config, d, s);
      },
      nb::arg("params"), nb::arg("exp_avgs"), nb::arg("exp_avg_sqs"), nb::arg("steps"),
      nb::arg("grads"), nb::arg("computes").none() = nb::none(), nb::kw_only(), nb::arg("scale"),
      nb::arg("clip"), nb::arg("bias_table"), nb::arg("found_inf").none() = nb::none(),
      nb::arg("hyper").none() = nb::none(), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"),
      nb::arg("eps"), nb::arg("weight_decay"), nb::arg("formula") = "torch",
      nb::arg("torch_tail_width") = kTorchTailWidth, nb::arg("torch_v_first") = kTorchVFirst,
      nb::arg("stream").none() = nb::none(),
      "AdamW on device tensors, bit-identical to Engine.adamw_step: grads read as "
      "R(R(g * scale) * clip) with scale, clip (float32), steps (float32 counters, "
      "incremented on the device), found_inf (int32: != 0 writes nothing), hyper (float64 "
      "lr, weight_decay, else the keywords') and bias_table in device memory, read when the "
      "kernels run.");

  m.def(
      "sign_sgd_step",
      [](const Objects& params, const Objects& grads, std::optional<Objects> computes,
         nb::handle found_inf, nb::handle hyper, double lr, double weight_decay,
         nb::handle stream) {
        const cudaStream_t s = launch_stream(stream, first_of(params, nb::handle()));
        const std::size_t n = params.size();
        same_length(grads.size(), n, "grads");
        if (computes) same_length(computes->size(), n, "computes");
        SignSgdConfig config;
        config.lr = lr;
        config.weight_decay = weight_decay;
        Launch l;
        std::vector<SignSgdTensor> t(n);
        for (std::size_t i = 0; i < n; ++i) {
          const auto k = static_cast<std::ptrdiff_t>(i);
          t[i].param = l.tensor(params[i], ArgName{"params", k}, Access::write);
          t[i].grad = l.tensor(grads[i], ArgName{"grads", k}, Access::read);
          if (computes && !(*computes)[i].is_none())
            t[i].compute_param = l.tensor((*computes)[i], ArgName{"computes", k}, Access::write);
        }
        SignSgdDeviceArgs d;
        if (!found_inf.is_none())
          d.found_inf = l.found_inf(found_inf, ArgName{"found_inf"}, Access::read);
        if (!hyper.is_none()) d.hyper = l.hyper(hyper, ArgName{"hyper"});
        nb::gil_scoped_release release;
        gpu::sign_sgd_step(t, config, d, s);
      },
      nb::arg("params"), nb::arg("grads"), nb::arg("computes").none() = nb::none(), nb::kw_only(),
      nb::arg("found_inf").none() = nb::none(), nb::arg("hyper").none() = nb::none(), nb::arg("lr"),
      nb::arg("weight_decay") = 0.0, nb::arg("stream").none() = nb::none(),
      "SignSGD on device tensors, bit-identical to Engine.sign_sgd_step; found_inf (int32) "
      "!= 0 writes nothing; hyper (float64 lr, weight_decay) overrides the keywords.");

  m.def(
      "partial_words",
      [](nb::handle host_partial) {
        return python::partial_array(host_record<NormPartial>(
            host_partial, "partial", "a NormPartial (NORM_PARTIAL_BYTES)"));
      },
      nb::arg("partial"),
      "The PARTIAL_WORDS int64 words (Engine.norm_partial's layout, for stepcore.finalize) "
      "of a NormPartial copied to the host (a CPU uint8/int64 array of NORM_PARTIAL_BYTES).");

  m.def(
      "result_values",
      [](nb::handle host_result) {
        const NormResult r =
            host_record<NormResult>(host_result, "result", "a NormResult (NORM_RESULT_BYTES)");
        return nb::make_tuple(r.norm, r.finite, r.max_abs, r.needs_exact);
      },
      nb::arg("result"),
      "(norm, finite, max_abs, needs_exact), as stepcore.finalize returns them, of a "
      "NormResult copied to the host (a CPU uint8/int64 array of NORM_RESULT_BYTES).");
}
