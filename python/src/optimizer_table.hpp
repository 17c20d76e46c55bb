// The Python face of every optimizer stepcore has: for each OptimizerConfig alternative,
// its name and the dict keys of its hyper-parameters (the members they set). Plain C++ on
// the public headers (no nanobind), so tests/test_python_optimizer_table.cpp can check the
// names against the units'; python/src/optim_args.hpp parses a name and a dict with it.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include "stepcore/optim.hpp"

namespace stepcore::python {

/// One hyper-parameter of configuration C: its key in the Python dict and the member it sets.
template <class C>
struct Field {
  const char* key;
  std::variant<double C::*, bool C::*, int C::*, AdamWFormula C::*> member;
};

/// The Python face of one OptimizerConfig alternative: the optimizer's name (its unit's
/// kName in core/optimizers/, which tests/test_python_optimizer_table.cpp checks) and the
/// keys of its hyper-parameters (the Config's field names). A unit added to
/// OptimizerConfig needs one specialisation here; without it the parser does not compile.
template <class C>
struct OptimizerFields;

template <>
struct OptimizerFields<AdamWConfig> {
  using C = AdamWConfig;
  static constexpr const char* kName = "adamw";
  static constexpr Field<C> kFields[] = {{"lr", &C::lr},
                                         {"beta1", &C::beta1},
                                         {"beta2", &C::beta2},
                                         {"eps", &C::eps},
                                         {"weight_decay", &C::weight_decay},
                                         {"formula", &C::formula},
                                         {"amsgrad", &C::amsgrad},
                                         {"maximize", &C::maximize},
                                         {"torch_tail_width", &C::torch_tail_width}};
};

template <>
struct OptimizerFields<SignSgdConfig> {
  using C = SignSgdConfig;
  static constexpr const char* kName = "sign_sgd";
  static constexpr Field<C> kFields[] = {{"lr", &C::lr}, {"weight_decay", &C::weight_decay}};
};

template <>
struct OptimizerFields<AdamConfig> {
  using C = AdamConfig;
  static constexpr const char* kName = "adam";
  static constexpr Field<C> kFields[] = {{"lr", &C::lr},
                                         {"beta1", &C::beta1},
                                         {"beta2", &C::beta2},
                                         {"eps", &C::eps},
                                         {"weight_decay", &C::weight_decay},
                                         {"amsgrad", &C::amsgrad},
                                         {"maximize", &C::maximize},
                                         {"torch_tail_width", &C::torch_tail_width}};
};

template <>
struct OptimizerFields<SgdConfig> {
  using C = SgdConfig;
  static constexpr const char* kName = "sgd";
  static constexpr Field<C> kFields[] = {{"lr", &C::lr},
                                         {"momentum", &C::momentum},
                                         {"dampening", &C::dampening},
                                         {"weight_decay", &C::weight_decay},
                                         {"nesterov", &C::nesterov},
                                         {"maximize", &C::maximize},
                                         {"torch_tail_width", &C::torch_tail_width}};
};

template <>
struct OptimizerFields<AdagradConfig> {
  using C = AdagradConfig;
  static constexpr const char* kName = "adagrad";
  static constexpr Field<C> kFields[] = {
      {"lr", &C::lr},
      {"lr_decay", &C::lr_decay},
      {"weight_decay", &C::weight_decay},
      {"initial_accumulator_value", &C::initial_accumulator_value},
      {"eps", &C::eps},
      {"maximize", &C::maximize}};
};

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

/// Returns "adamw, sign_sgd, ...": every optimizer's name, in OptimizerConfig's order.
inline std::string optimizer_names() {
  std::string out;
  for_each_optimizer([&](auto i) {
    using C = std::variant_alternative_t<decltype(i)::value, OptimizerConfig>;
    out += (out.empty() ? "" : ", ") + std::string(OptimizerFields<C>::kName);
  });
  return out;
}

}  // namespace stepcore::python
