// The optimizer arguments of stepcore._core's entry points (the CPU engine, the reference,
// the GPU launchers): one parser of `formula`, the one parser of an optimizer chosen by
// name with a dict of hyper-parameters (-> OptimizerConfig), which the library then
// validates (its errors name the fields: 'lr', 'beta1', ...), and the one reader of
// Engine.step's tensor lists.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "stepcore/optim.hpp"

namespace stepcore::python {

namespace nb = nanobind;

/// Returns the name of a formula: "native", "torch" or "torchao" (kAdamWFormulaNames).
inline const char* formula_name(AdamWFormula f) {
  return kAdamWFormulaNames[static_cast<std::size_t>(f)].data();
}

/// Returns the formula of that name (kAdamWFormulaNames); else ValueError naming 'formula'.
inline AdamWFormula parse_formula(const std::string& name) {
  for (std::size_t k = 0; k < std::size(kAdamWFormulaNames); ++k)
    if (kAdamWFormulaNames[k] == name) return static_cast<AdamWFormula>(k);
  throw nb::value_error(("stepcore: invalid_argument in 'formula': '" + name +
                         "': expected 'torch', 'native' or 'torchao'")
                            .c_str());
}

// ---- an optimizer by name, its hyper-parameters from a dict --------------------------
// Every optimizer's name and keys are OptimizerTraits' (stepcore/optim.hpp), declared once
// beside its Config; nothing here names one.

/// Calls fn(std::integral_constant<std::size_t, I>{}) for each alternative I of
/// OptimizerConfig, in order.
template <class Fn, std::size_t... I>
void for_each_optimizer(Fn&& fn, std::index_sequence<I...>) {
  (fn(std::integral_constant<std::size_t, I>{}), ...);
}
template <class Fn>
void for_each_optimizer(Fn&& fn) {
  for_each_optimizer(static_cast<Fn&&>(fn),
                     std::make_index_sequence<std::variant_size_v<OptimizerConfig>>{});
}

/// Returns "adamw, sign_sgd, ...": every optimizer's name, in the optimizer table's order.
inline std::string optimizer_names() {
  std::string out;
  for (const OptimizerInfo& info : optimizer_table())
    out += (out.empty() ? "" : ", ") + std::string(info.name);
  return out;
}

/// Sets one field of `c` from the Python value `v`, or throws TypeError naming `key`.
template <class C>
void set_field(C& c, const HyperField<C>& f, nb::handle v) {
  PyObject* o = v.ptr();
  const auto bad = [&](const char* want) {
    throw nb::type_error(("stepcore: invalid_argument in '" + std::string(f.name) + "': expected " +
                          want + ", got " + std::string(Py_TYPE(o)->tp_name))
                             .c_str());
  };
  std::visit(
      [&](auto member) {
        using T = std::remove_cvref_t<decltype(c.*member)>;
        if constexpr (std::is_same_v<T, double>) {
          if (PyBool_Check(o) || !(PyFloat_Check(o) || PyLong_Check(o))) bad("a float");
          const double x = PyFloat_AsDouble(o);
          if (x == -1.0 && PyErr_Occurred()) throw nb::python_error();  // an int too large
          c.*member = x;
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!PyBool_Check(o)) bad("a bool");
          c.*member = o == Py_True;
        } else if constexpr (std::is_same_v<T, int>) {
          if (PyBool_Check(o) || !PyLong_Check(o)) bad("an int");
          int overflow = 0;
          const long x = PyLong_AsLongAndOverflow(o, &overflow);
          if (overflow != 0 || x < -2147483647L - 1 || x > 2147483647L)
            throw nb::value_error(
                ("stepcore: out_of_range in '" + std::string(f.name) + "': not a 32-bit int")
                    .c_str());
          c.*member = static_cast<int>(x);
        } else {
          if (!PyUnicode_Check(o)) bad("a str");
          c.*member = parse_formula(nb::cast<std::string>(v));
        }
      },
      f.member);
}

