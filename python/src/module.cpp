// stepcore._core: the thin nanobind layer over the public C++ API. Arrays come in through
// DLPack (torch tensors, numpy arrays) without copies; each is checked (CPU memory,
// C-contiguous, a dtype stepcore knows) and named ("params[3]") before any kernel runs,
// stepcore::Error becomes ValueError / TypeError / NotImplementedError / RuntimeError
// with the C++ message (which names the argument), and the GIL is released around every
// kernel. No torch at build or import time.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "stepcore/config.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/error.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace nb = nanobind;
using namespace stepcore;

namespace {

// ---- arrays -------------------------------------------------------------------------

using Array = nb::ndarray<>;              // writable, any dtype and device (checked here)
using ConstArray = nb::ndarray<nb::ro>;   // read-only view accepted too
using Objects = std::vector<nb::object>;  // a Python list of arrays, converted one by one

// The Python exception for a bad array: TypeError for its dtype, ValueError otherwise.
[[noreturn]] void bad_array(bool type_error, const std::string& name, const std::string& why) {
  const std::string msg =
      "stepcore: " + std::string(type_error ? "unsupported_dtype" : "invalid_argument") + " in '" +
      name + "': " + why;
  if (type_error) throw nb::type_error(msg.c_str());
  throw nb::value_error(msg.c_str());
}

// Returns the stepcore dtype of a DLPack dtype, or throws TypeError naming `name`.
DType dtype_of(nb::dlpack::dtype t, const std::string& name) {
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  if (t.lanes == 1) {
    if (code == nb::dlpack::dtype_code::Float && t.bits == 32) return DType::f32;
    if (code == nb::dlpack::dtype_code::Float && t.bits == 16) return DType::f16;
    if (code == nb::dlpack::dtype_code::Bfloat && t.bits == 16) return DType::bf16;
  }
  bad_array(true, name,
            "dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
                " bits) is not float32, bfloat16 or float16");
}

// Checks that `a` is C-contiguous CPU memory and returns its view (numel, dtype).
template <class A>
TensorView view_of(const A& a, const std::string& name) {
  if (a.device_type() != nb::device::cpu::value)
    bad_array(false, name,
              "must be CPU memory (device type " + std::to_string(a.device_type()) +
                  "); the CPU engine reads and writes host memory");
  std::int64_t expect = 1;
  std::size_t numel = 1;
  for (std::size_t d = 0; d < a.ndim(); ++d) numel *= a.shape(d);
  for (std::size_t d = a.ndim(); d-- > 0 && numel != 0;) {  // an empty array has any strides
    if (a.shape(d) != 1 && a.stride(d) != expect)
      bad_array(false, name,
                "must be C-contiguous (dimension " + std::to_string(d) + " has stride " +
                    std::to_string(a.stride(d)) + ", not " + std::to_string(expect) + ")");
    expect *= static_cast<std::int64_t>(a.shape(d));
  }
  return TensorView{const_cast<void*>(static_cast<const void*>(a.data())), numel,
                    dtype_of(a.dtype(), name)};
}

std::string indexed(const char* base, std::size_t i) {
  return std::string(base) + "[" + std::to_string(i) + "]";
}

// Returns `h` as an array, or throws TypeError naming `name` (a meta tensor, a list, ...).
template <class A>
A array_of(nb::handle h, const std::string& name) {
  A a;
  if (!nb::try_cast(h, a))
    bad_array(true, name,
              "a " + std::string(nb::type_name(h.type()).c_str()) +
                  " is not an array stepcore can read (DLPack or the buffer protocol, in CPU or "
                  "CUDA memory)");
  return a;
}

// The arrays of a Python list, each converted and named base[i].
template <class A>
std::vector<A> arrays_of(const std::vector<nb::object>& list, const char* base) {
  std::vector<A> out;
  out.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i)
    out.push_back(array_of<A>(list[i], indexed(base, i)));
  return out;
}

// The optional compute outputs: None, or a list whose entries are None or arrays.
std::optional<std::vector<std::optional<Array>>> optional_arrays(const std::optional<Objects>& in) {
  if (!in) return std::nullopt;
  std::vector<std::optional<Array>> out;
  for (std::size_t i = 0; i < in->size(); ++i)
    out.push_back((*in)[i].is_none() ? std::optional<Array>{}
                                     : array_of<Array>((*in)[i], indexed("computes", i)));
  return out;
}

