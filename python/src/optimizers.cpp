// stepcore._core's optimizer table and reference: optimizer_table() (stepcore/optim.hpp's
// table, every optimizer's name, hyper-parameters with their roles, kinds and defaults,
// slots, step counter and gradient read), optimizers() ({name: {hyper-parameter:
// default}}, from the same table), optimizer_slots() (the slots one configuration uses)
// and reference_step() (stepcore::reference's optimizer step, the oracle, with
// Engine.step's arguments). Python keeps no list of its own: it reads these.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "optim_args.hpp"  // optimizers by name, Engine.step's tensor lists
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"

namespace nb = nanobind;
using namespace stepcore;

namespace {

// The names of HyperRole's and HyperKind's values, indexed by the value.
constexpr const char* kRoleNames[] = {"schedule", "betas", "fixed", "machine"};
constexpr const char* kKindNames[] = {"real", "flag", "integer", "formula"};
static_assert(static_cast<int>(HyperRole::machine) == 3 &&
                  static_cast<int>(HyperKind::formula) == 3,
              "one name per value");

// A hyper-parameter's default as Python holds it: float, bool, int, or the formula's name
// (what Engine.step's `hyper` takes).
nb::object default_of(const HyperInfo& h) {
  switch (h.kind) {
    case HyperKind::flag:
      return nb::bool_(h.default_value != 0.0);
    case HyperKind::integer:
      return nb::int_(static_cast<long>(h.default_value));
    case HyperKind::formula:
      return nb::str(python::formula_name(static_cast<AdamWFormula>(h.default_value)));
    case HyperKind::real:
      break;
  }
  return nb::float_(h.default_value);
}

nb::dict entry_dict(const OptimizerInfo& info) {
  nb::list hyper;
  for (const HyperInfo& h : info.hyper) {
    nb::dict d;
    d["name"] = h.name;
    d["role"] = kRoleNames[static_cast<int>(h.role)];
    d["kind"] = kKindNames[static_cast<int>(h.kind)];
    d["default"] = default_of(h);
    if (h.kind == HyperKind::formula) {  // the names it takes (of kAdamWFormulaNames)
      nb::list names;
      for (std::size_t k = 0; k < std::size(kAdamWFormulaNames); ++k)
        if ((h.formulas & formula_bit(static_cast<AdamWFormula>(k))) != 0)
          names.append(nb::str(kAdamWFormulaNames[k].data(), kAdamWFormulaNames[k].size()));
      d["choices"] = nb::tuple(names);
    }
    hyper.append(d);
  }
  nb::list slots;
  for (const SlotInfo& s : info.slots) {
    nb::dict d;
    d["name"] = s.name;
    d["initial"] = s.initial != nullptr ? nb::object(nb::str(s.initial)) : nb::none();
    d["non_negative"] = s.non_negative;
    slots.append(d);
  }
  nb::dict out;
  out["name"] = info.name;
  out["hyper"] = hyper;
  out["slots"] = slots;
  out["counts_steps"] = info.counts_steps;
  out["reads_scaled"] = info.reads_scaled;
  out["q8"] = info.q8;
  return out;
}

}  // namespace

