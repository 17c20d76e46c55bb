// The mode-independent part of every gradient manager (ManagerImpl): argument
// and call-sequence validation (all before anything changes), chunking, per-step gradient
// bookkeeping and the optimizer-in-backward trigger; the modes implement its hooks. The
// public GradientManager forwards every call to it. Also the mode and optimizer parsers.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>
#include <unordered_set>
#include <utility>

#include "core/validate.hpp"
#include "managers/manager_impl.hpp"
#include "managers/offload_layout.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace stepcore {

OffloadMode parse_offload_mode(std::string_view name) {
  if (name == "none") return OffloadMode::none;
  if (name == "optimizer") return OffloadMode::optimizer;
  if (name == "full") return OffloadMode::full;
  std::string why = "unknown offload mode '" + std::string(name) +
                    "': expected exactly one of none, optimizer, full";
  if (name == "fsdp") why += " (the fsdp mode was removed: use full)";
  throw Error(Errc::invalid_argument, "offload_mode", why);
}

std::string_view offload_mode_name(OffloadMode mode) noexcept {
  switch (mode) {
    case OffloadMode::none:
      return "none";
    case OffloadMode::optimizer:
      return "optimizer";
    case OffloadMode::full:
      return "full";
  }
  return "?";
}

Speculation parse_speculation(std::string_view name) {
  if (name == "always") return Speculation::always;
  if (name == "never") return Speculation::never;
  if (name == "auto") return Speculation::automatic;
  throw Error(Errc::invalid_argument, "speculation",
              "unknown speculation policy '" + std::string(name) +
                  "': expected exactly one of always, never, auto");
}

std::string_view speculation_name(Speculation policy) noexcept {
  switch (policy) {
    case Speculation::always:
      return "always";
    case Speculation::never:
      return "never";
    case Speculation::automatic:
      return "auto";
  }
  return "?";
}

// ---- the state the call sequence keeps, and the modes' chunks -------------------------

