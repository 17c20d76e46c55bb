// GradientManager::save_checkpoint / load_checkpoint: a manager's optimizer state as one
// rank's checkpoint file (managers/checkpoint_file.hpp, docs/checkpoint.md), in any mode,
// through bounded buffers (managers/checkpoint_buffers.hpp). Saving reads host-resident
// state in place and copies device state a range at a time; loading reads the file twice
// in pieces: a verifying pass (checksums and every value) before anything is imported,
// then an importing pass that checks every block again before it imports it.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "core/validate.hpp"
#include "host/file_reader.hpp"
#include "managers/checkpoint_buffers.hpp"
#include "managers/checkpoint_file.hpp"
#include "managers/manager_impl.hpp"
#include "managers/optimizer.hpp"
#include "managers/testing.hpp"
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
    h.params.push_back({p.name, p.numel, static_cast<std::uint32_t>(p.group),
                        steps.empty() ? 0.0f : steps[i], m.q8_parameter(i)});
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
  const detail::MemoryLedger::Hold held(m.ledger(), "checkpoint", false, ckpt::kSaveBufferBytes);
  const std::size_t n = m.config_.params.size();
  std::vector<float> steps(n);
  m.guarded([&] { m.do_step_counts(steps); });
  const ckpt::Header header = header_of(*this, steps);
  // The writer asks for each array in ranges of kSavePieceBytes, in order. Host-resident
  // state is written in place; device state through a copy of the range, the next range
  // copied out on a helper thread while this one is written (two buffers, used in turn:
  // kSaveBufferBytes with the writer's). The source's spans are valid until it is asked
  // again.
  const std::size_t range = ckpt::kSavePieceBytes / sizeof(float);
  const std::size_t array_count = header.arrays();
  // Array a of parameter i: its elements, and what it holds (the master, a slot's f32 values
  // or 8-bit codes, a slot's block maxima).
  auto shape = [&](std::size_t i, std::size_t a) {
    return ckpt::array_shape(header, header.params[i], static_cast<std::uint32_t>(a));
  };
  auto elements = [&](std::size_t i, std::size_t a) {
    return static_cast<std::size_t>(shape(i, a).elements);
  };
  struct Piece {
    std::size_t i, a, offset, count;
    bool operator==(const Piece&) const = default;
  };
  // The piece the writer asks for after `p` (i == n after the last).
  auto after = [&](const Piece& p) -> Piece {
    const std::size_t numel = elements(p.i, p.a);
    if (p.offset + p.count < numel)
      return {p.i, p.a, p.offset + p.count, std::min(range, numel - p.offset - p.count)};
    if (p.a + 1 < array_count) return {p.i, p.a + 1, 0, std::min(range, elements(p.i, p.a + 1))};
    if (p.i + 1 < n) return {p.i + 1, 0, 0, std::min(range, elements(p.i + 1, 0))};
    return {n, 0, 0, 0};
  };
  std::vector<float> buffers[2];
  // Copies piece p of device state into buffers[b] (an 8-bit slot's codes or maxima as
  // bytes).
  auto copy_out = [&](const Piece& p, std::size_t b) -> std::span<const std::byte> {
    const ckpt::ArrayShape sh = shape(p.i, p.a);
    buffers[b].resize((p.count * sh.width + 3) / 4);
    if (header.params[p.i].q8 && sh.slot >= 0) {
      const std::span<std::byte> out =
          std::as_writable_bytes(std::span<float>(buffers[b])).first(p.count * sh.width);
      m.guarded([&] {
        m.do_read_q8_range(p.i, static_cast<std::size_t>(sh.slot), sh.absmax, p.offset, out);
      });
      return out;
    }
    std::span<float> into[1 + kMaxOptimizerSlots];
    into[p.a] = buffers[b];
    m.guarded([&] { m.do_read_range(p.i, p.offset, std::span(into, 1 + m.state_slots())); });
    return std::as_bytes(std::span<const float>(buffers[b]));
  };
  // Piece [offset, offset + count) of array a of parameter i in host memory `h`.
  auto host_piece = [&](const ManagerImpl::HostArrays& h, std::size_t i, std::size_t a,
                        std::size_t offset, std::size_t count) -> std::span<const std::byte> {
    const ckpt::ArrayShape sh = shape(i, a);
    if (sh.slot < 0) return std::as_bytes(h.a[0].subspan(offset, count));
    const auto s = static_cast<std::size_t>(sh.slot);
    if (sh.absmax) return std::as_bytes(h.q8[s].absmax.subspan(offset, count));
    if (header.params[i].q8) return std::as_bytes(h.q8[s].codes.subspan(offset, count));
    return std::as_bytes(h.a[1 + s].subspan(offset, count));
  };
  // A copy this large is worth a thread of its own.
  constexpr std::size_t kPrefetchElements = std::size_t{1} << 18;
  std::size_t host_of = n;  // the parameter `host` describes
  ManagerImpl::HostArrays host;
  auto host_state = [&](std::size_t i) -> const ManagerImpl::HostArrays& {
    if (host_of != i) {
      host = m.guarded([&] { return m.do_host_state(i); });
      host_of = i;
    }
    return host;
  };
  std::size_t current = 0;  // the buffer holding the piece last returned
  Piece ahead{n, 0, 0, 0};  // the piece being copied out into buffers[1 - current]
  std::future<std::span<const std::byte>> next;
  const ckpt::RangeSource source = [&](std::size_t i, std::size_t a, std::size_t offset,
                                       std::size_t count) -> std::span<const std::byte> {
    if (count == 0) return {};
    if (!host_state(i).a[0].empty()) return host_piece(host, i, a, offset, count);
    const Piece p{i, a, offset, count};
    std::span<const std::byte> out;
    if (next.valid() && ahead == p) {
      out = next.get();
      current = 1 - current;
    } else {
      if (next.valid()) next.wait();  // (not reached: the writer asks in order)
      next = {};
      out = copy_out(p, current);
    }
    const Piece q = after(p);
    if (q.i < n && q.count >= kPrefetchElements && host_state(q.i).a[0].empty()) {
      try {
        next = std::async(std::launch::async, copy_out, q, 1 - current);
        ahead = q;
      } catch (const std::system_error&) {
        // No thread: copied when asked for.
      }
    }
    return out;
  };
  ckpt::save(path, header, source, range);
}

