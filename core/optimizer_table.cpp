// The optimizer table of stepcore/optim.hpp (optimizer_table): one entry per unit of
// core/optimizers/all.hpp, in AllUnits' order, computed at compile time from the unit
// (slots, step counter, gradient read) and its OptimizerTraits (name, fields, roles),
// with each field's default read from a default-constructed Config.
#include <array>
#include <cstddef>
#include <iterator>
#include <span>
#include <string_view>
#include <type_traits>
#include <variant>

#include "core/optimizers/all.hpp"
#include "stepcore/optim.hpp"

namespace stepcore {
namespace {

// The kind of a member of type T (double, bool, int or AdamWFormula: HyperField's types).
template <class T>
constexpr HyperKind kind_of() {
  if constexpr (std::is_same_v<T, double>)
    return HyperKind::real;
  else if constexpr (std::is_same_v<T, bool>)
    return HyperKind::flag;
  else if constexpr (std::is_same_v<T, int>)
    return HyperKind::integer;
  else
    return HyperKind::formula;
}

// Unit's table rows: its hyper-parameters and slots, as static arrays the entry views.
template <class Unit>
struct UnitRows {
  using C = typename Unit::Config;
  static constexpr std::size_t kFieldCount = std::size(OptimizerTraits<C>::kFields);

  static constexpr std::array<HyperInfo, kFieldCount> kHyper = [] {
    std::array<HyperInfo, kFieldCount> out{};
    constexpr C defaults{};
    for (std::size_t i = 0; i < kFieldCount; ++i) {
      const HyperField<C>& f = OptimizerTraits<C>::kFields[i];
      out[i].name = f.name;
      out[i].role = f.role;
      out[i].formulas = f.formulas;
      std::visit(
          [&](auto member) {
            using T = std::remove_cvref_t<decltype(defaults.*member)>;
            out[i].kind = kind_of<T>();
            out[i].default_value = static_cast<double>(defaults.*member);
          },
          f.member);
    }
    return out;
  }();

  // A formula field names the formulas it takes; no other field names any.
  static constexpr bool formulas_declared() {
    for (const HyperInfo& h : kHyper)
      if ((h.kind == HyperKind::formula) != (h.formulas != 0)) return false;
    return true;
  }
  static_assert(formulas_declared(), "a formula field's HyperField names its formulas");

  // The field a slot starts from (the unit's kSlotInitialFields), or nullptr.
  static constexpr const char* initial(int k) {
    if constexpr (requires { Unit::kSlotInitialFields; })
      return Unit::kSlotInitialFields[k];
    else
      return nullptr;
  }

  // Every initial field names a real hyper-parameter of the unit.
  static constexpr bool initial_fields_are_real() {
    for (int k = 0; k < Unit::kSlots; ++k) {
      const char* field = initial(k);
      if (field == nullptr) continue;
      bool found = false;
      for (const HyperInfo& h : kHyper)
        found = found || (std::string_view(h.name) == field && h.kind == HyperKind::real);
      if (!found) return false;
    }
    return true;
  }
  static_assert(initial_fields_are_real(),
                "kSlotInitialFields names a real hyper-parameter of OptimizerTraits");

  static constexpr std::array<SlotInfo, Unit::kSlots> kSlots = [] {
    std::array<SlotInfo, Unit::kSlots> out{};
    for (int k = 0; k < Unit::kSlots; ++k)
      out[static_cast<std::size_t>(k)] =
          SlotInfo{Unit::kSlotNames[k], initial(k), detail::unit_slot_non_negative<Unit>(k)};
    return out;
  }();
};

template <class... Units>
constexpr std::array<OptimizerInfo, sizeof...(Units)> make_table(detail::UnitList<Units...>) {
  return {OptimizerInfo{Units::kName, UnitRows<Units>::kHyper, UnitRows<Units>::kSlots,
                        Units::kCountsSteps, Units::kReadsScaled,
                        detail::unit_takes_q8<Units>()}...};
}

constexpr auto kTable = make_table(detail::AllUnits{});
static_assert(kTable.size() == std::variant_size_v<OptimizerConfig>,
              "one table entry per OptimizerConfig alternative");

}  // namespace

std::span<const OptimizerInfo> optimizer_table() noexcept { return kTable; }

}  // namespace stepcore