namespace detail {

namespace {

// The groups a configuration has: its own, or the single group "default" made of the
// optimizer's hyper-parameters.
std::vector<ParamGroup> resolve_groups(const ManagerConfig& c) {
  if (!c.groups.empty()) return c.groups;
  return {default_group(c.optimizer)};
}

std::string indexed(const char* base, std::size_t i, const char* field) {
  return std::string(base) + "[" + std::to_string(i) + "]." + field;
}

}  // namespace

/// Throws what a manager's construction refuses in every mode before anything is
/// allocated (GradientManager and plan_memory check a configuration with it): the
/// optimizer, chunk_elements, the speculation fields, the groups (names, each one's
/// configuration), the parameters (names, groups, compute destinations) and the ring.
void validate_manager_config(const ManagerConfig& config) {
  const std::size_t n = config.params.size();
  if (config.optimizer.valueless_by_exception())
    throw Error(Errc::invalid_argument, "optimizer", "holds no configuration");
  if (config.chunk_elements == 0) throw Error(Errc::out_of_range, "chunk_elements", "must be > 0");
  if (config.speculation != Speculation::always && config.speculation != Speculation::never &&
      config.speculation != Speculation::automatic)
    throw Error(Errc::invalid_argument, "speculation",
                std::to_string(static_cast<int>(config.speculation)) +
                    " is not a Speculation: always, never or automatic (\"auto\")");
  if (config.speculation_bytes < 0 && config.speculation_bytes != ManagerConfig::kAllChunks)
    throw Error(Errc::out_of_range, "speculation_bytes",
                std::to_string(config.speculation_bytes) +
                    ": a budget is >= 0 bytes, or ManagerConfig::kAllChunks (-1)");
  if (config.speculation_device_bytes < 0 &&
      config.speculation_device_bytes != ManagerConfig::kAllChunks)
    throw Error(Errc::out_of_range, "speculation_device_bytes",
                std::to_string(config.speculation_device_bytes) +
                    ": a budget is >= 0 bytes, or ManagerConfig::kAllChunks (-1)");
  if (config.speculation_device_bytes != 0 && config.mode != OffloadMode::full)
    throw Error(Errc::invalid_argument, "speculation_device_bytes",
                "stages compute weights only in mode full (modes none and optimizer keep "
                "their rollback space on the device: speculation_bytes)");

  if (config.q8_state) {
    const OptimizerInfo& info = optimizer_table()[config.optimizer.index()];
    if (!info.q8)
      throw Error(Errc::not_supported, "q8_state",
                  std::string(info.name) +
                      " has no 8-bit state (optimizer_table()'s q8 entries "
                      "have: adamw, adam)");
  }

  // The groups: names, and each one's configuration as the optimizer will see it.
  const std::vector<ParamGroup> groups = resolve_groups(config);
  const bool implicit = config.groups.empty();
  const std::string opt_prefix = "optimizer." + std::string(optimizer_name(config.optimizer)) + ".";
  const bool betas = has_betas(config.optimizer);
  std::unordered_set<std::string_view> group_names;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].name.empty())
      throw Error(Errc::invalid_argument, indexed("groups", g, "name"), "must not be empty");
    if (!group_names.insert(groups[g].name).second)
      throw Error(Errc::invalid_argument, indexed("groups", g, "name"),
                  "'" + groups[g].name + "' names two groups");
    with_group_names(implicit ? opt_prefix : indexed("groups", g, ""), opt_prefix, betas,
                     [&] { validate_config(group_config(config.optimizer, groups[g])); });
  }

  // The parameters: unique names (checkpoints key by them), groups, destinations.
  std::unordered_set<std::string_view> names;
  std::vector<Range> destinations;
  for (std::size_t i = 0; i < n; ++i) {
    const ParamSpec& p = config.params[i];
    if (!names.insert(p.name).second)
      throw Error(Errc::invalid_argument, indexed("params", i, "name"),
                  "'" + p.name + "' names two parameters (checkpoints key state by name)");
    if (p.group >= groups.size())
      throw Error(Errc::out_of_range, indexed("params", i, "group"),
                  std::to_string(p.group) + " >= the number of groups (" +
                      std::to_string(groups.size()) + ")");
    const TensorView& d = p.compute_into;
    if (d.data == nullptr && d.numel == 0) continue;
    const std::string arg = indexed("params", i, "compute_into");
    if (!p.has_compute_weights)
      throw Error(Errc::invalid_argument, arg, "needs has_compute_weights");
    if (d.dtype != p.compute_dtype)
      throw Error(Errc::unsupported_dtype, arg,
                  std::string(dtype_name(d.dtype)) + " for compute_dtype " +
                      std::string(dtype_name(p.compute_dtype)));
    if (d.numel != p.numel)
      throw Error(Errc::size_mismatch, arg,
                  std::to_string(d.numel) + " elements for " + std::to_string(p.numel));
    if (d.data == nullptr) throw Error(Errc::null_pointer, arg, "no data for numel > 0");
    if (reinterpret_cast<std::uintptr_t>(d.data) % dtype_size(d.dtype) != 0)
      throw Error(Errc::invalid_argument, arg, "not aligned to its element size");
    const auto begin = reinterpret_cast<std::uintptr_t>(d.data);
    destinations.push_back({begin, begin + d.bytes(), true, Arg{"params", i, "compute_into"}});
  }
  check_overlaps(destinations);
  (void)ring_geometry(config);  // every mode refuses a bad ring; full offload uses it
}

}  // namespace detail

// ManagerImpl (manager_impl.hpp) is declared in stepcore, where its members are defined.
using detail::CallPhase;

