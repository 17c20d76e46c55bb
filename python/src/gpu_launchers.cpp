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
#include <utility>
#include <variant>
#include <vector>

#include "arrays.hpp"      // this extension's one checker of array and stream arguments
#include "optim_args.hpp"  // optimizers by name, their hyper-parameters from a dict
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
using python::ArgName;
using python::BufferArg;
using python::Memory;

// The device layouts Python code indexes (docs/python.md, "GPU launchers"); the partial's
// is partials.hpp's.
static_assert(sizeof(StepHyper) == 2 * sizeof(double) && offsetof(StepHyper, lr) == 0 &&
              offsetof(StepHyper, weight_decay) == sizeof(double));
static_assert(std::is_trivially_copyable_v<NormResult>);

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
// CUDA device, which is made the calling thread's current device from the first array on
// until the launch returns (the launchers launch on the current device and refuse a
// pointer of any other, naming it).
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
      const int present = cuda::device_count();
      if (present > 0 && (id < 0 || id >= present))
        bad("invalid_argument", name,
            "is on CUDA device " + std::to_string(id) + ", but " + std::to_string(present) +
                " devices are present");
      current_.emplace(id);  // no device usable: nothing changes (the library refuses)
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
  std::optional<cuda::CurrentDevice> current_;  // device_ current until the launch returns
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

