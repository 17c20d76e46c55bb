// The managers' view of the optimizer (managers/optimizer.hpp) and the public optimizer
// functions of stepcore/managers.hpp: names, the field table, slots, groups.
#include "managers/optimizer.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "stepcore/error.hpp"

namespace stepcore {
namespace detail {
namespace {

// The field table of configuration C: OptimizerTraits<C>::kFields (stepcore/optim.hpp),
// declared once beside each Config. fn(name, role, member) for each field in its order;
// the members are double, bool, int or AdamWFormula.
template <class C, class Fn>
void fields_of(C& c, Fn&& f) {
  for (const HyperField<C>& field : OptimizerTraits<C>::kFields)
    std::visit([&](auto member) { f(field.name, field.role, c.*member); }, field.member);
}

// AdamW's formulas by name, indexed by their value.
constexpr const auto& kFormulaNames = kAdamWFormulaNames;
static_assert(static_cast<int>(AdamWFormula::native) == 0 &&
              static_cast<int>(AdamWFormula::torch) == 1 &&
              static_cast<int>(AdamWFormula::torchao) == 2);

template <class T>
double to_double(const T& v) {
  if constexpr (std::is_same_v<T, AdamWFormula>)
    return static_cast<double>(static_cast<int>(v));
  else
    return static_cast<double>(v);
}

// Sets `member` from `value`, or throws naming `argument`.
template <class T>
void from_double(T& member, double value, const std::string& argument) {
  auto bad = [&](const std::string& why) {
    throw Error(Errc::invalid_argument, argument, std::to_string(value) + ": " + why);
  };
  if constexpr (std::is_same_v<T, double>) {
    member = value;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (value != 0.0 && value != 1.0) bad("a flag is 0 (false) or 1 (true)");
    member = value == 1.0;
  } else if constexpr (std::is_same_v<T, int>) {
    if (!(std::floor(value) == value && std::fabs(value) < 2147483648.0)) bad("not an integer");
    member = static_cast<int>(value);
  } else {
    const auto count = static_cast<double>(std::size(kFormulaNames));
    if (!(std::floor(value) == value && value >= 0.0 && value < count)) {
      std::string names;
      for (std::size_t k = 0; k < std::size(kFormulaNames); ++k)
        names +=
            (k == 0 ? "" : ", ") + std::to_string(k) + " (" + std::string(kFormulaNames[k]) + ")";
      bad("a formula is one of " + names);
    }
    member = static_cast<AdamWFormula>(static_cast<int>(value));
  }
}

// Calls fn(name, role, member) for every field of the alternative `config` holds.
template <class Fn>
void for_each_field(OptimizerConfig& config, Fn&& fn) {
  std::visit([&](auto& c) { fields_of(c, fn); }, config);
}

// The optimizer table's row of `config`'s hyper-parameter `name` if it is a formula
// (its names: kFormulaNames), else nullptr.
const HyperInfo* formula_field(const OptimizerConfig& config, std::string_view name) {
  for (const HyperInfo& h : optimizer_table()[config.index()].hyper)
    if (h.kind == HyperKind::formula && name == h.name) return &h;
  return nullptr;
}

std::string accepted_names() {
  std::string names;
  for (const OptimizerInfo& info : optimizer_table())
    names += (names.empty() ? "" : ", ") + std::string(info.name);
  return names;
}

}  // namespace

OptimizerShape optimizer_shape(const OptimizerConfig& config) {
  return with_unit(config, [](auto unit, const auto& c) {
    using Unit = decltype(unit);
    OptimizerShape s;
    s.name = Unit::kName;
    const int used = Unit::slots(Unit::variant(c));
    for (int k = 0; k < used; ++k) s.slot_names.push_back(Unit::kSlotNames[k]);
    s.counts_steps = Unit::kCountsSteps;
    s.reads_scaled = Unit::kReadsScaled;
    return s;
  });
}

bool has_betas(const OptimizerConfig& config) noexcept {
  return std::visit([](const auto& c) { return kHasBetas<std::decay_t<decltype(c)>>; }, config);
}

OptimizerConfig group_config(const OptimizerConfig& config, const ParamGroup& group) {
  return std::visit(
      [&](auto c) -> OptimizerConfig {
        c.lr = group.lr;
        c.weight_decay = group.weight_decay;
        if constexpr (kHasBetas<decltype(c)>) {
          c.beta1 = group.beta1;
          c.beta2 = group.beta2;
          c.eps = group.eps;
        }
        return c;
      },
      config);
}

ParamGroup default_group(const OptimizerConfig& config) {
  ParamGroup g;
  g.name = "default";
  std::visit(
      [&](const auto& c) {
        g.lr = c.lr;
        g.weight_decay = c.weight_decay;
        if constexpr (kHasBetas<std::decay_t<decltype(c)>>) {
          g.beta1 = c.beta1;
          g.beta2 = c.beta2;
          g.eps = c.eps;
        }
      },
      config);
  return g;
}

float initial_slot_value(const OptimizerConfig& config, std::string_view slot) {
  float v = 0.0f;
  with_unit(config, [&](auto unit, const auto& c) {
    using Unit = decltype(unit);
    for (int k = 0; k < Unit::kSlots; ++k)
      if (slot == Unit::kSlotNames[k]) v = unit_initial_slot<Unit>(c, k);
  });
  return v;
}

bool slot_non_negative(std::string_view optimizer, std::string_view slot) noexcept {
  // The optimizer table's slot entry says it (stepcore/optim.hpp: SlotInfo).
  for (const OptimizerInfo& info : optimizer_table())
    if (optimizer == info.name)
      for (const SlotInfo& s : info.slots)
        if (slot == s.name) return s.non_negative;
  return false;
}

std::uint8_t q8_zero_code(bool non_negative) noexcept {
  const std::span<const float, 256> map = q8_map(non_negative);
  std::uint8_t c = 0;
  while (c < 255 && std::bit_cast<std::uint32_t>(map[c]) != 0u) ++c;  // +0: one code
  return c;
}

std::vector<FieldValue> config_fields(const OptimizerConfig& config) {
  OptimizerConfig c = config;  // the table takes members by reference
  std::vector<FieldValue> out;
  for_each_field(c, [&](const char* name, HyperRole role, const auto& member) {
    out.push_back({name, role, to_double(member)});
  });
  return out;
}

void set_config_field(OptimizerConfig& config, std::string_view name, double value,
                      const std::string& argument) {
  bool found = false;
  std::string names;
  for_each_field(config, [&](const char* field, HyperRole, auto& member) {
    names += (names.empty() ? "" : ", ") + std::string(field);
    if (name != field) return;
    from_double(member, value, argument);
    found = true;
  });
  if (!found)
    throw Error(Errc::invalid_argument, argument,
                "'" + std::string(name) + "' is not a hyper-parameter of " +
                    std::string(optimizer_name(config)) + " (its fields: " + names + ")");
}

void with_group_names(const std::string& group_prefix, const std::string& optimizer_prefix,
                      bool betas, const std::function<void()>& check) {
  try {
    check();
  } catch (const Error& e) {
    const std::string& arg = e.argument();
    if (arg.rfind("config.", 0) != 0) throw;
    const std::string field = arg.substr(7);
    const bool group_field = field == "lr" || field == "weight_decay" ||
                             (betas && (field == "beta1" || field == "beta2" || field == "eps"));
    // The message after "stepcore: <code> in '<arg>': ".
    const std::string what = e.what();
    const std::string::size_type at = what.find("': ");
    throw Error(e.code(), (group_field ? group_prefix : optimizer_prefix) + field,
                at == std::string::npos ? what : what.substr(at + 3));
  }
}

void validate_config(const OptimizerConfig& config) {
  with_unit(config, [](auto unit, const auto& c) { decltype(unit)::validate(c, GradientRead{}); });
}

}  // namespace detail

OptimizerConfig parse_optimizer(std::string_view name) {
  OptimizerConfig out;
  bool found = false;
  // The alternative of each unit, in AllUnits' (and OptimizerConfig's) order.
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((!found && name == optimizer_name(OptimizerConfig(std::in_place_index<I>))
          ? (out = OptimizerConfig(std::in_place_index<I>), found = true)
          : false),
     ...);
  }
  (std::make_index_sequence<std::variant_size_v<OptimizerConfig>>{});
  if (!found)
    throw Error(Errc::invalid_argument, "optimizer",
                "unknown optimizer '" + std::string(name) + "': expected exactly one of " +
                    detail::accepted_names() + " (the optimizers stepcore implements)");
  return out;
}