ManagerImpl::ManagerImpl(ManagerConfig config) : config_(std::move(config)) {
  using namespace detail;
  validate_manager_config(config_);
  const std::size_t n = config_.params.size();
  shape_ = optimizer_shape(config_.optimizer);
  for (std::string_view slot : shape_.slot_names)
    initial_.push_back(detail::initial_slot_value(config_.optimizer, slot));
  groups_ = resolve_groups(config_);

  chunk_of_.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t numel = config_.params[i].numel;
    if (chunks_.empty() || (chunks_.back().elements != 0 &&
                            chunks_.back().elements + numel > config_.chunk_elements)) {
      chunks_.push_back({i, i, 0});
    }
    Chunk& c = chunks_.back();
    c.last = i + 1;
    c.elements += numel;
    chunk_of_[i] = chunks_.size() - 1;
  }
  ready_in_micro_.assign(n, 0);
  got_in_step_.assign(n, 0);
  chunk_pending_.assign(chunks_.size(), 0);
}

OptimizerConfig ManagerImpl::group_config(std::size_t g) const {
  return detail::group_config(config_.optimizer, groups_[g]);
}

void ManagerImpl::expect_param(std::size_t i) const {
  if (i >= config_.params.size())
    throw Error(Errc::out_of_range, "i",
                std::to_string(i) + " >= number of parameters (" +
                    std::to_string(config_.params.size()) + ")");
}

ManagerImpl::~ManagerImpl() = default;

void ManagerImpl::do_import_range(std::size_t, std::size_t, Arrays<const float>, float, bool) {
  throw Error(Errc::internal, "mode",
              std::string(offload_mode_name(mode())) + ": import of a range not implemented");
}

void ManagerImpl::do_import_q8_range(std::size_t, std::size_t, bool, std::size_t,
                                     std::span<const std::byte>) {
  throw Error(Errc::internal, "do_import_q8_range", "this mode keeps no 8-bit state");
}

void ManagerImpl::do_read_q8_range(std::size_t, std::size_t, bool, std::size_t,
                                   std::span<std::byte>) {
  throw Error(Errc::internal, "do_read_q8_range", "this mode keeps no 8-bit device state");
}

void ManagerImpl::do_read_range(std::size_t, std::size_t, Arrays<float>) {
  throw Error(Errc::internal, "mode",
              std::string(offload_mode_name(mode())) + ": read of a range not implemented");
}

std::size_t ManagerImpl::speculation_budget() const noexcept {
  return config_.speculation_bytes == ManagerConfig::kAllChunks
             ? SIZE_MAX
             : static_cast<std::size_t>(config_.speculation_bytes);
}

void ManagerImpl::expect(bool ok, const char* call, const char* what) const {
  if (phase_ == CallPhase::closed)
    throw Error(Errc::invalid_argument, call, "the manager is closed");
  if (failure_) std::rethrow_exception(failure_);
  if (!ok) throw Error(Errc::invalid_argument, call, what);
}

// ---- the call sequence: validated here, then the mode's hook ---------------------------

GradientManager::GradientManager(std::unique_ptr<ManagerImpl> impl) noexcept
    : impl_(std::move(impl)) {}
GradientManager::~GradientManager() = default;

OffloadMode GradientManager::mode() const noexcept { return impl_->config_.mode; }
const ManagerConfig& GradientManager::config() const noexcept { return impl_->config_; }
float GradientManager::effective_gradient_scale() const noexcept {
  return impl_->scale_ * impl_->clip_;
}

