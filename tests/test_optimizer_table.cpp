// The public optimizer table (stepcore/optim.hpp: optimizer_table) against the units
// themselves (core/optimizers/all.hpp) and their OptimizerTraits: one entry per unit in
// AllUnits' order (OptimizerConfig's), each field's name, role, kind and default as the
// Config declares it, every slot by the unit's name in its order, the step counter and the
// gradient read as the unit declares them; a slot's initial field is a real field whose
// value the managers start the slot from.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "core/optimizers/all.hpp"
#include "managers/optimizer.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"

namespace {

using stepcore::HyperInfo;
using stepcore::HyperKind;
using stepcore::OptimizerConfig;
using stepcore::OptimizerInfo;
using stepcore::OptimizerTraits;

// The kind the table must give a member of type T.
template <class T>
HyperKind expected_kind() {
  if constexpr (std::is_same_v<T, double>) return HyperKind::real;
  if constexpr (std::is_same_v<T, bool>) return HyperKind::flag;
  if constexpr (std::is_same_v<T, int>) return HyperKind::integer;
  if constexpr (std::is_same_v<T, stepcore::AdamWFormula>) return HyperKind::formula;
  ADD_FAILURE() << "a member type the table does not know";
  return HyperKind::real;
}

// Checks entry `info` against Unit.
template <class Unit>
void check_entry(const OptimizerInfo& info) {
  using C = typename Unit::Config;
  const std::string name = Unit::kName;
  EXPECT_EQ(std::string(info.name), name);
  EXPECT_EQ(std::string(info.name), std::string(OptimizerTraits<C>::kName));
  EXPECT_EQ(info.counts_steps, Unit::kCountsSteps) << name;
  EXPECT_EQ(info.reads_scaled, Unit::kReadsScaled) << name;
  EXPECT_EQ(info.q8, ::stepcore::detail::unit_takes_q8<Unit>()) << name;

  // Hyper-parameters: OptimizerTraits' fields, in order, with the Config's defaults.
  const auto& fields = OptimizerTraits<C>::kFields;
  ASSERT_EQ(info.hyper.size(), std::size(fields)) << name;
  const C defaults{};
  for (std::size_t i = 0; i < info.hyper.size(); ++i) {
    const HyperInfo& h = info.hyper[i];
    EXPECT_EQ(std::string(h.name), std::string(fields[i].name)) << name << " field " << i;
    EXPECT_EQ(h.role, fields[i].role) << name << "." << h.name;
    EXPECT_EQ(h.formulas, fields[i].formulas) << name << "." << h.name;
    std::visit(
        [&](auto member) {
          using T = std::remove_cvref_t<decltype(defaults.*member)>;
          EXPECT_EQ(h.kind, expected_kind<T>()) << name << "." << h.name;
          EXPECT_EQ(h.default_value, static_cast<double>(defaults.*member))
              << name << "." << h.name;
        },
        fields[i].member);
  }

  // Slots: every one of the unit's, by its names, in its order.
  ASSERT_EQ(info.slots.size(), static_cast<std::size_t>(Unit::kSlots)) << name;
  for (int k = 0; k < Unit::kSlots; ++k)
    EXPECT_EQ(std::string(info.slots[static_cast<std::size_t>(k)].name),
              std::string(Unit::kSlotNames[k]))
        << name << " slot " << k;
}

template <class... Units>
void check_table(stepcore::detail::UnitList<Units...>) {
  const auto table = stepcore::optimizer_table();
  ASSERT_EQ(table.size(), sizeof...(Units));
  std::size_t i = 0;
  (check_entry<Units>(table[i++]), ...);
}

TEST(OptimizerTable, EveryUnitInOrderAsTheUnitAndItsTraitsDeclareIt) {
  check_table(stepcore::detail::AllUnits{});
  EXPECT_EQ(stepcore::optimizer_table().size(), std::variant_size_v<OptimizerConfig>);
}

// Entry i is OptimizerConfig's alternative i: parse_optimizer(entry's name) holds it, and a
// configuration's slots (optimizer_slot_names) are the first of the entry's slots.
TEST(OptimizerTable, EntryIIsTheConfigurationAlternativeI) {
  const auto table = stepcore::optimizer_table();
  for (std::size_t i = 0; i < table.size(); ++i) {
    const OptimizerConfig c = stepcore::parse_optimizer(table[i].name);
    EXPECT_EQ(c.index(), i) << table[i].name;
    EXPECT_EQ(stepcore::optimizer_counts_steps(c), table[i].counts_steps) << table[i].name;
    const std::vector<std::string_view> used = stepcore::optimizer_slot_names(c);
    ASSERT_LE(used.size(), table[i].slots.size()) << table[i].name;
    for (std::size_t k = 0; k < used.size(); ++k)
      EXPECT_EQ(used[k], std::string_view(table[i].slots[k].name)) << table[i].name;
  }
}

// The 8-bit names, written out here: "adamw8bit" and "adam8bit" give the optimizer's
// defaults with formula torchao and q8_state; a table name gives its defaults without; an
// 8-bit name of an optimizer without 8-bit state, or any other name, is refused naming
// "optimizer" and listing the 8-bit names.
TEST(OptimizerTable, EightBitNamesAreTheQ8OptimizersWithTorchaosFormula) {
  using stepcore::AdamWFormula;
  using stepcore::OptimizerChoice;
  for (const char* name : {"adamw8bit", "adam8bit"}) {
    const OptimizerChoice c = stepcore::parse_optimizer_choice(name);
    EXPECT_TRUE(c.q8_state) << name;
    const std::string base(name, std::string_view(name).size() - 4);
    EXPECT_EQ(stepcore::optimizer_name(c.optimizer), base);
    bool formula = false;
    for (const stepcore::OptimizerField& f : stepcore::optimizer_fields(c.optimizer))
      if (f.name == "formula") {
        formula = true;
        EXPECT_EQ(std::get<std::string>(f.value), "torchao") << name;
      }
    EXPECT_TRUE(formula) << name;
  }
  for (const OptimizerInfo& info : stepcore::optimizer_table()) {
    const OptimizerChoice c = stepcore::parse_optimizer_choice(info.name);
    EXPECT_FALSE(c.q8_state) << info.name;
    EXPECT_EQ(c.optimizer.index(), stepcore::parse_optimizer(info.name).index());
    const auto got = stepcore::optimizer_fields(c.optimizer);
    const auto defaults = stepcore::optimizer_fields(stepcore::parse_optimizer(info.name));
    ASSERT_EQ(got.size(), defaults.size()) << info.name;
    for (std::size_t k = 0; k < got.size(); ++k)
      EXPECT_TRUE(got[k].name == defaults[k].name && got[k].value == defaults[k].value)
          << info.name << "." << got[k].name;
  }
  for (const char* name : {"sgd8bit", "lion8bit", "adamw8", "8bit", "AdamW8bit", ""}) {
    try {
      stepcore::parse_optimizer_choice(name);
      ADD_FAILURE() << "took '" << name << "'";
    } catch (const stepcore::Error& e) {
      EXPECT_EQ(e.code(), stepcore::Errc::invalid_argument) << name;
      EXPECT_EQ(e.argument(), "optimizer") << name;
      const std::string what = e.what();
      EXPECT_NE(what.find("adamw, adamw8bit"), std::string::npos) << what;
      EXPECT_NE(what.find("adam, adam8bit"), std::string::npos) << what;
    }
  }
}

// The formulas each optimizer takes by name (written out here: AdamW's three, Adam's torch
// and torchao), set by make_optimizer_config and named back by optimizer_fields; another
// name, or a name for a field that is not a formula, is refused naming the field.
TEST(OptimizerTable, FormulasAreTakenByNameWhereTheFieldTakesThem) {
  using stepcore::AdamWFormula;
  using stepcore::Errc;
  using stepcore::OptimizerField;
  const std::vector<std::pair<std::string, std::vector<std::string>>> takes = {
      {"adamw", {"native", "torch", "torchao"}}, {"adam", {"torch", "torchao"}}};
  for (const auto& [optimizer, names] : takes) {
    for (const char* f : {"native", "torch", "torchao"}) {
      const OptimizerField field{"formula", std::string(f)};
      const bool taken = std::find(names.begin(), names.end(), f) != names.end();
      if (!taken) {
        try {
          stepcore::make_optimizer_config(optimizer, std::span(&field, 1));
          ADD_FAILURE() << optimizer << " took formula " << f;
        } catch (const stepcore::Error& e) {
          EXPECT_EQ(e.code(), Errc::invalid_argument);
          EXPECT_EQ(e.argument(), optimizer + ".formula");
        }
        continue;
      }
      const OptimizerConfig c = stepcore::make_optimizer_config(optimizer, std::span(&field, 1));
      bool named = false;
      for (const OptimizerField& back : stepcore::optimizer_fields(c))
        if (back.name == "formula") {
          named = true;
          EXPECT_EQ(std::get<std::string>(back.value), f) << optimizer;
        }
      EXPECT_TRUE(named) << optimizer;
    }
  }
  const OptimizerField momentum{"momentum", std::string("torch")};
  try {
    stepcore::make_optimizer_config("sgd", std::span(&momentum, 1));
    ADD_FAILURE() << "a name for a number";
  } catch (const stepcore::Error& e) {
    EXPECT_EQ(e.argument(), "sgd.momentum");
  }
}

// A slot's initial field is a real hyper-parameter of its optimizer, and the managers start
// the slot from its value (rounded to f32); every other slot starts at +0.
TEST(OptimizerTable, SlotsStartFromTheFieldTheyName) {
  int with_initial = 0;
  for (const OptimizerInfo& info : stepcore::optimizer_table()) {
    for (const stepcore::SlotInfo& s : info.slots) {
      OptimizerConfig c = stepcore::parse_optimizer(info.name);
      if (s.initial == nullptr) {
        EXPECT_EQ(stepcore::detail::initial_slot_value(c, s.name), 0.0f) << s.name;
        continue;
      }
      ++with_initial;
      bool found = false;
      for (const HyperInfo& h : info.hyper)
        if (std::string_view(h.name) == s.initial) {
          found = true;
          EXPECT_EQ(h.kind, HyperKind::real) << info.name << "." << h.name;
        }
      ASSERT_TRUE(found) << info.name << " slot " << s.name << " names " << s.initial;
      stepcore::detail::set_config_field(c, s.initial, 0.1, "test");
      EXPECT_EQ(stepcore::detail::initial_slot_value(c, s.name), 0.1f) << s.name;
    }
  }
  EXPECT_EQ(with_initial, 1);  // Adagrad's sum, as torch fills it
}

// The slots that are never negative are the second moments, their maximum and Adagrad's
// sum of squares (written out here, independently of the units' declarations), and the
// checkpoint and import checks ask the table by optimizer and slot name.
TEST(OptimizerTable, NonNegativeSlotsAreTheSquaresAndTheirSums) {
  const std::set<std::string> squares = {"exp_avg_sq", "max_exp_avg_sq", "sum"};
  int seen = 0;
  for (const OptimizerInfo& info : stepcore::optimizer_table())
    for (const stepcore::SlotInfo& s : info.slots) {
      EXPECT_EQ(s.non_negative, squares.count(s.name) == 1) << info.name << "." << s.name;
      EXPECT_EQ(stepcore::detail::slot_non_negative(info.name, s.name), s.non_negative);
      seen += s.non_negative;
    }
  EXPECT_EQ(seen, 5);  // adamw and adam: exp_avg_sq, max_exp_avg_sq; adagrad: sum
  EXPECT_FALSE(stepcore::detail::slot_non_negative("lion", "exp_avg_sq"));
  EXPECT_FALSE(stepcore::detail::slot_non_negative("no_such", "sum"));
}

}  // namespace