OptimizerChoice parse_optimizer_choice(std::string_view name) {
  std::string names;  // every accepted name, for the error
  for (const OptimizerInfo& info : optimizer_table()) {
    const std::string base = info.name;
    names += (names.empty() ? "" : ", ") + base;
    if (name == base) return {parse_optimizer(base), false};
    if (!info.q8) continue;
    const std::string q8_name = base + std::string(kQ8NameSuffix);
    names += ", " + q8_name;
    if (name != q8_name) continue;
    OptimizerChoice choice{parse_optimizer(base), true};
    for (const HyperInfo& h : info.hyper)
      if (h.kind == HyperKind::formula && (h.formulas & formula_bit(AdamWFormula::torchao)) != 0)
        detail::set_config_field(choice.optimizer, h.name,
                                 static_cast<double>(static_cast<int>(AdamWFormula::torchao)),
                                 "optimizer");
    return choice;
  }
  throw Error(Errc::invalid_argument, "optimizer",
              "unknown optimizer '" + std::string(name) + "': expected exactly one of " + names +
                  " (the optimizers stepcore implements; \"" + std::string(kQ8NameSuffix) +
                  "\": with block-wise 8-bit state)");
}

std::string_view optimizer_name(const OptimizerConfig& config) noexcept {
  return detail::with_unit(
      config, [](auto unit, const auto&) -> std::string_view { return decltype(unit)::kName; });
}