namespace detail {

void check_state_values(std::span<const float> values, std::size_t want, const std::string& name,
                        bool non_negative, const std::string& where) {
  if (values.size() != want)
    throw Error(Errc::size_mismatch, name,
                where + std::to_string(values.size()) + " values for " + std::to_string(want) +
                    " elements");
  // An exponent of all ones is NaN or Inf; above 0x80000000 is a negative value but -0.
  std::uint32_t bad = 0;
  for (const float x : values) {
    const auto b = std::bit_cast<std::uint32_t>(x);
    bad |= static_cast<std::uint32_t>((b & 0x7F800000u) == 0x7F800000u) |
           static_cast<std::uint32_t>(non_negative && b > 0x80000000u);
  }
  if (bad == 0) return;
  for (std::size_t j = 0; j < values.size(); ++j)
    if (!std::isfinite(values[j]) || (non_negative && values[j] < 0.0f))
      throw_bad_state_value(name, where, j, values[j]);
}

void throw_bad_state_value(const std::string& name, const std::string& where, std::size_t j,
                           float value) {
  if (!std::isfinite(value))
    throw Error(Errc::non_finite, name, where + "element " + std::to_string(j) + " is not finite");
  throw Error(Errc::invalid_argument, name,
              where + "element " + std::to_string(j) + " is negative (a second moment is >= 0)");
}

void check_q8_state(std::span<const std::uint8_t> codes, std::span<const float> absmax,
                    std::size_t numel, const std::string& name, const std::string& where) {
  if (codes.size() != numel)
    throw Error(
        Errc::size_mismatch, name + ".codes",
        where + std::to_string(codes.size()) + " codes for " + std::to_string(numel) + " elements");
  const std::size_t blocks = q8_blocks(numel);
  if (absmax.size() != blocks)
    throw Error(Errc::size_mismatch, name + ".absmax",
                where + std::to_string(absmax.size()) + " block maxima for " +
                    std::to_string(blocks) + " blocks of " + std::to_string(kQ8BlockSize));
  check_state_values(absmax, blocks, name + ".absmax", true, where);
}

bool valid_step_count(float step, bool counts_steps) noexcept {
  if (!counts_steps) return step == 0.0f && !std::signbit(step);
  return step >= 0.0f && step <= 16777216.0f && step == std::floor(step);  // NaN fails
}

}  // namespace detail

const std::vector<std::string_view>& GradientManager::state_slot_names() const noexcept {
  return impl_->shape_.slot_names;
}

void GradientManager::load_parameter(std::size_t i, std::span<const float> master) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "load_parameter", "only between steps");
  m.expect_param(i);
  detail::check_state_values(master, m.config_.params[i].numel, "master", false);
  std::vector<std::span<const float>> arrays(1 + m.state_slots());
  arrays[0] = master;
  std::vector<ManagerImpl::Q8Array<const std::uint8_t, const float>> q8(
      m.q8_param(i) ? m.state_slots() : 0);
  m.guarded([&] { m.do_import_parameter(i, arrays, q8, 0.0f); });
}

bool GradientManager::q8_parameter(std::size_t i) const {
  impl_->expect_param(i);
  return impl_->q8_param(i);
}

namespace {

// "exp_avg, exp_avg_sq" (or "none") for the messages about slot names.
std::string slot_list(const std::vector<std::string_view>& names) {
  std::string out;
  for (std::string_view n : names) out += (out.empty() ? "" : ", ") + std::string(n);
  return out.empty() ? "none" : out;
}

// Returns, per slot name of `names`, the index into `given` of the entry naming it
// (given.size() when absent); throws Errc::invalid_argument naming "state" for a name
// that is not a slot or is given twice, and (`all`) for a slot not given.
template <class Slot>
std::vector<std::size_t> match_slots(const std::vector<std::string_view>& names,
                                     std::span<const Slot> given, bool all,
                                     std::string_view optimizer) {
  std::vector<std::size_t> at(names.size(), given.size());
  for (std::size_t k = 0; k < given.size(); ++k) {
    std::size_t s = 0;
    while (s < names.size() && names[s] != given[k].name) ++s;
    if (s == names.size())
      throw Error(Errc::invalid_argument, "state",
                  "'" + std::string(given[k].name) + "' is not a state slot of this " +
                      std::string(optimizer) + " (its slots: " + slot_list(names) + ")");
    if (at[s] != given.size())
      throw Error(Errc::invalid_argument, "state",
                  "slot '" + std::string(names[s]) + "' is given twice");
    at[s] = k;
  }
  for (std::size_t s = 0; s < names.size() && all; ++s)
    if (at[s] == given.size())
      throw Error(Errc::invalid_argument, "state",
                  "slot '" + std::string(names[s]) + "' is missing (this " +
                      std::string(optimizer) + " keeps " + slot_list(names) + ")");
  return at;
}

}  // namespace