template <class A>
std::vector<TensorView> views_of(const std::vector<A>& list, const char* base) {
  std::vector<TensorView> out;
  out.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) out.push_back(view_of(list[i], indexed(base, i)));
  return out;
}

// Throws ValueError naming `name` unless `got` == `want` list entries.
void same_length(std::size_t got, std::size_t want, const char* name) {
  if (got != want)
    throw nb::value_error(("stepcore: size_mismatch in '" + std::string(name) +
                           "': " + std::to_string(got) + " entries for " + std::to_string(want) +
                           " tensors")
                              .c_str());
}

// ---- the engine ---------------------------------------------------------------------

AdamWFormula parse_formula(const std::string& name) {
  if (name == "torch") return AdamWFormula::torch;
  if (name == "native") return AdamWFormula::native;
  throw nb::value_error(
      ("stepcore: invalid_argument in 'formula': '" + name + "': expected 'torch' or 'native'")
          .c_str());
}

// The AdamW configuration of the keyword arguments (validated by the engine's call).
AdamWConfig adamw_config(double lr, double beta1, double beta2, double eps, double weight_decay,
                         const std::string& formula, int torch_tail_width) {
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

// The partial as a plain int64 vector: 20 digits, nan_count, inf_count, max_abs_bits,
// approximate (kPartialWords). SUM of every word but max_abs_bits, MAX of that one,
// combine partials exactly (the digits stay below 2^63 for up to 2^31 partials).
constexpr std::size_t kPartialWords = kNormDigits + 4;
constexpr std::size_t kMaxAbsWord = kNormDigits + 2;

nb::ndarray<nb::numpy, std::int64_t, nb::shape<-1>> partial_array(const NormPartial& p) {
  auto* words = new std::int64_t[kPartialWords];
  for (int k = 0; k < kNormDigits; ++k) words[k] = static_cast<std::int64_t>(p.digits[k]);
  words[kNormDigits] = static_cast<std::int64_t>(p.nan_count);
  words[kNormDigits + 1] = static_cast<std::int64_t>(p.inf_count);
  words[kMaxAbsWord] = static_cast<std::int64_t>(p.max_abs_bits);
  words[kNormDigits + 3] = static_cast<std::int64_t>(p.approximate);
  nb::capsule owner(words, [](void* w) noexcept { delete[] static_cast<std::int64_t*>(w); });
  return {words, {kPartialWords}, owner};
}

NormPartial partial_of(const nb::ndarray<nb::ro, std::int64_t, nb::shape<-1>, nb::device::cpu>& a) {
  if (a.shape(0) != kPartialWords)
    throw nb::value_error(("stepcore: size_mismatch in 'partial': " + std::to_string(a.shape(0)) +
                           " words, expected " + std::to_string(kPartialWords))
                              .c_str());
  NormPartial p;
  auto word = [&](std::size_t k, const char* what) {
    const std::int64_t v = a.data()[k * static_cast<std::size_t>(a.stride(0))];
    if (v < 0)
      throw nb::value_error(("stepcore: out_of_range in 'partial': " + std::string(what) +
                             " is negative (" + std::to_string(v) + ")")
                                .c_str());
    return static_cast<std::uint64_t>(v);
  };
  for (int k = 0; k < kNormDigits; ++k) p.digits[k] = word(static_cast<std::size_t>(k), "a digit");
  if (!detail::normalize_digits(p.digits))
    throw nb::value_error("stepcore: out_of_range in 'partial': the digits overflow");
  p.nan_count = word(kNormDigits, "nan_count");
  p.inf_count = word(kNormDigits + 1, "inf_count");
  const std::uint64_t max_bits = word(kMaxAbsWord, "max_abs_bits");
  if (max_bits > 0x7F7FFFFFull)
    throw nb::value_error(
        "stepcore: out_of_range in 'partial': max_abs_bits is not a finite "
        "non-negative float");
  p.max_abs_bits = static_cast<std::uint32_t>(max_bits);
  p.approximate = word(kNormDigits + 3, "approximate") != 0 ? 1u : 0u;
  return p;
}

// ---- the private AdamW table (stepcore.torch's cached step) ----------------------------

// The columns of one row of Engine._adamw_step_table's int64 table, one row per tensor.
enum AdamWColumn : std::size_t {
  kColParam,
  kColExpAvg,
  kColExpAvgSq,
  kColStep,
  kColGrad,
  kColGradDType,
  kColCompute,
  kColComputeDType,
  kColNumel,
  kAdamWColumns
};

using AdamWTable = nb::ndarray<nb::ro, std::int64_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>;

// Returns the stepcore dtype of a table code (0 f32, 1 bf16, 2 f16), or throws naming base[i].
DType table_dtype(std::int64_t code, const char* base, std::size_t i) {
  if (code == static_cast<std::int64_t>(DType::f32)) return DType::f32;
  if (code == static_cast<std::int64_t>(DType::bf16)) return DType::bf16;
  if (code == static_cast<std::int64_t>(DType::f16)) return DType::f16;
  bad_array(true, indexed(base, i),
            "dtype code " + std::to_string(code) + " is not 0 (f32), 1 (bf16) or 2 (f16)");
}

// Throws ValueError naming 'table' unless it has kAdamWColumns columns.
void check_table_columns(const AdamWTable& table) {
  if (table.shape(1) != kAdamWColumns)
    throw nb::value_error(("stepcore: size_mismatch in 'table': " + std::to_string(table.shape(1)) +
                           " columns, expected " + std::to_string(kAdamWColumns))
                              .c_str());
}

// The AdamW tensors of a table's rows; the pointers are taken as given (unchecked), the
// engine then validates null pointers, sizes, dtypes and overlaps before writing.
std::vector<AdamWTensor> tensors_of_table(const AdamWTable& table) {
  check_table_columns(table);
  const std::size_t n = table.shape(0);
  std::vector<AdamWTensor> t(n);
  const std::int64_t* row = table.data();
  for (std::size_t i = 0; i < n; ++i, row += kAdamWColumns) {
    const auto ptr = [&](AdamWColumn c) {
      return reinterpret_cast<void*>(static_cast<std::uintptr_t>(row[c]));
    };
    if (row[kColNumel] < 0)
      bad_array(false, indexed("table", i),
                "numel " + std::to_string(row[kColNumel]) + " is negative");
    const auto numel = static_cast<std::size_t>(row[kColNumel]);
    t[i].param = TensorView{ptr(kColParam), numel, DType::f32};
    t[i].exp_avg = TensorView{ptr(kColExpAvg), numel, DType::f32};
    t[i].exp_avg_sq = TensorView{ptr(kColExpAvgSq), numel, DType::f32};
    t[i].step = static_cast<float*>(ptr(kColStep));
    t[i].grad = ConstTensorView{ptr(kColGrad), numel, table_dtype(row[kColGradDType], "grads", i)};
    if (row[kColCompute] != 0)
      t[i].compute_param =
          TensorView{ptr(kColCompute), numel, table_dtype(row[kColComputeDType], "computes", i)};
  }
  return t;
}

// Returns the Python name of a C++ argument: "tensors[3].grad" -> "grads[3]",
// "config.beta1" -> "beta1", "read.scale" -> "grad_scale", "pairs[2].src" -> "srcs[2]".
std::string python_name(const std::string& arg) {
  static const std::pair<const char*, const char*> fields[] = {
      {".param", "params"},     {".exp_avg_sq", "exp_avg_sqs"},
      {".exp_avg", "exp_avgs"}, {".step", "steps"},
      {".grad", "grads"},       {".compute_param", "computes"},
      {".acc", "accs"},         {".src", "srcs"}};
  const auto open = arg.find('[');
  const auto close = arg.find(']');
  if ((arg.rfind("tensors[", 0) == 0 || arg.rfind("pairs[", 0) == 0) &&
      close != std::string::npos && close + 1 < arg.size()) {
    const std::string field = arg.substr(close + 1);
    for (const auto& [suffix, list] : fields)
      if (field == suffix) return std::string(list) + arg.substr(open, close - open + 1);
  }
  if (arg.rfind("config.", 0) == 0) return arg.substr(7);
  if (arg == "read.scale") return "grad_scale";
  if (arg == "read.clip") return "clip";
  return arg;
}

// The C++ message with the argument renamed for Python.
std::string python_message(const Error& e) {
  std::string what = e.what();
  const std::string from = "'" + e.argument() + "'";
  const auto at = what.find(from);
  if (!e.argument().empty() && at != std::string::npos)
    what.replace(at, from.size(), "'" + python_name(e.argument()) + "'");
  return what;
}

}  // namespace