OptimizerConfig make_optimizer_config(std::string_view name,
                                      std::span<const OptimizerField> fields) {
  OptimizerConfig config = parse_optimizer(name);
  for (const OptimizerField& f : fields) {
    const std::string argument = std::string(name) + "." + f.name;
    double value;
    if (const auto* text = std::get_if<std::string>(&f.value)) {
      const HyperInfo* h = detail::formula_field(config, f.name);
      if (h == nullptr)
        throw Error(Errc::invalid_argument, argument,
                    "'" + *text + "': a number, not a string (only a formula is a name)");
      std::size_t k = 0;
      while (k < std::size(detail::kFormulaNames) &&
             !(detail::kFormulaNames[k] == *text &&
               (h->formulas & formula_bit(static_cast<AdamWFormula>(k))) != 0))
        ++k;
      if (k == std::size(detail::kFormulaNames))
        throw Error(Errc::invalid_argument, argument,
                    "'" + *text + "': " + std::string(name) + "'s formula is " +
                        detail::formula_names(h->formulas));
      value = static_cast<double>(k);
    } else {
      value = std::get<double>(f.value);
    }
    detail::set_config_field(config, f.name, value, argument);
  }
  return config;
}

std::vector<OptimizerField> optimizer_fields(const OptimizerConfig& config) {
  std::vector<OptimizerField> out;
  for (const detail::FieldValue& f : detail::config_fields(config)) {
    if (detail::formula_field(config, f.name) != nullptr && f.value >= 0.0 &&
        f.value < static_cast<double>(std::size(detail::kFormulaNames)))
      out.push_back({std::string(f.name),
                     std::string(detail::kFormulaNames[static_cast<std::size_t>(f.value)])});
    else
      out.push_back({std::string(f.name), f.value});
  }
  return out;
}

std::vector<std::string_view> optimizer_slot_names(const OptimizerConfig& config) {
  return detail::optimizer_shape(config).slot_names;
}

bool optimizer_counts_steps(const OptimizerConfig& config) noexcept {
  return detail::with_unit(config,
                           [](auto unit, const auto&) { return decltype(unit)::kCountsSteps; });
}

}  // namespace stepcore