void GradientManager::import_parameter(std::size_t i, std::span<const float> master,
                                       std::span<const SlotIn> state, float step) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "import_parameter", "only between steps");
  m.expect_param(i);
  const std::size_t numel = m.config_.params[i].numel;
  const auto& names = m.shape_.slot_names;
  const std::vector<std::size_t> at = match_slots(names, state, true, m.shape_.name);
  detail::check_state_values(master, numel, "master", false);
  std::vector<std::span<const float>> arrays(1 + names.size());
  arrays[0] = master;
  const bool q8 = m.q8_param(i);
  std::vector<ManagerImpl::Q8Array<const std::uint8_t, const float>> codes(q8 ? names.size() : 0);
  for (std::size_t s = 0; s < names.size(); ++s) {
    const SlotIn& in = state[at[s]];
    const std::string name(names[s]);
    const bool non_negative = detail::slot_non_negative(m.shape_.name, names[s]);
    if (!q8) {
      if (!in.codes.empty() || !in.absmax.empty())
        throw Error(Errc::invalid_argument, name + ".codes",
                    "parameter " + std::to_string(i) + "'s slots are f32 (values), not 8-bit");
      arrays[1 + s] = in.values;
      detail::check_state_values(arrays[1 + s], numel, name, non_negative);
      continue;
    }
    if (!in.values.empty())
      throw Error(Errc::invalid_argument, name,
                  "parameter " + std::to_string(i) +
                      "'s slots are 8-bit: give codes and "
                      "absmax, not values");
    detail::check_q8_state(in.codes, in.absmax, numel, name);
    codes[s] = {in.codes, in.absmax};
  }
  const bool counts = m.shape_.counts_steps;
  if (!std::isfinite(step)) throw Error(Errc::non_finite, "step", "not finite");
  if (!detail::valid_step_count(step, counts))
    throw Error(counts ? Errc::out_of_range : Errc::invalid_argument, "step",
                counts
                    ? std::to_string(step) + " is not an integer in [0, 2^24] (an f32 step counter)"
                    : std::string(m.shape_.name) + " has no step counter: pass 0");
  m.guarded([&] { m.do_import_parameter(i, arrays, codes, step); });
}

void GradientManager::import_parameter(std::size_t i, std::span<const float> master,
                                       std::span<const float> exp_avg,
                                       std::span<const float> exp_avg_sq, float step) {
  std::vector<SlotIn> state;
  if (!exp_avg.empty() || !exp_avg_sq.empty() || impl_->state_slots() != 0) {
    state.push_back({"exp_avg", exp_avg});
    state.push_back({"exp_avg_sq", exp_avg_sq});
  }
  import_parameter(i, master, state, step);
}

std::size_t GradientManager::group_count() const noexcept { return impl_->groups_.size(); }

std::size_t GradientManager::group_index(std::string_view name) const {
  const auto& groups = impl_->groups_;
  for (std::size_t g = 0; g < groups.size(); ++g)
    if (groups[g].name == name) return g;
  std::string known;
  for (const ParamGroup& g : groups) known += (known.empty() ? "" : ", ") + g.name;
  throw Error(Errc::invalid_argument, "group",
              "no group named '" + std::string(name) + "' (groups: " + known + ")");
}

const ParamGroup& GradientManager::group(std::size_t g) const {
  const auto& groups = impl_->groups_;
  if (g >= groups.size())
    throw Error(
        Errc::out_of_range, "group",
        std::to_string(g) + " >= the number of groups (" + std::to_string(groups.size()) + ")");
  return groups[g];
}

