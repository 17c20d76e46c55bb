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
#include <variant>
#include <vector>

#include "arrays.hpp"      // this extension's one checker of array and stream arguments
#include "optim_args.hpp"  // optimizers by name, their hyper-parameters from a dict
#include "partials.hpp"    // a norm partial as PARTIAL_WORDS int64 words
#include "stepcore/config.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace nb = nanobind;
using namespace stepcore;

namespace {

// ---- arrays (arrays.hpp: the C exchange API or nanobind's ndarray, one check) ---------

using Objects = std::vector<nb::object>;  // a Python list of arrays, converted one by one
using python::Access;
using python::ArgName;
using python::kMaxAbsWord;
using python::kPartialWords;
using python::Memory;
using python::partial_array;

// The Python exception for a bad argument: TypeError for its dtype, ValueError otherwise.
[[noreturn]] void bad_array(bool type_error, const std::string& name, const std::string& why) {
  const std::string msg =
      "stepcore: " + std::string(type_error ? "unsupported_dtype" : "invalid_argument") + " in '" +
      name + "': " + why;
  if (type_error) throw nb::type_error(msg.c_str());
  throw nb::value_error(msg.c_str());
}

std::string indexed(const char* base, std::size_t i) {
  return ArgName{base, static_cast<std::ptrdiff_t>(i)}.str();
}

// The checked CPU view of list entry base[i].
TensorView cpu_view(nb::handle h, const char* base, std::size_t i, Access access) {
  return python::array_arg(h, ArgName{base, static_cast<std::ptrdiff_t>(i)}, Memory::cpu, access)
      .view;
}

// The checked CPU views of a Python list's arrays, each named base[i].
std::vector<TensorView> cpu_views(const Objects& list, const char* base, Access access) {
  std::vector<TensorView> out;
  out.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) out.push_back(cpu_view(list[i], base, i, access));
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

/// The NormOrder of a partial's Python `order` (2 or 1).
NormOrder norm_order(int order) {
  if (order == 2) return NormOrder::two;
  if (order == 1) return NormOrder::one;
  throw nb::value_error(("stepcore: invalid_argument in 'order': " + std::to_string(order) +
                         " (a norm partial's order is 2 or 1)")
                            .c_str());
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
  if (!stepcore::normalize(p))
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

// ---- stepcore.torch's cached optimizer rows (private) ----------------------------------

// Whether dict `d` holds exactly n entries, entry i being key(i): value(i) by identity (`is`),
// in order: PyDict_Next over its entries, no hashing, the same test on every CPython.
template <class Key, class Value>
bool dict_holds(PyObject* d, std::size_t n, Key key, Value value) {
  if (static_cast<std::size_t>(PyDict_Size(d)) != n) return false;
  Py_ssize_t pos = 0;
  PyObject* k = nullptr;
  PyObject* v = nullptr;
  for (std::size_t i = 0; i < n; ++i)  // n entries: PyDict_Next yields each once
    if (!PyDict_Next(d, &pos, &k, &v) || k != key(i) || v != value(i)) return false;
  return true;
}

// One param group's rows for any optimizer, built from objects stepcore.torch checked in
// full, and re-read on every step at C speed: each param's grad (via the `grad`
// attribute) and the param and grad arrays themselves (so replaced grads and swapped param
// storage are seen), every entry of each state dict by identity, in order (PyDict_Next:
// the slots' keys, in the unit's slot order, the step counter's key when the counter lives
// there, and any other key: an entry added, removed or replaced makes the rows stale;
// swapping a state tensor's storage in place is not supported), the compute copies' arrays.
// Counters that do not live in the state dict (torch's SGD keeps none; stepcore.torch keeps them
// beside it) are given as tensors. Anything that no longer matches the full check's result makes
// step() return False having written nothing; the torch layer then rebuilds the rows through the
// full check, which names the bad argument.
class OptimizerRows {
 public:
  // `params`: the group's params in order; `rows`: the positions that have state rows;
  // `states`: their state dicts; `slot_keys`: the state keys of the optimizer's slots, in
  // its slot order; `step_key`: the state key of the step counter, or None; `counters`:
  // None, or the counters (one per row) when step_key is None; `computes`: None or one
  // entry (None or array) per row; `grad_types`: the exact types a grad may have.
  OptimizerRows(Objects params, std::vector<std::size_t> rows, Objects states,
                std::vector<std::string> slot_keys, std::optional<std::string> step_key,
                std::optional<Objects> counters, std::optional<Objects> computes,
                Objects grad_types)
      : params_(std::move(params)), states_(std::move(states)), grad_types_(std::move(grad_types)) {
    same_length(states_.size(), rows.size(), "states");
    if (slot_keys.size() > static_cast<std::size_t>(kMaxOptimizerSlots))
      throw nb::value_error("stepcore: invalid_argument in 'slot_keys': more than 3 slots");
    if (step_key && counters)
      throw nb::value_error(
          "stepcore: invalid_argument in 'counters': given with a step_key (one place only)");
    if (counters) same_length(counters->size(), rows.size(), "counters");
    if (computes) same_length(computes->size(), rows.size(), "computes");
    slots_ = static_cast<int>(slot_keys.size());
    for (const std::string& k : slot_keys) keys_.push_back(nb::steal(intern(k)));
    if (step_key) keys_.push_back(nb::steal(intern(*step_key)));
    row_of_.assign(params_.size(), kNoRow);
    for (std::size_t r = 0; r < rows.size(); ++r) {
      if (rows[r] >= params_.size() || row_of_[rows[r]] != kNoRow)
        throw nb::value_error("stepcore: invalid_argument in 'rows': not distinct param indices");
      row_of_[rows[r]] = r;
    }
    const std::size_t nk = keys_.size();
    tensors_.resize(rows.size());
    grad_objects_.resize(rows.size());
    state_objects_.resize(nk * rows.size());
    items_begin_.assign(rows.size() + 1, 0);
    computes_.resize(rows.size());
    if (counters) counters_ = std::move(*counters);
    static const char* const kSlotLists[kMaxOptimizerSlots] = {"states[0]", "states[1]",
                                                               "states[2]"};
    for (std::size_t r = 0; r < rows.size(); ++r) {
      const nb::handle st = states_[r];
      if (!PyDict_Check(st.ptr()))
        throw nb::type_error("stepcore: invalid_argument in 'states': not a dict");
      for (std::size_t k = 0; k < nk; ++k) {
        PyObject* v = PyDict_GetItemWithError(st.ptr(), keys_[k].ptr());
        if (v == nullptr) {
          if (PyErr_Occurred()) throw nb::python_error();
          throw nb::value_error(("stepcore: invalid_argument in 'states': a state lacks '" +
                                 nb::cast<std::string>(keys_[k]) + "'")
                                    .c_str());
        }
        state_objects_[nk * r + k] = nb::borrow(v);
      }
      Py_ssize_t pos = 0;
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      while (PyDict_Next(st.ptr(), &pos, &key, &value)) {
        items_.push_back(nb::borrow(key));
        items_.push_back(nb::borrow(value));
      }
      items_begin_[r + 1] = items_.size();
      for (int s = 0; s < slots_; ++s)
        tensors_[r].state[s] = cpu_view(state_objects_[nk * r + static_cast<std::size_t>(s)],
                                        kSlotLists[s], r, Access::write);
      if (step_key || counters) {
        const nb::handle counter =
            step_key ? nb::handle(state_objects_[nk * r + nk - 1]) : nb::handle(counters_[r]);
        const TensorView step = cpu_view(counter, "steps", r, Access::write);
        if (step.dtype != DType::f32 || step.numel != 1)
          bad_array(step.dtype != DType::f32, indexed("steps", r),
                    "must be one float32 value (torch's 0-dim step tensor)");
        tensors_[r].step = static_cast<float*>(step.data);
      }
      if (computes && !(*computes)[r].is_none()) computes_[r] = (*computes)[r];
    }
  }

  // Re-reads the rows with each param's current grad (or `grads`, one per row, when given:
  // the torch layer's unscaled quotients). Returns false when they are stale.
  bool prepare(nb::handle group_params, const std::optional<Objects>& grads) {
    prepared_ = false;
    if (!PyList_Check(group_params.ptr()) ||
        static_cast<std::size_t>(PyList_GET_SIZE(group_params.ptr())) != params_.size())
      return false;
    if (grads && grads->size() != tensors_.size()) return false;
    // The state dicts first, in a loop of their own: its memory reads are independent, so
    // the processor overlaps them (between the calls into torch below it could not).
    for (std::size_t r = 0; r < tensors_.size(); ++r)
      if (!same_items(r)) return false;
    static PyObject* const grad_name = PyUnicode_InternFromString("grad");
    for (std::size_t i = 0; i < params_.size(); ++i) {
      PyObject* p = PyList_GET_ITEM(group_params.ptr(), static_cast<Py_ssize_t>(i));
      if (p != params_[i].ptr()) return false;
      PyObject* g = PyObject_GetAttr(p, grad_name);
      if (g == nullptr) throw nb::python_error();
      const nb::object grad = nb::steal(g);
      const std::size_t r = row_of_[i];
      if (r == kNoRow) {
        if (!grad.is_none()) return false;  // a param gained a grad: it needs state
        continue;
      }
      if (grad.is_none() || !known_grad_type(grad)) return false;
      OptimizerTensor& t = tensors_[r];
      try {
        t.param = cpu_view(p, "params", r, Access::write);
        // The param dtypes the engine steps (stepcore.torch's _PARAM_DTYPES: f32, bf16, f16),
        // each state slot in the param's dtype (docs/numerics.md 7.3).
        if (t.param.dtype != DType::f32 && t.param.dtype != DType::bf16 &&
            t.param.dtype != DType::f16)
          return false;
        for (int s = 0; s < slots_; ++s)
          if (t.state[s].dtype != t.param.dtype) return false;
        const nb::handle read = grads ? nb::handle((*grads)[r]) : nb::handle(grad);
        const TensorView gv = cpu_view(read, "grads", r, Access::read);
        if (gv.numel != t.param.numel) return false;
        t.grad = gv;
        grad_objects_[r] = nb::borrow(read);  // alive until run()
        t.compute_param = computes_[r].is_valid()
                              ? cpu_view(computes_[r], "computes", r, Access::write)
                              : TensorView{};
      } catch (const nb::builtin_exception&) {
        return false;  // the full check names what is wrong
      }
      for (int s = 0; s < slots_; ++s)
        if (t.state[s].numel != t.param.numel) return false;
      if (t.step != nullptr) {
        const float counter = *t.step;  // written in place? the full check names it
        if (!(counter >= 0.0f && counter < 16777215.0f && counter == std::floor(counter)))
          return false;
      }
    }
    prepared_ = true;
    return true;
  }

  // One step of `config` over the rows prepare() just read (their objects must still be
  // alive: the caller holds them). Raises what the engine raises, before writing anything.
  void run(const cpu::Engine& e, const OptimizerConfig& config, GradientRead read) {
    if (!prepared_)
      throw nb::value_error("stepcore: invalid_argument in 'rows': run() without prepare()");
    prepared_ = false;
    const auto release_grads = [&] {
      for (nb::object& g : grad_objects_) g.reset();
    };
    try {
      nb::gil_scoped_release release;
      std::visit([&](const auto& c) { e.step(tensors_, c, read); }, config);
    } catch (...) {
      release_grads();
      throw;
    }
    release_grads();
  }

 private:
  static constexpr std::size_t kNoRow = static_cast<std::size_t>(-1);

  static PyObject* intern(const std::string& s) {
    PyObject* o = PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
    if (o == nullptr) throw nb::python_error();
    PyUnicode_InternInPlace(&o);
    return o;
  }

  // Whether row r's state dict holds exactly the entries it held when the rows were built
  // (every entry, not only the slots' and the counter's).
  bool same_items(std::size_t r) const {
    const std::size_t begin = items_begin_[r];
    return dict_holds(
        states_[r].ptr(), (items_begin_[r + 1] - begin) / 2,
        [&](std::size_t i) { return items_[begin + 2 * i].ptr(); },
        [&](std::size_t i) { return items_[begin + 2 * i + 1].ptr(); });
  }

  bool known_grad_type(nb::handle g) const {
    for (const nb::object& t : grad_types_)
      if (reinterpret_cast<PyObject*>(Py_TYPE(g.ptr())) == t.ptr()) return true;
    return false;
  }

  Objects params_;                        // the group's params, in order (identity)
  std::vector<std::size_t> row_of_;       // param index -> row, kNoRow without state
  Objects states_;                        // per row: the state dict
  Objects keys_;                          // the slot keys, then the step key (if any)
  int slots_ = 0;                         // how many of keys_ are slots
  Objects state_objects_;                 // per row: keys_'s entries (identity)
  Objects items_;                         // every state dict's keys and values, in order
  std::vector<std::size_t> items_begin_;  // row r's items: [items_begin_[r], [r + 1])
  Objects counters_;                      // per row: the counter, when not in the state
  Objects computes_;                      // per row: the compute copy or an invalid handle
  Objects grad_types_;                    // exact types a grad may have
  Objects grad_objects_;                  // per row: the grad prepare() read, until run()
  std::vector<OptimizerTensor> tensors_;  // per row: the views prepare() read
  bool prepared_ = false;                 // prepare() succeeded and run() has not run since
};

// Returns the Python name of a C++ argument: "tensors[3].grad" -> "grads[3]",
// "config.beta1" -> "beta1", "read.scale" -> "grad_scale", "pairs[2].src" -> "srcs[2]",
// "d.found_inf" -> "found_inf", "d_exact_partial" -> "exact_partial".
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
    const std::string index = arg.substr(open, close - open + 1);
    for (const auto& [suffix, list] : fields)
      if (field == suffix) return std::string(list) + index;
    // Engine.step's state lists: "tensors[3].state[1]" -> "states[1][3]"; a slot named by
    // its unit, "tensors[3].momentum_buffer" -> "momentum_buffers[3]".
    if (field.rfind(".state[", 0) == 0) return "states" + field.substr(6) + index;
    if (field.rfind(".q8[", 0) == 0) return "states" + field.substr(3) + index;
    if (field.size() > 1 && field[0] == '.' && field.find_first_of("[.", 1) == std::string::npos)
      return field.substr(1) + "s" + index;
  }
  if (arg.rfind("config.", 0) == 0) return arg.substr(7);
  if (arg == "read.scale") return "grad_scale";
  if (arg == "read.clip") return "clip";
  // The GPU launchers' device arguments (stepcore.gpu): "d.scale" -> "scale",
  // "d.hyper" -> "step_hyper" (the keyword `hyper` is the optimizer's dict),
  // "d_partial" -> "partial", "workspace_bytes" -> "workspace".
  if (arg == "d.hyper") return "step_hyper";
  if (arg.rfind("d.", 0) == 0 || arg.rfind("d_", 0) == 0) return arg.substr(2);
  if (arg == "workspace_bytes") return "workspace";
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

std::vector<OptimizerTensor> python::optimizer_tensors(const Objects& params,
                                                       const std::vector<Objects>& states,
                                                       const std::optional<Objects>& steps,
                                                       const Objects& grads,
                                                       const std::optional<Objects>& computes) {
  const std::size_t n = params.size();
  if (states.size() > static_cast<std::size_t>(kMaxOptimizerSlots))
    throw nb::value_error(
        ("stepcore: invalid_argument in 'states': " + std::to_string(states.size()) +
         " state lists; an optimizer keeps at most " + std::to_string(kMaxOptimizerSlots))
            .c_str());
  static const char* const kSlotLists[kMaxOptimizerSlots] = {"states[0]", "states[1]", "states[2]"};
  for (std::size_t s = 0; s < states.size(); ++s) same_length(states[s].size(), n, kSlotLists[s]);
  if (steps) same_length(steps->size(), n, "steps");
  same_length(grads.size(), n, "grads");
  if (computes) same_length(computes->size(), n, "computes");
  std::vector<OptimizerTensor> t(n);
  for (std::size_t i = 0; i < n; ++i) {
    t[i].param = cpu_view(params[i], "params", i, Access::write);
    for (std::size_t s = 0; s < states.size(); ++s) {
      const nb::handle h = states[s][i];
      if (!nb::isinstance<nb::tuple>(h)) {
        t[i].state[s] = cpu_view(h, kSlotLists[s], i, Access::write);
        continue;
      }
      // An 8-bit slot (docs/numerics.md 8f): (codes, absmax), uint8 codes one per element
      // and f32 maxima one per block of kQ8BlockSize.
      const ArgName name{kSlotLists[s], static_cast<std::ptrdiff_t>(i)};
      const nb::tuple pair = nb::borrow<nb::tuple>(h);
      if (pair.size() != 2) bad_array(true, name.str(), "an 8-bit slot is a (codes, absmax) pair");
      const BufferArg codes = buffer_arg(pair[0], name, Memory::cpu, Access::write, kU8);
      const BufferArg absmax = buffer_arg(pair[1], name, Memory::cpu, Access::write, kF32);
      const std::size_t blocks = (t[i].param.numel + kQ8BlockSize - 1) / kQ8BlockSize;
      if (codes.numel != t[i].param.numel || absmax.numel != blocks)
        bad_array(false, name.str(),
                  "an 8-bit slot holds " + std::to_string(t[i].param.numel) +
                      " uint8 codes (one per element) and " + std::to_string(blocks) +
                      " float32 block maxima (one per " + std::to_string(kQ8BlockSize) + "); got " +
                      std::to_string(codes.numel) + " and " + std::to_string(absmax.numel));
      static std::uint8_t no_code;
      static float no_max;
      t[i].q8[s] = t[i].param.numel == 0 ? Q8Slot{&no_code, &no_max}
                                         : Q8Slot{static_cast<std::uint8_t*>(codes.data),
                                                  static_cast<float*>(absmax.data)};
    }
    if (steps) {
      const TensorView c = cpu_view((*steps)[i], "steps", i, Access::write);
      if (c.dtype != DType::f32 || c.numel != 1)
        bad_array(c.dtype != DType::f32, indexed("steps", i),
                  "must be one float32 value (torch's 0-dim step tensor)");
      t[i].step = static_cast<float*>(c.data);
    }
    t[i].grad = cpu_view(grads[i], "grads", i, Access::read);
    if (computes && !(*computes)[i].is_none())
      t[i].compute_param = cpu_view((*computes)[i], "computes", i, Access::write);
  }
  return t;
}

void bind_optimizers(nb::module_& m);  // python/src/optimizers.cpp: the table, the reference
void bind_managers(nb::module_& m);    // python/src/managers.cpp
void bind_gpu(nb::module_& m);         // python/src/gpu_launchers.cpp: the submodule _core.gpu
void bind_diff(nb::module_& m);        // python/src/diff_binding.cpp: _core.diff_compare
void bind_plan(nb::module_& m);        // python/src/plan_binding.cpp: _core.plan_model

NB_MODULE(_core, m) {
  m.doc() = "stepcore's C++ core: the CPU engine and the exact norm (thin binding)";
  m.attr("__version__") = STEPCORE_VERSION_STRING;
  // Managers live in torch objects' hooks and LR schedulers, which interpreter shutdown
  // may not collect before nanobind's leak check: its exit-time report would be noise.
  nb::set_leak_warnings(false);
  m.attr("PARTIAL_WORDS") = kPartialWords;
  m.attr("PARTIAL_MAX_ABS_WORD") = kMaxAbsWord;
  m.attr("Q8_BLOCK_SIZE") = kQ8BlockSize;
  m.attr("Q8_NAME_SUFFIX") = std::string(kQ8NameSuffix);
  m.def(
      "q8_map",
      [](bool non_negative) {
        nb::list out;
        for (float v : q8_map(non_negative)) out.append(nb::float_(v));
        return out;
      },
      nb::arg("non_negative"),
      "The 256 values (f32, as Python floats) code c of an 8-bit state slot stands for, times "
      "its block's maximum: the unsigned map for a slot whose table entry is 'non_negative', "
      "else the signed one (docs/numerics.md 8f).");

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
          "step",
          [](const cpu::Engine& e, const std::string& optimizer, const Objects& params_in,
             const std::vector<Objects>& states_in, std::optional<Objects> steps_in,
             const Objects& grads_in, std::optional<Objects> computes_in, nb::handle hyper,
             float grad_scale, float clip, bool found_inf) {
            python::step_call(optimizer, hyper, params_in, states_in, steps_in, grads_in,
                              computes_in, GradientRead{grad_scale, clip}, found_inf,
                              [&](std::span<const OptimizerTensor> t, const OptimizerConfig& config,
                                  GradientRead read, const std::int32_t* skip) {
                                std::visit([&](const auto& c) { e.step(t, c, read, skip); },
                                           config);
                              });
          },
          nb::arg("optimizer"), nb::arg("params"), nb::arg("states"), nb::arg("steps").none(),
          nb::arg("grads"), nb::arg("computes") = nb::none(), nb::kw_only(),
          nb::arg("hyper").none() = nb::none(), nb::arg("grad_scale") = 1.0f,
          nb::arg("clip") = 1.0f, nb::arg("found_inf") = false,
          "One step of the optimizer named `optimizer` (stepcore.optimizers() lists the "
          "names and each one's hyper-parameters with their defaults; `hyper` sets any of "
          "them, an unknown key raises ValueError naming it) in place over every tensor: f32 "
          "params, states[k][i] tensor i's state slot k in the optimizer's slot order "
          "(docs/numerics.md; as many lists as its configuration uses), steps: 0-dim f32 "
          "counters incremented first (None for an optimizer that keeps none), grads "
          "f32/bf16/f16 read as R(R(g*grad_scale)*clip); computes[i] receives params[i] "
          "rounded to its dtype. A states[k][i] given as a (codes, absmax) tuple is an 8-bit "
          "slot (AdamW, Adam: docs/numerics.md 8f): uint8 codes, one per element, and float32 "
          "maxima, one per block of 256; a tensor's slots are all 8-bit or none. "
          "Everything is checked before anything is written; "
          "found_inf=True then writes nothing (counters kept). Bitwise: equals the reference "
          "for any ISA and thread count.")
      .def(
          "accumulate",
          [](const cpu::Engine& e, const Objects& accs_in, const Objects& srcs_in, bool copy) {
            same_length(srcs_in.size(), accs_in.size(), "srcs");
            std::vector<AccumulatePair> pairs(accs_in.size());
            for (std::size_t i = 0; i < accs_in.size(); ++i) {
              pairs[i].acc = cpu_view(accs_in[i], "accs", i, Access::write);
              pairs[i].src = cpu_view(srcs_in[i], "srcs", i, Access::read);
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
            const std::vector<TensorView> v = cpu_views(tensors, "tensors", Access::write);
            nb::gil_scoped_release release;
            e.scale_(v, factor);
          },
          nb::arg("tensors"), nb::arg("factor"), "g = R(f32(g) * factor) in place.")
      .def(
          "norm_partial",
          [](const cpu::Engine& e, const Objects& tensors, float grad_scale, float clip, bool exact,
             int order) {
            const NormOrder o = norm_order(order);
            const std::vector<TensorView> v = cpu_views(tensors, "tensors", Access::read);
            const std::vector<ConstTensorView> cv(v.begin(), v.end());
            NormPartial p;
            {
              nb::gil_scoped_release release;
              p = e.norm_partial(cv, GradientRead{grad_scale, clip},
                                 exact ? NormMode::exact : NormMode::fast, o);
            }
            return partial_array(p);
          },
          nb::arg("tensors"), nb::arg("grad_scale") = 1.0f, nb::arg("clip") = 1.0f,
          nb::arg("exact") = false, nb::arg("order") = 2,
          "The norm partial of the values read as R(R(g*grad_scale)*clip), as PARTIAL_WORDS "
          "int64 words: SUM-all-reduce every word except PARTIAL_MAX_ABS_WORD (MAX) to combine "
          "ranks exactly. exact=True: the exact partial (finalize never asks for more). "
          "order: 2 (sum of squares) or 1 (sum of |x|); finalize with the same order.")
      .def(
          "p_norm",
          [](const cpu::Engine& e, const Objects& tensors, double p, float grad_scale, float clip) {
            const std::vector<TensorView> v = cpu_views(tensors, "tensors", Access::read);
            const std::vector<ConstTensorView> cv(v.begin(), v.end());
            NormResult r;
            {
              nb::gil_scoped_release release;
              r = e.p_norm(cv, p, GradientRead{grad_scale, clip});
            }
            return nb::make_tuple(r.norm, r.finite);
          },
          nb::arg("tensors"), nb::arg("p"), nb::arg("grad_scale") = 1.0f, nb::arg("clip") = 1.0f,
          "Returns (norm, finite): the p-norm of the read values for any order p but NaN "
          "(docs/numerics.md 6.6; 2 and 1 exact, +-inf and 0 exact, other p faithfully "
          "rounded); finite is False when any value read was NaN or Inf.");

  m.def(
      "finalize",
      [](const nb::ndarray<nb::ro, std::int64_t, nb::shape<-1>, nb::device::cpu>& partial,
         int order) {
        const NormOrder o = norm_order(order);
        const NormResult r = finalize(partial_of(partial), o);
        return nb::make_tuple(r.norm, r.finite, r.max_abs, r.needs_exact);
      },
      nb::arg("partial"), nb::arg("order") = 2,
      "Returns (norm, finite, max_abs, needs_exact) of a (combined) partial of the given "
      "order: the correctly rounded f32 L2 (order=2) or L1 (order=1) norm; needs_exact: "
      "recompute with exact partials (norm unset).");

  m.def(
      "clip_coefficient",
      [](float norm, float max_norm) { return clip_coefficient(norm, max_norm); }, nb::arg("norm"),
      nb::arg("max_norm"),
      "min(1, max_norm / (norm + 1e-6)) in f32 as torch.nn.utils.clip_grad_norm_ computes it.");
  nb::class_<OptimizerRows>(
      m, "_OptimizerRows",
      "Private (stepcore.torch only): one param group's cached optimizer rows.")
      .def(nb::init<Objects, std::vector<std::size_t>, Objects, std::vector<std::string>,
                    std::optional<std::string>, std::optional<Objects>, std::optional<Objects>,
                    Objects>(),
           nb::arg("params"), nb::arg("rows"), nb::arg("states"), nb::arg("slot_keys"),
           nb::arg("step_key").none(), nb::arg("counters").none(), nb::arg("computes").none(),
           nb::arg("grad_types"))
      .def("prepare", &OptimizerRows::prepare, nb::arg("group_params"),
           nb::arg("grads").none() = nb::none(),
           "Re-reads the rows with each param's current grad (or `grads`): False when stale.")
      .def(
          "run",
          [](OptimizerRows& rows, const cpu::Engine& e, const std::string& optimizer,
             nb::handle hyper, float grad_scale, float clip) {
            rows.run(e, python::optimizer_config(optimizer, hyper), GradientRead{grad_scale, clip});
          },
          nb::arg("engine"), nb::arg("optimizer"), nb::arg("hyper").none(), nb::kw_only(),
          nb::arg("grad_scale") = 1.0f, nb::arg("clip") = 1.0f,
          "One step of `optimizer` (Engine.step's names and hyper-parameters) over the rows "
          "prepare() just read (the engine checks everything before writing).");
  m.def(
      "_same_items",
      [](nb::handle d, nb::handle keys, nb::handle values) {
        if (!PyDict_Check(d.ptr()) || !PyList_Check(keys.ptr()) || !PyList_Check(values.ptr()))
          throw nb::type_error("stepcore: invalid_argument in 'd': a dict and two lists expected");
        const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
        if (PyList_GET_SIZE(values.ptr()) != n) return false;
        return dict_holds(
            d.ptr(), static_cast<std::size_t>(n),
            [&](std::size_t i) { return PyList_GET_ITEM(keys.ptr(), static_cast<Py_ssize_t>(i)); },
            [&](std::size_t i) {
              return PyList_GET_ITEM(values.ptr(), static_cast<Py_ssize_t>(i));
            });
      },
      nb::arg("d"), nb::arg("keys"), nb::arg("values"),
      "Private (stepcore.torch): whether dict `d` holds exactly keys[k]: values[k], in that "
      "order, by identity (`is`), as list(d.keys()) and list(d.values()) were taken.");
  m.def("_exchange_imports", &python::exchange_imports,
        "Private (tests): array imports through the DLPack C exchange API so far.");
  m.def(
      "_stream_address", [](nb::handle stream) { return python::stream_address(stream); },
      nb::arg("stream").none(),
      "Private (tests): the cudaStream_t address a stream argument names (None: 0).");
  m.def(
      "_launch_stream",
      [](nb::handle stream, nb::handle producer) {
        return reinterpret_cast<std::uintptr_t>(python::stream_arg(stream, producer));
      },
      nb::arg("stream").none(), nb::arg("producer").none(),
      "Private (tests): the cudaStream_t address a launcher uses for `stream` when its first "
      "array is `producer` (stream None: the producer's framework's current stream).");
  bind_optimizers(m);
  bind_managers(m);
  bind_gpu(m);
  bind_diff(m);
  bind_plan(m);
}
