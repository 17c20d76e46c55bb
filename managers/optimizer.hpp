// The managers' one view of the optimizer: an OptimizerConfig dispatched once to its unit
// (core/optimizers/all.hpp), the state it keeps (named slots, a step counter), a group's
// configuration, its hyper-parameters by name (the field table: make_optimizer_config,
// checkpoints: OptimizerTraits' fields), and the initial value of each slot. Nothing here
// names an optimizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "core/optimizers/all.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/optim.hpp"

namespace stepcore::detail {

/// Calls fn(Unit{}, config) with the unit whose Config `config` holds, and returns its
/// result (every alternative's call must return the same type).
template <class Fn>
decltype(auto) with_unit(const OptimizerConfig& config, Fn&& fn) {
  return std::visit(
      [&](const auto& c) -> decltype(auto) {
        using Unit = typename UnitForConfig<std::decay_t<decltype(c)>, AllUnits>::type;
        return fn(Unit{}, c);
      },
      config);
}

/// What a manager keeps for each parameter besides its master, for one configuration.
struct OptimizerShape {
  std::string_view name;                     ///< the unit's kName
  std::vector<std::string_view> slot_names;  ///< the slots the configured variant uses
  bool counts_steps = false;                 ///< a step counter per parameter
  bool reads_scaled = true;                  ///< the update reads R(R(g*scale)*clip)
};
OptimizerShape optimizer_shape(const OptimizerConfig& config);

/// True for the configurations whose betas and eps are the groups' (the Adam family):
/// those whose OptimizerTraits mark fields HyperRole::betas (beta1, beta2, eps).
template <class C>
inline constexpr bool kHasBetas = [] {
  for (const HyperField<C>& f : OptimizerTraits<C>::kFields)
    if (f.role == HyperRole::betas) return true;
  return false;
}();
bool has_betas(const OptimizerConfig& config) noexcept;

/// Returns `config` with group g's lr and weight decay (and betas and eps, kHasBetas).
OptimizerConfig group_config(const OptimizerConfig& config, const ParamGroup& group);
/// Returns the single group "default" of a configuration without groups.
ParamGroup default_group(const OptimizerConfig& config);

/// The value a state slot starts from (load_parameter): f32 of the field the unit names
/// for it (Adagrad's sum: initial_accumulator_value), else +0.
float initial_slot_value(const OptimizerConfig& config, std::string_view slot);
/// Whether slot `slot` of optimizer `optimizer` is never negative (the unit's
/// kSlotNonNegative: a second moment, its maximum, a sum of squares): import and
/// checkpoints refuse a negative value there. An unknown optimizer or slot: false.
bool slot_non_negative(std::string_view optimizer, std::string_view slot) noexcept;

/// The code of +0 in an 8-bit slot's map (docs/numerics.md 8f: the zero code, 127 in the
/// signed map, 0 in the unsigned one): what a slot starting at 0 holds.
std::uint8_t q8_zero_code(bool non_negative) noexcept;

/// One field of a configuration as a double (flags 0/1, AdamW's formula its value).
struct FieldValue {
  std::string_view name;
  HyperRole role;
  double value;
};
/// Returns every field of `config`, in its record's order.
std::vector<FieldValue> config_fields(const OptimizerConfig& config);
/// Sets field `name` of `config` to `value` (a flag must be 0 or 1, a count or formula
/// an integer); throws Errc::invalid_argument naming `argument` for a bad value or a name
/// the configuration does not have.
void set_config_field(OptimizerConfig& config, std::string_view name, double value,
                      const std::string& argument);

/// Runs `check` (a validation of a resolved optimizer configuration, whose errors name
/// "config.<field>") and rethrows its Error naming `group_prefix` + field for a group's
/// fields (lr, weight_decay and, with `betas`, beta1, beta2, eps) and `optimizer_prefix`
/// + field otherwise.
void with_group_names(const std::string& group_prefix, const std::string& optimizer_prefix,
                      bool betas, const std::function<void()>& check);

/// Throws (Errc naming "<prefix>..." as with_group_names) unless `config` is a valid
/// configuration of its optimizer (the unit's own checks).
void validate_config(const OptimizerConfig& config);

}  // namespace stepcore::detail