void GradientManager::set_hyperparameters(std::size_t g, const StepHyper& hyper) {
  ManagerImpl& m = *impl_;
  m.expect(true, "set_hyperparameters", "");
  (void)group(g);
  m.expect(!(m.overlap_ && m.final_ &&
             (m.phase_ == CallPhase::backward || m.phase_ == CallPhase::after_final)),
           "set_hyperparameters",
           "this step overlaps the optimizer with its final backward, whose chunks already "
           "use the current values: set them before begin_backward(true) or after step()");
  // The group's configuration with the new values must pass the configuration's checks.
  detail::with_group_names(
      "hyper.", "optimizer." + std::string(m.shape_.name) + ".",
      detail::has_betas(m.config_.optimizer), [&] {
        ParamGroup changed = m.groups_[g];
        changed.lr = hyper.lr;
        changed.weight_decay = hyper.weight_decay;
        detail::validate_config(detail::group_config(m.config_.optimizer, changed));
      });
  m.groups_[g].lr = hyper.lr;
  m.groups_[g].weight_decay = hyper.weight_decay;
  ++m.hyper_version_;
}

void GradientManager::begin_step(float gradient_scale, bool overlap_optimizer) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "begin_step",
           "the previous step has not ended with step()");
  ::stepcore::detail::check_gradient_scale(gradient_scale, "gradient_scale");
  // The rollback space first, for any overlapped step that may speculate: a failed
  // reservation changes nothing (not even the last report).
  const Speculation policy = m.config_.speculation;
  const bool may_speculate =
      overlap_optimizer && m.config_.speculation_bytes != 0 && policy != Speculation::never;
  if (may_speculate) m.guarded([&] { m.do_reserve_speculation(); });
  m.guarded([&] { m.do_begin_step(); });  // may raise errors of the previous step's work
  // auto: the previous step's outcome is known now (do_begin_step settled it).
  m.speculating_ = may_speculate && (policy == Speculation::always || m.would_commit_);
  m.scale_ = gradient_scale;
  m.clip_ = 1.0f;
  m.overlap_ = overlap_optimizer;
  m.saw_final_ = m.clipped_ = m.stepped_ = m.backward_in_step_ = false;
  std::fill(m.got_in_step_.begin(), m.got_in_step_.end(), std::uint8_t{0});
  m.phase_ = CallPhase::step;
}

void GradientManager::begin_backward(bool final_backward) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::step, "begin_backward",
           "needs begin_step() first, and finish_backward() after each backward");
  m.expect(!m.saw_final_, "begin_backward", "the step's final backward has already run");
  m.guarded([&] { m.do_begin_backward(final_backward, !m.backward_in_step_); });
  m.backward_in_step_ = true;
  m.final_ = final_backward;
  std::fill(m.ready_in_micro_.begin(), m.ready_in_micro_.end(), std::uint8_t{0});
  if (m.final_)
    for (std::size_t c = 0; c < m.chunks_.size(); ++c)
      m.chunk_pending_[c] = m.chunks_[c].last - m.chunks_[c].first;
  m.phase_ = CallPhase::backward;
}

namespace {

// Throws unless `call` may use parameter i's manager-owned gradient buffer now.
// (i is a parameter's index).
void expect_owned_buffer(const ManagerConfig& config, std::size_t i, const char* call) {
  if (!config.params[i].gradient_buffer)
    throw Error(Errc::invalid_argument, call,
                "parameter " + std::to_string(i) +
                    " has no manager buffer (ParamSpec::gradient_buffer = false): pass the "
                    "trainer's own to gradient_ready(i, grad, written)");
}

}  // namespace

TensorView GradientManager::gradient(std::size_t i) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::backward, "gradient",
           "only between begin_backward and finish_backward");
  m.expect_param(i);
  expect_owned_buffer(m.config_, i, "gradient");
  return m.guarded([&] { return m.do_gradient(i); });
}

void GradientManager::gradient_ready(std::size_t i, const device::Event& written) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::backward, "gradient_ready",
           "only between begin_backward and finish_backward");
  m.expect_param(i);
  expect_owned_buffer(m.config_, i, "gradient_ready");
  ready(i, m.guarded([&] { return ConstTensorView(m.do_gradient(i)); }), written);
}

