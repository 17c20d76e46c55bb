// GradientManager::save_checkpoint / load_checkpoint: a manager's optimizer state as one
// rank's checkpoint file (managers/checkpoint_file.hpp, docs/checkpoint.md), in any mode.
// Saving reads host-resident state in place and copies device state one parameter at a
// time; loading reads and verifies the whole file (checksums and every value, in one
// pass) before it imports anything.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "core/validate.hpp"
#include "managers/checkpoint_file.hpp"
#include "managers/manager_impl.hpp"
#include "managers/optimizer.hpp"
#include "stepcore/config.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace stepcore {

using detail::CallPhase;
namespace ckpt = detail::checkpoint;

namespace {

// The header of `m`'s checkpoint (step counters from `steps`, one per parameter).
ckpt::Header header_of(const GradientManager& m, std::span<const float> steps) {
  const ManagerConfig& c = m.config();
  const bool betas = detail::has_betas(c.optimizer);
  ckpt::Header h;
  h.optimizer = std::string(optimizer_name(c.optimizer));
  for (const detail::FieldValue& f : detail::config_fields(c.optimizer))
    if (f.role == HyperRole::fixed) h.hyper.push_back({std::string(f.name), f.value});
  h.slots.assign(m.state_slot_names().begin(), m.state_slot_names().end());
  h.saved_mode = static_cast<std::uint32_t>(c.mode);
  h.rank = c.comm != nullptr ? c.comm->rank() : 0;
  h.world_size = c.comm != nullptr ? c.comm->size() : 1;
  h.layout_fingerprint = c.layout_fingerprint;
  h.library_version = STEPCORE_VERSION_STRING;
  for (std::size_t g = 0; g < m.group_count(); ++g) {
    const ParamGroup& pg = m.group(g);
    h.groups.push_back({pg.name, pg.lr, pg.weight_decay, betas ? pg.beta1 : 0.0,
                        betas ? pg.beta2 : 0.0, betas ? pg.eps : 0.0});
  }
  for (std::size_t i = 0; i < c.params.size(); ++i) {
    const ParamSpec& p = c.params[i];
    h.params.push_back(
        {p.name, p.numel, static_cast<std::uint32_t>(p.group), steps.empty() ? 0.0f : steps[i]});
  }
  return h;
}

// "checkpoint.params[i].<field>" for parameter i's name in errors.
std::string param_arg(std::size_t i, const char* field) {
  return "checkpoint.params[" + std::to_string(i) + "]." + field;
}

}  // namespace

void GradientManager::save_checkpoint(const std::string& path) {
  ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "save_checkpoint", "only between steps");
  if (path.empty()) throw Error(Errc::invalid_argument, "path", "empty");
  const std::size_t n = m.config_.params.size();
  std::vector<float> steps(n);
  m.guarded([&] { m.do_step_counts(steps); });
  const ckpt::Header header = header_of(*this, steps);
  // Host-resident state is written in place; device state through a copy, the next
  // parameter's copied out on a helper thread while this one's arrays are written (two
  // sets of buffers, used in turn). The source is asked for each parameter's arrays in
  // order, and its spans are valid until it is asked again.
  const std::size_t array_count = 1 + m.state_slots();
  struct Arrays {
    std::span<const float> a[1 + kMaxOptimizerSlots];
  };
  std::vector<float> copies[2][1 + kMaxOptimizerSlots];
  // Returns parameter i's arrays: in place, or copied into copies[i % 2].
  auto prepare = [&](std::size_t i, const ManagerImpl::HostArrays& h) {
    Arrays out;
    const std::size_t numel = m.config_.params[i].numel;
    if (numel == 0 || !h.a[0].empty()) {
      for (std::size_t a = 0; a < array_count; ++a) out.a[a] = h.a[a];
      return out;
    }
    std::vector<float>* copy = copies[i % 2];
    std::span<float> into[1 + kMaxOptimizerSlots];
    for (std::size_t a = 0; a < array_count; ++a) {
      copy[a].resize(numel);  // every element is overwritten: resize, not assign
      into[a] = copy[a];
      out.a[a] = copy[a];
    }
    m.guarded([&] { m.do_read_parameter(i, std::span(into, array_count), {}); });
    return out;
  };
  // A copy this large is worth a thread of its own.
  constexpr std::size_t kPrefetchElements = std::size_t{1} << 18;
  Arrays arrays;
  std::size_t current = n;   // the parameter `arrays` describe
  std::future<Arrays> next;  // parameter current + 1, when being copied out
  const ckpt::ArraySource source = [&](std::size_t i, std::size_t a) -> std::span<const float> {
    if (current != i) {
      if (next.valid() && i == current + 1) {
        arrays = next.get();
      } else {
        if (next.valid()) next.wait();  // (not reached: the writer asks in order)
        next = {};
        arrays = prepare(i, m.guarded([&] { return m.do_host_state(i); }));
      }
      current = i;
      if (i + 1 < n && m.config_.params[i + 1].numel >= kPrefetchElements) {
        const ManagerImpl::HostArrays h = m.guarded([&] { return m.do_host_state(i + 1); });
        if (h.a[0].empty()) {
          try {
            next = std::async(std::launch::async, prepare, i + 1, h);
          } catch (const std::system_error&) {
            // No thread: copied when asked for.
          }
        }
      }
    }
    return arrays.a[a];
  };
  ckpt::save(path, header, source);
}