// Returns the entries of make_optimizer_table(config): computed once per distinct
// configuration of the last few (under the GIL), keyed by the optimizer and every
// hyper-parameter but the schedule's (lr and weight decay, which the device reads from
// its StepHyper each step: the table cannot depend on them), so each step can check a
// table's length without rebuilding it. Builds (validates) the configuration.
std::size_t table_numel(const OptimizerConfig& config) {
  std::vector<double> key{static_cast<double>(config.index())};
  std::visit(
      [&key](const auto& c) {
        using C = std::decay_t<decltype(c)>;
        for (const HyperField<C>& f : OptimizerTraits<C>::kFields)
          if (f.role != HyperRole::schedule)
            std::visit([&](auto member) { key.push_back(static_cast<double>(c.*member)); },
                       f.member);
      },
      config);
  static std::array<std::pair<std::vector<double>, std::size_t>, 4> cache{};
  static std::size_t used = 0, next = 0;
  for (std::size_t k = 0; k < used; ++k)
    if (cache[k].first == key) return cache[k].second;
  const std::size_t numel = gpu::make_optimizer_table(config).size();
  cache[next] = {std::move(key), numel};
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
  m.attr("PARTIAL_SUM_WORDS") = python::kStructSumWords;
  m.attr("PARTIAL_MAX_INT32") = python::kStructMaxInt32;
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
      "q8_codebooks",
      [] {
        auto* words = new std::vector<std::uint32_t>(gpu::q8_codebooks());
        nb::capsule owner(
            words, [](void* w) noexcept { delete static_cast<std::vector<std::uint32_t>*>(w); });
        return nb::ndarray<nb::numpy, std::int32_t, nb::shape<-1>>(
            reinterpret_cast<std::int32_t*>(words->data()), {words->size()}, owner);
      },
      "The words optimizer_step reads to dequantize and requantize 8-bit state slots (both "
      "maps, both rounding rules and their code tables; docs/numerics.md 8f) as an int32 "
      "numpy array: copy it to the device once and pass it as optimizer_step's "
      "`q8_codebooks`.");

  m.def(
      "make_optimizer_table",
      [](const std::string& optimizer, nb::handle hyper) {
        const OptimizerConfig config = python::optimizer_config(optimizer, hyper);
        auto* table = new std::vector<double>(gpu::make_optimizer_table(config));
        nb::capsule owner(table,
                          [](void* t) noexcept { delete static_cast<std::vector<double>*>(t); });
        return nb::ndarray<nb::numpy, double, nb::shape<-1>>(table->data(), {table->size()}, owner);
      },
      nb::arg("optimizer"), nb::arg("hyper").none() = nb::none(),
      "The device table of the optimizer named `optimizer` with the hyper-parameters "
      "`hyper` (a dict, as Engine.step takes it) as a float64 numpy array: copy it to the "
      "device once (e.g. torch.from_numpy(t).cuda()) and pass it as optimizer_step's "
      "`table`. The binary64 values the device cannot compute bit-exactly, the host's bit "
      "for bit: AdamW's and Adam's bias corrections {len1, len2, 1 - beta1^t..., "
      "1 - beta2^t...}; empty for an optimizer that needs none.");

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
      "optimizer_step",
      [](const std::string& optimizer, const Objects& params, const std::vector<Objects>& states,
         std::optional<Objects> steps, const Objects& grads, std::optional<Objects> computes,
         nb::handle hyper, nb::handle scale, nb::handle clip, nb::handle table,
         nb::handle found_inf, nb::handle step_hyper, nb::handle q8_codebooks, nb::handle stream) {
        const cudaStream_t s = launch_stream(stream, first_of(params, scale));
        const std::size_t n = params.size();
        if (states.size() > static_cast<std::size_t>(kMaxOptimizerSlots))
          bad("invalid_argument", ArgName{"states"},
              std::to_string(states.size()) + " state lists; an optimizer keeps at most " +
                  std::to_string(kMaxOptimizerSlots));
        static const char* const kSlotLists[kMaxOptimizerSlots] = {"states[0]", "states[1]",
                                                                   "states[2]"};
        for (std::size_t k = 0; k < states.size(); ++k)
          same_length(states[k].size(), n, kSlotLists[k]);
        if (steps) same_length(steps->size(), n, "steps");
        same_length(grads.size(), n, "grads");
        if (computes) same_length(computes->size(), n, "computes");
        const OptimizerConfig config = python::optimizer_config(optimizer, hyper);
        Launch l;
        std::vector<OptimizerTensor> t(n);
        for (std::size_t i = 0; i < n; ++i) {
          const auto k = static_cast<std::ptrdiff_t>(i);
          t[i].param = l.tensor(params[i], ArgName{"params", k}, Access::write);
          for (std::size_t j = 0; j < states.size(); ++j) {
            if (!nb::isinstance<nb::tuple>(states[j][i])) {
              t[i].state[j] = l.tensor(states[j][i], ArgName{kSlotLists[j], k}, Access::write);
              continue;
            }
            // An 8-bit slot (docs/numerics.md 8f): (uint8 codes, float32 block maxima).
            const nb::tuple pair = nb::borrow<nb::tuple>(states[j][i]);
            if (pair.size() != 2)
              bad("invalid_argument", ArgName{kSlotLists[j], k},
                  "an 8-bit slot is a (codes, absmax) pair");
            const std::size_t numel = t[i].param.numel;
            const std::size_t blocks = (numel + kQ8BlockSize - 1) / kQ8BlockSize;
            t[i].q8[j].codes = static_cast<std::uint8_t*>(
                l.exact(pair[0], ArgName{kSlotLists[j], k}, Access::write, python::kU8, numel,
                        "one uint8 code per element of the param")
                    .data);
            t[i].q8[j].absmax = static_cast<float*>(
                l.exact(pair[1], ArgName{kSlotLists[j], k}, Access::write, python::kF32, blocks,
                        "one float32 maximum per block of 256 elements")
                    .data);
          }
          if (steps) t[i].step = l.f32_scalar((*steps)[i], ArgName{"steps", k}, Access::write);
          t[i].grad = l.tensor(grads[i], ArgName{"grads", k}, Access::read);
          if (computes && !(*computes)[i].is_none())
            t[i].compute_param = l.tensor((*computes)[i], ArgName{"computes", k}, Access::write);
        }
        OptimizerDeviceArgs d;
        if (!scale.is_none()) d.scale = l.f32_scalar(scale, ArgName{"scale"}, Access::read);
        if (!clip.is_none()) d.clip = l.f32_scalar(clip, ArgName{"clip"}, Access::read);
        const std::size_t table_entries = table_numel(config);
        if (table_entries > 0) {
          if (table.is_none())
            bad("null_pointer", ArgName{"table"},
                "required: make_optimizer_table('" + optimizer + "', hyper) in device memory");
          d.table = static_cast<const double*>(
              l.exact(table, ArgName{"table"}, Access::read, python::kF64, table_entries,
                      "the length of make_optimizer_table(optimizer, hyper)")
                  .data);
        } else if (!table.is_none()) {
          bad("invalid_argument", ArgName{"table"},
              "'" + optimizer + "' has no table (make_optimizer_table is empty): pass None");
        }
        if (!found_inf.is_none())
          d.found_inf = l.found_inf(found_inf, ArgName{"found_inf"}, Access::read);
        if (!step_hyper.is_none()) d.hyper = l.hyper(step_hyper, ArgName{"step_hyper"});
        static const std::size_t kCodebookWords = gpu::q8_codebooks().size();  // built once
        if (!q8_codebooks.is_none())
          d.q8_codebooks = static_cast<const std::uint32_t*>(
              l.exact(q8_codebooks, ArgName{"q8_codebooks"}, Access::read, python::kI32,
                      kCodebookWords, "the length of q8_codebooks()")
                  .data);
        nb::gil_scoped_release release;
        gpu::optimizer_step(t, config, d, s);
      },
      nb::arg("optimizer"), nb::arg("params"), nb::arg("states"), nb::arg("steps").none(),
      nb::arg("grads"), nb::arg("computes").none() = nb::none(), nb::kw_only(),
      nb::arg("hyper").none() = nb::none(), nb::arg("scale").none() = nb::none(),
      nb::arg("clip").none() = nb::none(), nb::arg("table").none() = nb::none(),
      nb::arg("found_inf").none() = nb::none(), nb::arg("step_hyper").none() = nb::none(),
      nb::arg("q8_codebooks").none() = nb::none(), nb::arg("stream").none() = nb::none(),
      "One step of the optimizer named `optimizer` on device tensors, bit-identical to "
      "Engine.step with the same arguments: states[k][i] tensor i's state slot k in the "
      "optimizer's slot order, steps float32 counters (None for an optimizer that keeps "
      "none), incremented on the device; `hyper` its hyper-parameters (a dict, as "
      "Engine.step). In device memory, read when the kernels run: scale and clip (float32; "
      "required when the optimizer's gradient read applies them: grads read as "
      "R(R(g * scale) * clip)), table (float64: make_optimizer_table(optimizer, hyper), "
      "required when that is not empty), found_inf (int32: != 0 writes nothing, counters "
      "kept), step_hyper (float64 lr, weight_decay, else the dict's) and q8_codebooks "
      "(int32: q8_codebooks(), required when a states[k][i] is an 8-bit (codes, absmax) "
      "pair, as Engine.step takes it: uint8 codes and float32 block maxima on the device).");

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