void GradientManager::gradient_ready(std::size_t i, ConstTensorView grad,
                                     const device::Event& written) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::backward, "gradient_ready",
           "only between begin_backward and finish_backward");
  m.expect_param(i);
  const ParamSpec& p = m.config_.params[i];
  if (grad.dtype != p.grad_dtype)
    throw Error(Errc::unsupported_dtype, "grad",
                std::string(dtype_name(grad.dtype)) + " for grad_dtype " +
                    std::string(dtype_name(p.grad_dtype)));
  if (grad.numel != p.numel)
    throw Error(Errc::size_mismatch, "grad",
                std::to_string(grad.numel) + " elements for " + std::to_string(p.numel));
  if (grad.data == nullptr && grad.numel != 0)
    throw Error(Errc::null_pointer, "grad", "no data for numel > 0");
  if (reinterpret_cast<std::uintptr_t>(grad.data) % dtype_size(grad.dtype) != 0)
    throw Error(Errc::invalid_argument, "grad", "not aligned to its element size");
  ready(i, grad, written);
}

void GradientManager::ready(std::size_t i, ConstTensorView grad, const device::Event& written) {
  ManagerImpl& m = *impl_;
  if (m.ready_in_micro_[i])
    throw Error(Errc::invalid_argument, "gradient_ready",
                "parameter " + std::to_string(i) + " is already ready in this micro-batch");
  m.guarded([&] { m.do_gradient_ready(i, m.got_in_step_[i] == 0, grad, written); });
  m.ready_in_micro_[i] = 1;
  m.got_in_step_[i] = 1;
  if (m.final_ && m.overlap_) {
    const std::size_t c = m.chunk_of_[i];
    if (--m.chunk_pending_[c] == 0) m.guarded([&] { m.do_step_chunk(c); });
  }
}

device::Event GradientManager::gradient_released(std::size_t i) const {
  const ManagerImpl& m = *impl_;
  m.expect_param(i);
  return m.do_gradient_released(i);
}

bool GradientManager::gradients_read_by_step() const noexcept {
  return impl_->do_reads_gradients_at_step();
}

MemoryReport GradientManager::memory() const { return impl_->ledger().report(); }

void GradientManager::finish_backward() {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::backward, "finish_backward", "needs begin_backward() first");
  if (m.final_) {
    m.last_gradient_ = std::chrono::steady_clock::now();
    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < m.got_in_step_.size(); ++i)
      if (!m.got_in_step_[i]) missing.push_back(i);
    m.guarded([&] { m.do_finish_final_backward(missing); });
    for (std::size_t i : missing) m.got_in_step_[i] = 1;
    if (m.overlap_) {
      // Chunks whose parameters did not all report in the final micro-batch step now.
      for (std::size_t c = 0; c < m.chunks_.size(); ++c)
        if (m.chunk_pending_[c] != 0) {
          m.chunk_pending_[c] = 0;
          m.guarded([&] { m.do_step_chunk(c); });
        }
    }
    m.saw_final_ = true;
    m.phase_ = CallPhase::after_final;
  } else {
    m.phase_ = CallPhase::step;
  }
}

float GradientManager::clip_grad_norm(float max_norm) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::after_final, "clip_grad_norm",
           "only after the step's final finish_backward() and before step()");
  m.expect(!m.clipped_, "clip_grad_norm", "already called in this step");
  ::stepcore::detail::check_max_norm(max_norm);
  float clip = 1.0f;
  const NormResult r = m.guarded([&] { return m.do_clip_grad_norm(max_norm, clip); });
  m.clip_ = clip;
  m.clipped_ = true;
  return r.norm;
}

void GradientManager::step() {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::after_final, "step",
           "only after the step's final finish_backward()");
  m.guarded([&] { m.do_step(); });
  m.stepped_ = true;
  m.phase_ = CallPhase::idle;
}

StepReport GradientManager::report() {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ != CallPhase::closed, "report", "");
  return m.guarded([&] { return m.do_report(); });
}