void bind_managers(nb::module_& m);  // python/src/managers.cpp

NB_MODULE(_core, m) {
  m.doc() = "stepcore's C++ core: the CPU engine and the exact norm (thin binding)";
  m.attr("__version__") = STEPCORE_VERSION_STRING;
  m.attr("PARTIAL_WORDS") = kPartialWords;
  m.attr("PARTIAL_MAX_ABS_WORD") = kMaxAbsWord;

  // stepcore::Error -> the Python exception for its code; the message names the argument.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      const std::string msg = python_message(e);
      PyObject* type = PyExc_RuntimeError;
      switch (e.code()) {
        case Errc::unsupported_dtype:
          type = PyExc_TypeError;
          break;
        case Errc::not_supported:
          type = PyExc_NotImplementedError;
          break;
        case Errc::invalid_argument:
        case Errc::null_pointer:
        case Errc::size_mismatch:
        case Errc::overlap:
        case Errc::non_finite:
        case Errc::out_of_range:
        case Errc::corrupt_file:
          type = PyExc_ValueError;
          break;
        case Errc::timeout:
          type = PyExc_TimeoutError;
          break;
        case Errc::io_error:
          type = PyExc_OSError;
          break;
        default:
          break;
      }
      PyErr_SetString(type, msg.c_str());
    }
  });

  m.def(
      "supported_isas",
      [] {
        std::vector<std::string> out;
        for (cpu::Isa isa : cpu::supported_isas()) out.emplace_back(cpu::isa_name(isa));
        return out;
      },
      "The ISAs this processor runs, lowest first.");

  nb::class_<cpu::Engine>(m, "Engine", "The SIMD CPU engine (ISA chosen at run time).")
      .def(
          "__init__",
          [](cpu::Engine* self, std::optional<std::string> isa, int threads,
             std::vector<int> cpus) {
            cpu::EngineConfig c;
            if (isa) c.isa = cpu::parse_isa(*isa);
            c.threads = threads;
            c.cpus = std::move(cpus);
            new (self) cpu::Engine(c);
          },
          nb::arg("isa") = nb::none(), nb::arg("threads") = 0, nb::arg("cpus") = std::vector<int>{})
      .def_prop_ro("isa", [](const cpu::Engine& e) { return std::string(e.isa_name()); })
      .def_prop_ro("threads", &cpu::Engine::threads)
      .def(
          "adamw_step",
          [](const cpu::Engine& e, const Objects& params_in, const Objects& exp_avgs_in,
             const Objects& exp_avg_sqs_in, const Objects& steps_in, const Objects& grads_in,
             std::optional<Objects> computes_in, double lr, double beta1, double beta2, double eps,
             double weight_decay, const std::string& formula, int torch_tail_width,
             float grad_scale, float clip) {
            const auto params = arrays_of<Array>(params_in, "params");
            const auto exp_avgs = arrays_of<Array>(exp_avgs_in, "exp_avgs");
            const auto exp_avg_sqs = arrays_of<Array>(exp_avg_sqs_in, "exp_avg_sqs");
            const auto steps = arrays_of<Array>(steps_in, "steps");
            const auto grads = arrays_of<ConstArray>(grads_in, "grads");
            const auto computes = optional_arrays(computes_in);
            const std::size_t n = params.size();
            same_length(exp_avgs.size(), n, "exp_avgs");
            same_length(exp_avg_sqs.size(), n, "exp_avg_sqs");
            same_length(steps.size(), n, "steps");
            same_length(grads.size(), n, "grads");
            if (computes) same_length(computes->size(), n, "computes");
            const AdamWConfig config =
                adamw_config(lr, beta1, beta2, eps, weight_decay, formula, torch_tail_width);
            std::vector<AdamWTensor> t(n);
            for (std::size_t i = 0; i < n; ++i) {
              t[i].param = view_of(params[i], indexed("params", i));
              t[i].exp_avg = view_of(exp_avgs[i], indexed("exp_avgs", i));
              t[i].exp_avg_sq = view_of(exp_avg_sqs[i], indexed("exp_avg_sqs", i));
              const TensorView s = view_of(steps[i], indexed("steps", i));
              if (s.dtype != DType::f32 || s.numel != 1)
                bad_array(s.dtype != DType::f32, indexed("steps", i),
                          "must be one float32 value (torch's 0-dim step tensor)");
              t[i].step = static_cast<float*>(s.data);
              t[i].grad = view_of(grads[i], indexed("grads", i));
              if (computes && (*computes)[i])
                t[i].compute_param = view_of(*(*computes)[i], indexed("computes", i));
            }
            nb::gil_scoped_release release;
            e.adamw_step(t, config, GradientRead{grad_scale, clip});
          },
          nb::arg("params"), nb::arg("exp_avgs"), nb::arg("exp_avg_sqs"), nb::arg("steps"),
          nb::arg("grads"), nb::arg("computes") = nb::none(), nb::kw_only(), nb::arg("lr"),
          nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"), nb::arg("weight_decay"),
          nb::arg("formula") = "torch", nb::arg("torch_tail_width") = 8,
          nb::arg("grad_scale") = 1.0f, nb::arg("clip") = 1.0f,
          "AdamW in place over every tensor (f32 params and moments, 0-dim f32 steps "
          "incremented first, f32/bf16/f16 grads read as R(R(g*grad_scale)*clip)); computes[i] "
          "receives params[i] rounded to its dtype. Bitwise: equals the reference for any ISA "
          "and thread count.")
      .def(
          "_adamw_step_table",
          [](const cpu::Engine& e, const AdamWTable& table, double lr, double beta1, double beta2,
             double eps, double weight_decay, const std::string& formula, int torch_tail_width,
             float grad_scale, float clip) {
            const AdamWConfig config =
                adamw_config(lr, beta1, beta2, eps, weight_decay, formula, torch_tail_width);
            const std::vector<AdamWTensor> t = tensors_of_table(table);
            nb::gil_scoped_release release;
            e.adamw_step(t, config, GradientRead{grad_scale, clip});
          },
          nb::arg("table"), nb::kw_only(), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"),
          nb::arg("eps"), nb::arg("weight_decay"), nb::arg("formula") = "torch",
          nb::arg("torch_tail_width") = 8, nb::arg("grad_scale") = 1.0f, nb::arg("clip") = 1.0f,
          "Private (stepcore.torch only): adamw_step over an int64 (n, 9) table of rows (param, "
          "exp_avg, exp_avg_sq, step, grad, grad dtype, compute or 0, compute dtype, numel); the "
          "addresses are UNCHECKED: they must be live contiguous CPU memory of that numel (the "
          "engine still checks nulls, dtypes, overlaps, steps, hyper-parameters before writing).")
      .def(
          "_check_table_steps",
          [](const cpu::Engine&, const AdamWTable& table) {
            check_table_columns(table);
            const std::int64_t* row = table.data();
            for (std::size_t i = 0; i < table.shape(0); ++i, row += kAdamWColumns) {
              const auto* step =
                  reinterpret_cast<const float*>(static_cast<std::uintptr_t>(row[kColStep]));
              const float s = step != nullptr ? *step : 0.0f;
              if (!(s >= 0.0f && s < 16777215.0f && s == std::floor(s)))
                bad_array(false, indexed("steps", i),
                          "step counter " + std::to_string(s) +
                              " is not an integer in [0, 2^24 - 1) (one more step must count "
                              "exactly in f32)");
            }
          },
          nb::arg("table"),
          "Private (stepcore.torch only): checks the step counters of an _adamw_step_table table "
          "(UNCHECKED addresses, as there), writing nothing: ValueError naming steps[i].")
      .def(
          "sign_sgd_step",
          [](const cpu::Engine& e, const Objects& params_in, const Objects& grads_in,
             std::optional<Objects> computes_in, double lr, double weight_decay) {
            const auto params = arrays_of<Array>(params_in, "params");
            const auto grads = arrays_of<ConstArray>(grads_in, "grads");
            const auto computes = optional_arrays(computes_in);
            const std::size_t n = params.size();
            same_length(grads.size(), n, "grads");
            if (computes) same_length(computes->size(), n, "computes");
            SignSgdConfig config;
            config.lr = lr;
            config.weight_decay = weight_decay;
            std::vector<SignSgdTensor> t(n);
            for (std::size_t i = 0; i < n; ++i) {
              t[i].param = view_of(params[i], indexed("params", i));
              t[i].grad = view_of(grads[i], indexed("grads", i));
              if (computes && (*computes)[i])
                t[i].compute_param = view_of(*(*computes)[i], indexed("computes", i));
            }
            nb::gil_scoped_release release;
            e.sign_sgd_step(t, config);
          },
          nb::arg("params"), nb::arg("grads"), nb::arg("computes") = nb::none(), nb::kw_only(),
          nb::arg("lr"), nb::arg("weight_decay") = 0.0,
          "SignSGD in place: p = p*(1 - lr*wd) - lr*sign(g) (docs/numerics.md section 8).")
      .def(
          "accumulate",
          [](const cpu::Engine& e, const Objects& accs_in, const Objects& srcs_in, bool copy) {
            const auto accs = arrays_of<Array>(accs_in, "accs");
            const auto srcs = arrays_of<ConstArray>(srcs_in, "srcs");
            same_length(srcs.size(), accs.size(), "srcs");
            std::vector<AccumulatePair> pairs(accs.size());
            for (std::size_t i = 0; i < accs.size(); ++i) {
              pairs[i].acc = view_of(accs[i], indexed("accs", i));
              pairs[i].src = view_of(srcs[i], indexed("srcs", i));
              pairs[i].copy = copy;
            }
            nb::gil_scoped_release release;
            e.accumulate(pairs);
          },
          nb::arg("accs"), nb::arg("srcs"), nb::arg("copy") = false,
          "acc = acc + f32(src) for every pair (acc = f32(src) with copy=True).")
      .def(
          "scale_",
          [](const cpu::Engine& e, const Objects& tensors, float factor) {
            const std::vector<TensorView> v =
                views_of(arrays_of<Array>(tensors, "tensors"), "tensors");
            nb::gil_scoped_release release;
            e.scale_(v, factor);
          },
          nb::arg("tensors"), nb::arg("factor"), "g = R(f32(g) * factor) in place.")
      .def(
          "norm_partial",
          [](const cpu::Engine& e, const Objects& tensors, float grad_scale, float clip,
             bool exact) {
            const std::vector<TensorView> v =
                views_of(arrays_of<ConstArray>(tensors, "tensors"), "tensors");
            const std::vector<ConstTensorView> cv(v.begin(), v.end());
            NormPartial p;
            {
              nb::gil_scoped_release release;
              p = e.norm_partial(cv, GradientRead{grad_scale, clip},
                                 exact ? NormMode::exact : NormMode::fast);
            }
            return partial_array(p);
          },
          nb::arg("tensors"), nb::arg("grad_scale") = 1.0f, nb::arg("clip") = 1.0f,
          nb::arg("exact") = false,
          "The norm partial of the values read as R(R(g*grad_scale)*clip), as PARTIAL_WORDS "
          "int64 words: SUM-all-reduce every word except PARTIAL_MAX_ABS_WORD (MAX) to combine "
          "ranks exactly. exact=True: the exact partial (finalize never asks for more).");

  m.def(
      "finalize",
      [](const nb::ndarray<nb::ro, std::int64_t, nb::shape<-1>, nb::device::cpu>& partial) {
        const NormResult r = finalize(partial_of(partial));
        return nb::make_tuple(r.norm, r.finite, r.max_abs, r.needs_exact);
      },
      nb::arg("partial"),
      "Returns (norm, finite, max_abs, needs_exact) of a (combined) partial: the correctly "
      "rounded f32 L2 norm; needs_exact: recompute with exact partials (norm unset).");

  m.def(
      "clip_coefficient",
      [](float norm, float max_norm) { return clip_coefficient(norm, max_norm); }, nb::arg("norm"),
      nb::arg("max_norm"),
      "min(1, max_norm / (norm + 1e-6)) in f32 as torch.nn.utils.clip_grad_norm_ computes it.");
  bind_managers(m);
}
