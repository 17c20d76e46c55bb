// A synthetic model and gradient stream for the gradient managers' differential tests
// and stepcore-demo: deterministic gradients per (seed, step, micro-batch, parameter), an
// SFT-like flow (fixed micro-batches, scale 1 / tokens known before the step) and an
// RL-like one (varying micro-batch counts and scales, parameters without gradients in
// some micro-batches), and a driver that runs any manager over it and records every
// observable result after every step.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "stepcore/convert.hpp"
#include "stepcore/device.hpp"
#include "stepcore/managers.hpp"

namespace stepcore::testing {

/// How a step's micro-batches come: SFT (3, every parameter in each), RL (1 to 4, some
/// parameters without a gradient), RL with one micro-batch per step.
enum class Flow : std::uint8_t { sft, rl, rl_single };

/// One parameter shard of the synthetic model.
struct StreamParam {
  std::size_t numel;
  DType grad_dtype;
};

/// Returns the element sizes of the test model (an empty parameter in the middle, the
/// boundary sizes, and one larger than a small chunk).
inline std::vector<StreamParam> stream_model(DType grad_dtype) {
  const std::size_t sizes[] = {33, 1, 0, 1025, 4097, 127, 20000, 5};
  std::vector<StreamParam> out;
  for (std::size_t n : sizes) out.push_back({n, grad_dtype});
  return out;
}

/// The schedule of one step: micro-batch count, scale, which parameters get a gradient.
struct StepPlan {
  int micro_batches = 3;
  float scale = 1.0f;
  /// has_grad[m][i]: parameter i receives a gradient in micro-batch m.
  std::vector<std::vector<bool>> has_grad;
};

/// Returns the plan of step `step` for `params` parameters.
inline StepPlan plan_step(Flow flow, int step, std::size_t params, std::uint32_t seed) {
  StepPlan p;
  std::mt19937 rng(seed * 7919u + static_cast<std::uint32_t>(step));
  if (flow == Flow::sft) {
    p.micro_batches = 3;
    p.scale = 1.0f / static_cast<float>(1000 + 37 * step);  // 1 / loss tokens
  } else {
    const int drawn = 1 + static_cast<int>(rng() % 4);
    p.micro_batches = flow == Flow::rl_single ? 1 : drawn;
    p.scale = 1.0f / static_cast<float>(1 + rng() % 5000);
  }
  p.has_grad.assign(static_cast<std::size_t>(p.micro_batches), std::vector<bool>(params, true));
  if (flow != Flow::sft)
    for (auto& row : p.has_grad)
      for (std::size_t i = 0; i < params; ++i) row[i] = rng() % 5 != 0;
  return p;
}

/// Returns the splitmix64 finaliser of x (a bijective 64-bit mix).
inline std::uint64_t stream_mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Returns the gradient value of element j (of the whole parameter) of parameter i in
/// (step, micro): uniform in (-magnitude, magnitude) times 2^-e, e in [0, 8), so values
/// span several binades. Counter-based: the same on every shard and thread.
inline float gradient_value(std::uint32_t seed, int step, int micro, std::size_t i, std::size_t j,
                            float magnitude = 1.0f) {
  const std::uint64_t key =
      stream_mix(stream_mix(stream_mix(seed) ^ static_cast<std::uint64_t>(step)) ^
                 (static_cast<std::uint64_t>(micro) << 32 | i));
  const std::uint64_t r = stream_mix(key ^ j);
  const float u = static_cast<float>(r >> 40) * 0x1p-24f;  // [0, 1), exact
  const int e = static_cast<int>((r >> 8) & 7);
  return (2.0f * u - 1.0f) * std::ldexp(magnitude, -e);
}

/// Writes the gradient of (step, micro, param i) as `dtype` into `out` (numel elements);
/// element j of parameter i is the same value whatever shard holds it (`offset` is the
/// shard's first element).
inline void make_gradient(std::uint32_t seed, int step, int micro, std::size_t i,
                          std::size_t offset, std::size_t numel, DType dtype, void* out,
                          float magnitude = 1.0f) {
  for (std::size_t k = 0; k < numel; ++k) {
    const float x = gradient_value(seed, step, micro, i, offset + k, magnitude);
    switch (dtype) {
      case DType::f32:
        std::memcpy(static_cast<char*>(out) + 4 * k, &x, 4);
        break;
      case DType::bf16: {
        const std::uint16_t h = f32_to_bf16_bits(x);
        std::memcpy(static_cast<char*>(out) + 2 * k, &h, 2);
        break;
      }
      case DType::f16: {
        const std::uint16_t h = f32_to_f16_bits(x);
        std::memcpy(static_cast<char*>(out) + 2 * k, &h, 2);
        break;
      }
    }
  }
}

/// Returns the initial master weight of element j of parameter i (deterministic).
inline float initial_master(std::size_t i, std::size_t j) {
  return 0.05f * gradient_value(0xC0FFEEu, -1, 0, i, j);
}

/// Everything observable after one step.
struct StepRecord {
  std::uint32_t norm_bits = 0;   ///< clip_grad_norm's result (0 when not clipped)
  std::uint32_t scale_bits = 0;  ///< effective_gradient_scale()
  bool skipped = false;
  /// Overlapped steps: chunks speculated, committed and rolled back (report()).
  std::size_t speculated = 0, committed = 0, rolled_back = 0;
  /// Per parameter: its master|state slots (in the optimizer's order)|compute bytes.
  std::vector<std::vector<std::uint8_t>> state;
  std::vector<float> steps;  ///< per parameter: step_count(i)
  /// report(): the norm, the clip coefficient and stepped (what the records above do not
  /// already hold; compared by the tests that ask for them).
  std::uint32_t report_norm_bits = 0, clip_bits = 0;
  bool stepped = false;
};

/// How to run the stream.
/// A gradient generator: (step, micro, param i, offset, numel, dtype, out).
using GradientFill =
    std::function<void(int, int, std::size_t, std::size_t, std::size_t, DType, void*)>;

struct StreamOptions {
  Flow flow = Flow::sft;
  int steps = 3;
  std::optional<float> max_norm;
  /// When set: clip_grad_norm(*max_norm_of(step)) in the steps where it has a value (the
  /// others do not clip); overrides max_norm.
  std::function<std::optional<float>(int step)> max_norm_of;
  bool overlap = false;
  std::uint32_t seed = 1;
  float magnitude = 1.0f;
  /// (step, micro, param) that gets a NaN, if any.
  std::optional<std::tuple<int, int, std::size_t>> poison;
  /// More (step, micro, param) that get a NaN, like `poison` (its first element of this
  /// rank's shard, when the shard is not empty).
  std::vector<std::tuple<int, int, std::size_t>> poisons;
  /// Shard of each parameter this rank holds: [first, first + numel) of the full one.
  std::vector<std::size_t> shard_offset;
  /// The stream's step numbers run from first_step (a resumed run continues the stream).
  int first_step = 0;
  /// When set: before each step, every group's lr and weight decay (a schedule).
  std::function<StepHyper(int step, std::size_t group)> schedule;
  /// true: gradients go in buffers of the driver's own (device memory of `dev`), handed
  /// over with gradient_ready(i, grad); each is overwritten with NaN as soon as
  /// gradient_released(i) is complete, so a manager still reading it would be caught.
  bool caller_gradients = false;
  /// When set: the `written` event gradient_ready gets for (step, micro, param) (e.g. an
  /// event that never completes, for the managers' bounded waits); else none.
  std::function<device::Event(int step, int micro, std::size_t param)> written;
  /// When set: writes the gradient of (step, micro, param i) as make_gradient does (same
  /// arguments but the seed and magnitude) instead of make_gradient.
  GradientFill fill;
  /// When set: begin_step's gradient scale in each step instead of the flow plan's.
  std::function<float(int step)> scale;
};

/// Runs `opts.steps` steps of the stream through `m` (parameters already loaded) and
/// returns the records. Gradients are written into the manager's device buffers
/// through `dev` (a copy on the compute queue, the order a backward kernel would use).
inline std::vector<StepRecord> run_stream(GradientManager& m, device::Device& dev,
                                          const StreamOptions& opts) {
  const auto& params = m.config().params;
  std::vector<StepRecord> out;
  std::vector<std::uint8_t> host;
  // The driver's own gradient buffers (caller_gradients), one per parameter, and a NaN
  // pattern to poison them with once the manager has released them.
  struct Owned {
    void* data = nullptr;
    std::size_t bytes = 0;
  };
  std::vector<Owned> owned(opts.caller_gradients ? params.size() : 0);
  struct Free {
    device::Device& dev;
    std::vector<Owned>& owned;
    ~Free() {
      for (Owned& o : owned)
        if (o.data != nullptr) dev.deallocate(o.data);
    }
  } free_owned{dev, owned};
  for (std::size_t i = 0; i < owned.size(); ++i) {
    owned[i].bytes = params[i].numel * dtype_size(params[i].grad_dtype);
    owned[i].data = dev.allocate(std::max<std::size_t>(owned[i].bytes, 1));
  }
  const std::vector<std::uint8_t> poison_bytes(
      [&] {
        std::size_t b = 0;
        for (const Owned& o : owned) b = std::max(b, o.bytes);
        return b;
      }(),
      0xFF);  // all-ones: a NaN in f32, bf16 and f16
  // Released: the manager must not read the caller's buffer again; poison it at once.
  // First, it must hold what was written (the manager never writes a caller's gradient).
  auto release = [&](std::size_t i, const TensorView& g, const std::vector<std::uint8_t>& host) {
    dev.synchronize(m.gradient_released(i));
    if (g.numel) {
      std::vector<std::uint8_t> back(g.bytes());
      dev.copy(device::Queue::compute, back.data(), g.data, g.bytes());
      dev.synchronize(dev.record(device::Queue::compute));
      if (std::memcmp(back.data(), host.data(), g.bytes()) != 0)
        throw std::logic_error("the manager wrote the caller's gradient of parameter " +
                               std::to_string(i));
    }
    if (g.numel) {
      dev.copy(device::Queue::compute, g.data, poison_bytes.data(), g.bytes());
      dev.synchronize(dev.record(device::Queue::compute));
    }
  };
  std::vector<std::pair<std::size_t, std::vector<std::uint8_t>>> held;  // released by step()
  for (int s = opts.first_step; s < opts.first_step + opts.steps; ++s) {
    StepPlan plan = plan_step(opts.flow, s, params.size(), opts.seed);
    if (opts.scale) plan.scale = opts.scale(s);
    if (opts.schedule)
      for (std::size_t g = 0; g < m.group_count(); ++g)
        m.set_hyperparameters(g, opts.schedule(s, g));
    m.begin_step(plan.scale, opts.overlap);
    for (int mb = 0; mb < plan.micro_batches; ++mb) {
      m.begin_backward(mb + 1 == plan.micro_batches);
      // Backward runs from the last parameter to the first.
      for (std::size_t i = params.size(); i-- > 0;) {
        if (!plan.has_grad[static_cast<std::size_t>(mb)][i]) continue;
        const TensorView g = opts.caller_gradients
                                 ? TensorView{owned[i].data, params[i].numel, params[i].grad_dtype}
                                 : m.gradient(i);
        if (opts.caller_gradients)  // the previous read of this buffer must be over
          dev.synchronize(m.gradient_released(i));
        host.assign(g.bytes() + 1, 0);
        const std::size_t off = opts.shard_offset.empty() ? 0 : opts.shard_offset[i];
        if (opts.fill)
          opts.fill(s, mb, i, off, g.numel, g.dtype, host.data());
        else
          make_gradient(opts.seed, s, mb, i, off, g.numel, g.dtype, host.data(), opts.magnitude);
        const std::tuple<int, int, std::size_t> here{s, mb, i};
        const bool poisoned =
            (opts.poison && *opts.poison == here) ||
            std::find(opts.poisons.begin(), opts.poisons.end(), here) != opts.poisons.end();
        if (poisoned && g.numel > 0) {
          const float nan = std::numeric_limits<float>::quiet_NaN();
          if (g.dtype == DType::f32)
            std::memcpy(host.data(), &nan, 4);
          else {
            const std::uint16_t h = 0x7FC0;  // NaN in bf16; also a NaN pattern in f16
            std::memcpy(host.data(), &h, 2);
          }
        }
        if (g.numel) {
          dev.copy(device::Queue::compute, g.data, host.data(), g.bytes());
          dev.synchronize(dev.record(device::Queue::compute));  // host buffer is reused
        }
        const device::Event written = opts.written ? opts.written(s, mb, i) : device::Event{};
        if (!opts.caller_gradients) {
          m.gradient_ready(i, written);
          continue;
        }
        m.gradient_ready(i, ConstTensorView(g), written);
        if (m.gradients_read_by_step()) {  // released by step(): checked and poisoned then
          held.push_back({i, host});
          continue;
        }
        release(i, g, host);
      }
      m.finish_backward();
    }
    StepRecord r;
    const std::optional<float> max_norm = opts.max_norm_of ? opts.max_norm_of(s) : opts.max_norm;
    if (max_norm) r.norm_bits = std::bit_cast<std::uint32_t>(m.clip_grad_norm(*max_norm));
    r.scale_bits = std::bit_cast<std::uint32_t>(m.effective_gradient_scale());
    m.step();
    for (const auto& [i, written_bytes] : held)
      release(i, TensorView{owned[i].data, params[i].numel, params[i].grad_dtype}, written_bytes);
    held.clear();
    const StepReport rep = m.report();
    r.skipped = rep.skipped;
    r.speculated = rep.chunks_speculated;
    r.committed = rep.chunks_committed;
    r.rolled_back = rep.chunks_rolled_back;
    r.report_norm_bits = std::bit_cast<std::uint32_t>(rep.norm.norm);
    r.clip_bits = std::bit_cast<std::uint32_t>(rep.clip_coefficient);
    r.stepped = rep.stepped;
    const std::vector<std::string_view>& slots = m.state_slot_names();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const ParamSpec& p = params[i];
      // master, then each state slot in the optimizer's order (an 8-bit one's codes, then
      // its block maxima), then the compute bytes.
      const bool q8 = m.q8_parameter(i);
      std::vector<std::vector<float>> arrays(1 + slots.size(), std::vector<float>(p.numel));
      std::vector<std::vector<std::uint8_t>> codes(slots.size());
      std::vector<std::vector<float>> absmax(slots.size());
      std::vector<SlotOut> named;
      for (std::size_t s = 0; s < slots.size(); ++s) {
        if (!q8) {
          named.push_back({slots[s], arrays[1 + s]});
          continue;
        }
        arrays[1 + s].clear();
        codes[s].resize(p.numel);
        absmax[s].resize((p.numel + kQ8BlockSize - 1) / kQ8BlockSize);
        named.push_back({slots[s], {}, codes[s], absmax[s]});
      }
      std::vector<std::uint8_t> compute(
          p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0);
      m.read_parameter(i, arrays[0], named, compute);
      std::vector<std::uint8_t> bytes;
      auto append = [&](const void* d, std::size_t b) {
        const auto* c8 = static_cast<const std::uint8_t*>(d);
        bytes.insert(bytes.end(), c8, c8 + b);
      };
      append(arrays[0].data(), arrays[0].size() * 4);
      for (std::size_t s = 0; s < slots.size(); ++s) {
        append(arrays[1 + s].data(), arrays[1 + s].size() * 4);
        append(codes[s].data(), codes[s].size());
        append(absmax[s].data(), absmax[s].size() * 4);
      }
      append(compute.data(), compute.size());
      r.state.push_back(std::move(bytes));
      r.steps.push_back(m.step_count(i));
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace stepcore::testing