void bind_optimizers(nb::module_& m) {
  m.def(
      "optimizer_table",
      [] {
        nb::list out;
        for (const OptimizerInfo& info : optimizer_table()) out.append(entry_dict(info));
        return out;
      },
      "Every optimizer stepcore implements, in the library's order (stepcore/optim.hpp's "
      "optimizer_table): a dict per optimizer with 'name'; 'hyper', its hyper-parameters "
      "[{'name', 'role' ('schedule': each param group's lr and weight_decay; 'betas': each "
      "group's beta1, beta2, eps; 'fixed': the rest of its function; 'machine': which torch "
      "build to match), 'kind' ('real', 'flag', 'integer', 'formula'), 'default', and for "
      "a formula 'choices', the names it takes}]; 'slots', "
      "every state slot it may keep, in its order [{'name', 'initial': the hyper-parameter "
      "whose value the slot starts from, or None for +0, 'non_negative': loaded values below "
      "zero are refused}]; 'counts_steps' (a per-tensor "
      "step counter); 'reads_scaled' (its gradient read applies grad_scale and clip); 'q8' "
      "(Engine.step takes its state slots as 8-bit (codes, absmax) pairs).");
  m.def(
      "optimizer_choice",
      [](const std::string& name) {
        const OptimizerChoice choice = parse_optimizer_choice(name);
        const std::vector<OptimizerField> defaults =
            optimizer_fields(parse_optimizer(optimizer_name(choice.optimizer)));
        nb::dict set;  // the fields the name sets apart from the optimizer's defaults
        const std::vector<OptimizerField> fields = optimizer_fields(choice.optimizer);
        for (std::size_t k = 0; k < fields.size(); ++k) {
          if (fields[k].value == defaults[k].value) continue;
          if (const auto* text = std::get_if<std::string>(&fields[k].value))
            set[fields[k].name.c_str()] = *text;
          else
            set[fields[k].name.c_str()] = std::get<double>(fields[k].value);
        }
        return nb::make_tuple(std::string(optimizer_name(choice.optimizer)), choice.q8_state, set);
      },
      nb::arg("name"),
      "The optimizer named `name` (stepcore::parse_optimizer_choice): a table name, or the "
      "8-bit name of an optimizer with 8-bit state (the name and Q8_NAME_SUFFIX, 'adamw8bit'). "
      "Returns (table name, 8-bit state, {field: value} the name sets beside the defaults: "
      "an 8-bit name's formula 'torchao' where the optimizer has it); another name raises "
      "ValueError naming 'optimizer'.");
  m.def(
      "optimizers",
      [] {
        nb::dict out;
        for (const OptimizerInfo& info : optimizer_table()) {
          nb::dict d;
          for (const HyperInfo& h : info.hyper) d[h.name] = default_of(h);
          out[info.name] = d;
        }
        return out;
      },
      "Every optimizer Engine.step takes: {name: {hyper-parameter: default}} (the "
      "optimizer table's names and defaults).");
  m.def(
      "optimizer_slots",
      [](const std::string& optimizer, nb::handle hyper) {
        std::vector<std::string> out;
        for (std::string_view s : optimizer_slot_names(python::optimizer_config(optimizer, hyper)))
          out.emplace_back(s);
        return out;
      },
      nb::arg("optimizer"), nb::arg("hyper").none() = nb::none(),
      "The state slots the optimizer named `optimizer` keeps with the hyper-parameters "
      "`hyper` (Engine.step's names and keys; unset keys take the defaults), in its slot "
      "order: the lists Engine.step's `states` takes (e.g. adamw with amsgrad: exp_avg, "
      "exp_avg_sq, max_exp_avg_sq; sgd with momentum 0: none).");
  m.def(
      "reference_step",
      [](const std::string& optimizer, const python::Objects& params,
         const std::vector<python::Objects>& states, std::optional<python::Objects> steps,
         const python::Objects& grads, std::optional<python::Objects> computes, nb::handle hyper,
         float grad_scale, float clip, bool found_inf) {
        python::step_call(
            optimizer, hyper, params, states, steps, grads, computes,
            GradientRead{grad_scale, clip}, found_inf,
            [](std::span<const OptimizerTensor> t, const OptimizerConfig& config, GradientRead read,
               const std::int32_t* skip) { reference::optimizer_step(t, config, read, skip); });
      },
      nb::arg("optimizer"), nb::arg("params"), nb::arg("states"), nb::arg("steps").none(),
      nb::arg("grads"), nb::arg("computes") = nb::none(), nb::kw_only(),
      nb::arg("hyper").none() = nb::none(), nb::arg("grad_scale") = 1.0f, nb::arg("clip") = 1.0f,
      nb::arg("found_inf") = false,
      "Engine.step through stepcore's scalar reference (stepcore::reference::optimizer_step, "
      "the literal definition of docs/numerics.md that every fast path equals bit for bit): "
      "the same arguments and checks, one element at a time. An oracle for tests, not a "
      "fast path.");
}