namespace detail::checkpoint::testing {

namespace {
thread_local std::function<void(const std::string&)> tl_between_passes;
}  // namespace

ScopedBetweenPassesHook::ScopedBetweenPassesHook(std::function<void(const std::string&)> between)
    : saved_(std::move(tl_between_passes)) {
  tl_between_passes = std::move(between);
}

ScopedBetweenPassesHook::~ScopedBetweenPassesHook() { tl_between_passes = std::move(saved_); }

}  // namespace detail::checkpoint::testing

void GradientManager::load_checkpoint(const std::string& path) {
  ManagerImpl& m = *impl_;
  // A failed manager (not closed) recovers by loading a saved state, in any phase.
  const bool recovering = m.failure_ != nullptr && m.phase_ != CallPhase::closed;
  if (!recovering) m.expect(m.phase_ == CallPhase::idle, "load_checkpoint", "only between steps");
  if (path.empty()) throw Error(Errc::invalid_argument, "path", "empty");
  const detail::MemoryLedger::Hold held(m.ledger(), "checkpoint", false, ckpt::kLoadBufferBytes);
  // The verifying pass: the format, sizes and checksums, every array's values scanned,
  // each block's checksum recorded.
  const detail::FileReader reader(path);  // io_error: cannot open, not a regular file
  const ckpt::ByteSource file = ckpt::source_of(reader);
  const ckpt::Verified verified = ckpt::verify(file, path);
  const ckpt::Header& h = verified.parsed.header;
  ckpt::check_compatible(h, header_of(*this, {}), path);
  // Every value before anything changes: states a manager can continue from, and the
  // groups' hyper-parameters as set_hyperparameters would accept them.
  const bool counts = m.shape_.counts_steps;
  const std::size_t arrays = h.arrays();
  for (std::size_t i = 0; i < h.params.size(); ++i) {
    const std::string& name = h.params[i].name;
    for (std::size_t a = 0; a < arrays; ++a) {
      const std::size_t k = i * arrays + a;
      if (verified.first_bad[k] != ckpt::Verified::kClean)
        detail::throw_bad_state_value(
            param_arg(i, ckpt::array_name(h, h.params[i], static_cast<std::uint32_t>(a)).c_str()),
            path + ", parameter '" + name + "': ", static_cast<std::size_t>(verified.first_bad[k]),
            verified.first_bad_value[k]);
    }
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
  if (ckpt::testing::tl_between_passes) ckpt::testing::tl_between_passes(path);
  if (recovering) {
    try {
      m.do_recover();
    } catch (...) {
      std::rethrow_exception(m.failure_);  // the device cannot continue: still failed
    }
    m.failure_ = nullptr;
    m.phase_ = CallPhase::idle;
  }
  // The importing pass: every block checked again before its values are imported. A
  // file that changed since the verifying pass leaves some parameters imported and
  // others not: the manager is failed (every later call raises the error) until a load
  // recovers it.
  // Each range is imported as it comes (do_import_range), or, in a mode without ranges,
  // each parameter gathered whole (do_import_parameter); a parameter's step counter
  // applies with its last range.
  const bool ranges = m.do_imports_ranges();
  std::vector<std::uint64_t> remaining(h.params.size());  // elements still to come
  std::map<std::size_t, std::vector<std::vector<float>>> gathered;
  // (Modes without ranges keep no 8-bit state: check_compatible refused such a file.)
  auto import_whole = [&](std::size_t i, const std::vector<std::vector<float>>& whole) {
    std::span<const float> in[1 + kMaxOptimizerSlots];
    for (std::size_t a = 0; a < whole.size(); ++a) in[a] = whole[a];
    m.do_import_parameter(i, std::span(in, 1 + m.state_slots()), {}, h.params[i].step);
  };
  auto take = [&](std::size_t i, std::size_t a, std::uint64_t offset,
                  std::span<const std::byte> bytes) {
    const ckpt::ArrayShape shape = ckpt::array_shape(h, h.params[i], static_cast<std::uint32_t>(a));
    remaining[i] -= bytes.size() / shape.width;
    const bool last = remaining[i] == 0;
    if (h.params[i].q8 && shape.slot >= 0) {  // an 8-bit slot's codes or maxima (mode full)
      m.do_import_q8_range(i, static_cast<std::size_t>(shape.slot), shape.absmax,
                           static_cast<std::size_t>(offset), bytes);
      if (last) {  // the step counter, once every array is in
        const std::span<const float> none[1 + kMaxOptimizerSlots];
        m.do_import_range(i, 0, std::span(none, 1 + m.state_slots()), h.params[i].step, true);
      }
      return;
    }
    const std::span<const float> values(reinterpret_cast<const float*>(bytes.data()),
                                        bytes.size() / sizeof(float));
    if (ranges) {
      std::span<const float> in[1 + kMaxOptimizerSlots];
      in[a] = values;
      m.do_import_range(i, static_cast<std::size_t>(offset), std::span(in, 1 + m.state_slots()),
                        h.params[i].step, last);
      return;
    }
    std::vector<std::vector<float>>& whole = gathered[i];
    whole.resize(1 + m.state_slots());
    whole[a].resize(static_cast<std::size_t>(h.params[i].numel));
    std::copy(values.begin(), values.end(), whole[a].begin() + static_cast<std::ptrdiff_t>(offset));
    if (last) {
      import_whole(i, whole);
      gathered.erase(i);
    }
  };
  try {
    for (std::size_t i = 0; i < h.params.size(); ++i) {
      remaining[i] = 0;
      for (std::uint32_t a = 0; a < arrays; ++a)
        remaining[i] += ckpt::array_shape(h, h.params[i], a).elements;
      if (remaining[i] != 0) continue;
      // No elements: the step counter alone.
      if (ranges) {
        const std::span<const float> none[1 + kMaxOptimizerSlots];
        m.do_import_range(i, 0, std::span(none, 1 + m.state_slots()), h.params[i].step, true);
      } else {
        import_whole(i, std::vector<std::vector<float>>(1 + m.state_slots()));
      }
    }
    ckpt::import_pass(file, verified, path, take);
  } catch (...) {
    m.failure_ = std::current_exception();
    throw;
  }
  for (std::size_t g = 0; g < h.groups.size(); ++g) {
    m.groups_[g].lr = h.groups[g].lr;
    m.groups_[g].weight_decay = h.groups[g].weight_decay;
  }
  ++m.hyper_version_;
}

}  // namespace stepcore