ConstTensorView GradientManager::compute_weights(std::size_t i) const {
  const ManagerImpl& m = *impl_;
  m.expect(m.phase_ != CallPhase::closed, "compute_weights", "");
  m.expect_param(i);
  return m.do_compute_weights(i);
}

void GradientManager::read_parameter(std::size_t i, std::span<float> master,
                                     std::span<const SlotOut> state,
                                     std::span<std::uint8_t> compute) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "read_parameter", "only between steps");
  m.expect_param(i);
  const ParamSpec& p = m.config_.params[i];
  auto check = [&](std::size_t got, std::size_t want, const std::string& name) {
    if (got != 0 && got != want)
      throw Error(Errc::size_mismatch, name,
                  std::to_string(got) + " for " + std::to_string(want) + " expected");
  };
  const auto& names = m.shape_.slot_names;
  const std::vector<std::size_t> at = match_slots(names, state, false, m.shape_.name);
  check(master.size(), p.numel, "master");
  std::vector<std::span<float>> arrays(1 + names.size());
  arrays[0] = master;
  const bool q8 = m.q8_param(i);
  std::vector<ManagerImpl::Q8Array<std::uint8_t, float>> codes(q8 ? names.size() : 0);
  for (std::size_t s = 0; s < names.size(); ++s) {
    if (at[s] == state.size()) continue;
    const SlotOut& out = state[at[s]];
    const std::string name(names[s]);
    if (q8 ? !out.values.empty() : !out.codes.empty() || !out.absmax.empty())
      throw Error(Errc::invalid_argument, q8 ? name : name + ".codes",
                  "parameter " + std::to_string(i) + "'s slots are " +
                      (q8 ? "8-bit: codes and absmax, not values" : "f32: values, not codes"));
    if (q8) {
      check(out.codes.size(), p.numel, name + ".codes");
      check(out.absmax.size(), q8_blocks(p.numel), name + ".absmax");
      codes[s] = {out.codes, out.absmax};
    } else {
      arrays[1 + s] = out.values;
      check(arrays[1 + s].size(), p.numel, name);
    }
  }
  check(compute.size(), p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0,
        "compute");
  m.guarded([&] { m.do_read_parameter(i, arrays, codes, compute); });
}

void GradientManager::read_parameter(std::size_t i, std::span<float> master,
                                     std::span<float> exp_avg, std::span<float> exp_avg_sq,
                                     std::span<std::uint8_t> compute) {
  std::vector<SlotOut> state;
  if (!exp_avg.empty()) state.push_back({"exp_avg", exp_avg});
  if (!exp_avg_sq.empty()) state.push_back({"exp_avg_sq", exp_avg_sq});
  read_parameter(i, master, state, compute);
}

float GradientManager::step_count(std::size_t i) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "step_count", "only between steps");
  m.expect_param(i);
  std::vector<float> steps(m.config_.params.size());
  m.guarded([&] { m.do_step_counts(steps); });
  return steps[i];
}

GradientManager::HostState GradientManager::host_state(std::size_t i) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "host_state", "only between steps");
  m.expect_param(i);
  const ManagerImpl::HostArrays h = m.guarded([&] { return m.do_host_state(i); });
  HostState out;
  out.master = h.a[0];
  for (std::size_t s = 0; s < m.state_slots(); ++s)
    out.slots.push_back({m.shape_.slot_names[s], h.a[1 + s], h.q8[s].codes, h.q8[s].absmax});
  return out;
}

void GradientManager::synchronize() {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ != CallPhase::closed, "synchronize", "");
  m.guarded([&] { m.do_synchronize(); });
}

void GradientManager::close() {
  ManagerImpl& m = *impl_;
  if (m.phase_ == CallPhase::closed) return;
  m.phase_ = CallPhase::closed;
  if (std::exception_ptr error = m.do_close()) std::rethrow_exception(error);
}

}  // namespace stepcore