/// Returns C's defaults with the dict's entries set (None: the defaults), or throws
/// ValueError naming an unknown key (and the keys `optimizer` has), TypeError naming a
/// key whose value has the wrong type. Values are not validated (the step does that).
template <class C>
C config_from_dict(nb::handle hyper) {
  C c;
  if (hyper.is_none()) return c;
  if (!PyDict_Check(hyper.ptr()))
    throw nb::type_error("stepcore: invalid_argument in 'hyper': expected a dict");
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(hyper.ptr(), &pos, &key, &value)) {
    Py_ssize_t len = 0;
    const char* k = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &len) : nullptr;
    if (k == nullptr) {
      PyErr_Clear();
      throw nb::type_error("stepcore: invalid_argument in 'hyper': keys must be str");
    }
    const std::string_view name(k, static_cast<std::size_t>(len));
    const HyperField<C>* field = nullptr;
    for (const HyperField<C>& f : OptimizerTraits<C>::kFields)
      if (name == f.name) field = &f;
    if (field == nullptr) {
      std::string keys;
      for (const HyperField<C>& f : OptimizerTraits<C>::kFields)
        keys += (keys.empty() ? "" : ", ") + std::string(f.name);
      throw nb::value_error(("stepcore: invalid_argument in '" + std::string(name) +
                             "': not a hyper-parameter of optimizer '" + OptimizerTraits<C>::kName +
                             "' (its keys: " + keys + ")")
                                .c_str());
    }
    set_field(c, *field, value);
  }
  return c;
}

/// The one parser of an optimizer chosen by name: returns the OptimizerConfig alternative
/// whose name is `name`, with `hyper`'s entries set (config_from_dict), or throws
/// ValueError naming 'optimizer' with the names stepcore has.
inline OptimizerConfig optimizer_config(std::string_view name, nb::handle hyper) {
  OptimizerConfig out;
  bool found = false;
  for_each_optimizer([&](auto i) {
    using C = std::variant_alternative_t<decltype(i)::value, OptimizerConfig>;
    if (!found && name == OptimizerTraits<C>::kName) {
      out.template emplace<decltype(i)::value>(config_from_dict<C>(hyper));
      found = true;
    }
  });
  if (!found)
    throw nb::value_error(("stepcore: invalid_argument in 'optimizer': unknown optimizer '" +
                           std::string(name) + "': expected one of " + optimizer_names())
                              .c_str());
  return out;
}

/// The Python lists of Engine.step (and reference_step) as OptimizerTensor records, each
/// array checked and named as the call names it ("params[3]", "states[1][0]", "steps[2]",
/// "grads[0]", "computes[1]"), list lengths checked first (python/src/module.cpp).
using Objects = std::vector<nb::object>;
std::vector<OptimizerTensor> optimizer_tensors(const Objects& params,
                                               const std::vector<Objects>& states,
                                               const std::optional<Objects>& steps,
                                               const Objects& grads,
                                               const std::optional<Objects>& computes);

/// Engine.step's call (and reference_step's): the optimizer by name with its `hyper` dict
/// and the tensor lists, each checked (optimizer_config, optimizer_tensors), then
/// step(tensors, config, read, &found_inf) with the GIL released; found_inf writes nothing.
template <class Step>
void step_call(const std::string& optimizer, nb::handle hyper, const Objects& params,
               const std::vector<Objects>& states, const std::optional<Objects>& steps,
               const Objects& grads, const std::optional<Objects>& computes, GradientRead read,
               bool found_inf, Step&& step) {
  const OptimizerConfig config = optimizer_config(optimizer, hyper);
  const std::vector<OptimizerTensor> t = optimizer_tensors(params, states, steps, grads, computes);
  const std::int32_t skip = found_inf ? 1 : 0;
  nb::gil_scoped_release release;
  step(std::span<const OptimizerTensor>(t), config, read, &skip);
}

}  // namespace stepcore::python