void GradientManager::load_checkpoint(const std::string& path) {
  ManagerImpl& m = *impl_;
  // A failed manager (not closed) recovers by loading a saved state, in any phase.
  const bool recovering = m.failure_ != nullptr && m.phase_ != CallPhase::closed;
  if (!recovering) m.expect(m.phase_ == CallPhase::idle, "load_checkpoint", "only between steps");
  if (path.empty()) throw Error(Errc::invalid_argument, "path", "empty");
  // The format, sizes and checksums, and every array's values scanned in the same pass.
  const ckpt::File file = ckpt::File::open(path, /*scan_values=*/true);
  const ckpt::Header& h = file.header();
  ckpt::check_compatible(h, header_of(*this, {}), path);
  // Every value before anything changes: states a manager can continue from, and the
  // groups' hyper-parameters as set_hyperparameters would accept them. An array the scan
  // found fault in is checked again here for the error naming the first bad element.
  const std::vector<std::string>& slots = h.slots;  // the manager's (check_compatible)
  const bool counts = m.shape_.counts_steps;
  auto check = [&](std::size_t i, std::size_t a, const std::string& field, bool non_negative,
                   const std::string& where) {
    if (!file.values_clean(i, a))
      detail::check_state_values(file.array(i, a), h.params[i].numel, param_arg(i, field.c_str()),
                                 non_negative, where);
  };
  for (std::size_t i = 0; i < h.params.size(); ++i) {
    const std::string& name = h.params[i].name;
    const std::string where = path + ", parameter '" + name + "': ";
    check(i, 0, "master", false, where);
    for (std::size_t s = 0; s < slots.size(); ++s)
      check(i, 1 + s, slots[s], detail::slot_non_negative(h.optimizer, slots[s]), where);
    const float step = h.params[i].step;
    if (!detail::valid_step_count(step, counts))
      throw Error(Errc::invalid_argument, param_arg(i, "step"),
                  path + ": step counter " + std::to_string(step) + " of '" + name + "' is not " +
                      (counts ? "an integer in [0, 2^24]"
                              : "0 (" + std::string(m.shape_.name) + " counts no steps)"));
  }
  const bool betas = detail::has_betas(m.config_.optimizer);
  for (std::size_t g = 0; g < h.groups.size(); ++g) {
    const std::string prefix = "checkpoint.groups[" + std::to_string(g) + "].";
    detail::with_group_names(prefix, prefix, betas, [&] {
      ParamGroup restored = m.groups_[g];
      restored.lr = h.groups[g].lr;
      restored.weight_decay = h.groups[g].weight_decay;
      detail::validate_config(detail::group_config(m.config_.optimizer, restored));
    });
  }
  if (recovering) {
    try {
      m.do_recover();
    } catch (...) {
      std::rethrow_exception(m.failure_);  // the device cannot continue: still failed
    }
    m.failure_ = nullptr;
    m.phase_ = CallPhase::idle;
  }
  std::vector<std::span<const float>> arrays(h.arrays());
  for (std::size_t i = 0; i < h.params.size(); ++i) {
    for (std::size_t a = 0; a < arrays.size(); ++a) arrays[a] = file.array(i, a);
    m.guarded([&] { m.do_import_parameter(i, arrays, h.params[i].step); });
  }
  for (std::size_t g = 0; g < h.groups.size(); ++g) {
    m.groups_[g].lr = h.groups[g].lr;
    m.groups_[g].weight_decay = h.groups[g].weight_decay;
  }
  ++m.hyper_version_;
}

}  // namespace stepcore
