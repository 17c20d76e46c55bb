// The one independent expectation of the gradient managers' contract (docs/managers.md),
// built from stepcore::reference alone, for every manager test (host device, CUDA, MPI):
// a model (whole, unsharded ParamSpecs), an optimizer, a gradient stream and the
// trainer's calls go in; what the trainer can observe after loading and after every
// step comes out: the report, the effective gradient scale, and every parameter's
// master weights, moments and compute weights. Each test drives its managers with the
// same stream and compares bits (its shards against slices of the whole).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "stepcore/convert.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/reference.hpp"
#include "stepcore/tensor.hpp"

namespace manager_model {

using namespace stepcore;

/// One parameter's state: master, the optimizer's state slots in its order (none for
/// SignSGD), compute weights (bytes in compute_dtype; empty without compute weights).
struct ParamState {
  std::vector<float> master;
  std::vector<std::vector<float>> slots;  ///< f32 slots (empty vectors for 8-bit ones)
  /// 8-bit slots (Setup::q8): per slot its codes and block maxima (none for f32 slots).
  std::vector<std::vector<std::uint8_t>> codes;
  std::vector<std::vector<float>> absmax;
  std::vector<std::uint8_t> compute;
  bool operator==(const ParamState& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() &&
             (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
    };
    if (slots.size() != o.slots.size() || codes.size() != o.codes.size()) return false;
    for (std::size_t s = 0; s < slots.size(); ++s)
      if (!same(slots[s], o.slots[s])) return false;
    for (std::size_t s = 0; s < codes.size(); ++s)
      if (!same(codes[s], o.codes[s]) || !same(absmax[s], o.absmax[s])) return false;
    return same(master, o.master) && same(compute, o.compute);
  }
  /// Returns elements [off, off + n) of every array (compute: `compute_size` bytes each).
  ParamState slice(std::size_t off, std::size_t n, std::size_t compute_size) const {
    ParamState s;
    auto cut = [&](const std::vector<float>& v) {
      return v.empty() ? v : std::vector<float>(v.begin() + off, v.begin() + off + n);
    };
    s.master = cut(master);
    for (const auto& v : slots) s.slots.push_back(cut(v));
    if (!compute.empty())
      s.compute.assign(compute.begin() + off * compute_size,
                       compute.begin() + (off + n) * compute_size);
    return s;
  }
};

/// The optimizer's state slots as docs/numerics.md names them for this configuration, and
/// the value each starts from (torch's initial state: Adagrad's sum holds
/// f32(initial_accumulator_value), everything else +0), written out per optimizer.
inline std::vector<float> initial_slots(const OptimizerConfig& c) {
  if (const auto* a = std::get_if<AdamWConfig>(&c)) return std::vector<float>(a->amsgrad ? 3 : 2);
  if (const auto* a = std::get_if<AdamConfig>(&c)) return std::vector<float>(a->amsgrad ? 3 : 2);
  if (const auto* a = std::get_if<SgdConfig>(&c)) return std::vector<float>(a->momentum != 0.0);
  if (const auto* a = std::get_if<AdagradConfig>(&c))
    return {static_cast<float>(a->initial_accumulator_value)};
  if (std::holds_alternative<LionConfig>(c)) return {0.0f};  // exp_avg
  return {};                                                 // SignSGD
}

/// True for the optimizers whose update reads the gradient's scale and clip (all but
/// SignSGD, which takes the sign of the raw accumulator).
inline bool reads_scaled(const OptimizerConfig& c) {
  return !std::holds_alternative<SignSgdConfig>(c);
}

/// True for the optimizers with a step counter per tensor (all but SignSGD and Lion).
inline bool counts_steps(const OptimizerConfig& c) {
  return !std::holds_alternative<SignSgdConfig>(c) && !std::holds_alternative<LionConfig>(c);
}

/// One reference step of the optimizer `c` configures over `t`.
inline void reference_step(std::span<const OptimizerTensor> t, const OptimizerConfig& c,
                           GradientRead read) {
  reference::optimizer_step(t, c, read);
}

/// Returns `c` with a group's hyper-parameters: lr and weight decay, and for the
/// optimizers with betas (AdamW, Adam) the betas and eps.
inline OptimizerConfig with_group(OptimizerConfig c, const ParamGroup& g) {
  std::visit(
      [&](auto& x) {
        x.lr = g.lr;
        x.weight_decay = g.weight_decay;
        using C = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<C, AdamWConfig> || std::is_same_v<C, AdamConfig>) {
          x.beta1 = g.beta1;
          x.beta2 = g.beta2;
          x.eps = g.eps;
        }
      },
      c);
  return c;
}

/// The gradient stream a test's trainer runs, over the whole model.
struct Stream {
  int steps = 3;
  std::function<float(int step)> scale;  ///< begin_step's gradient scale
  std::function<int(int step)> micro_batches;
  /// Whether parameter i receives a gradient in (step, micro).
  std::function<bool(int step, int micro, std::size_t i)> has_gradient;
  /// Parameter i's whole gradient in (step, micro): numel elements of its grad_dtype.
  std::function<std::vector<std::uint8_t>(int step, int micro, std::size_t i)> gradient;
  /// The master weight load_parameter sets for element j of parameter i.
  std::function<float(std::size_t i, std::size_t j)> initial_master;
};

/// Returns a stream of `steps` steps with `micro` micro-batches each.
inline Stream fixed_stream(int steps, int micro, std::function<float(int)> scale,
                           std::function<bool(int, int, std::size_t)> has_gradient,
                           std::function<std::vector<std::uint8_t>(int, int, std::size_t)> gradient,
                           std::function<float(std::size_t, std::size_t)> initial_master) {
  return {steps,
          std::move(scale),
          [micro](int) { return micro; },
          std::move(has_gradient),
          std::move(gradient),
          std::move(initial_master)};
}

/// The managers' configuration, as far as the results depend on it.
struct Setup {
  std::vector<ParamSpec> params;  ///< the whole model
  OptimizerConfig optimizer;      ///< its lr, weight decay (betas, eps) when there are no groups
  std::size_t chunk_elements = 0;
  std::optional<float> max_norm;  ///< clip_grad_norm(*max_norm) in every step
  bool overlap = false;           ///< begin_step(scale, overlap)
  /// Overlapped steps: the policy (every chunk fits the budget). Only the report's
  /// speculation counts depend on it, never a bit.
  Speculation speculation = Speculation::automatic;
  std::vector<ParamGroup> groups;  ///< ManagerConfig::groups (empty: the optimizer's values)
  /// When set: group g's lr and weight decay in step s (set_hyperparameters before it).
  std::function<StepHyper(int step, std::size_t group)> schedule;
  /// When set: per parameter, the first elements of the tensors the optimizer is given
  /// (a sharded run's shard offsets, ascending from 0): each is updated as a tensor of its
  /// own, as the ranks do. Only the torch formulas with a tail form can tell (it falls on
  /// each tensor's last numel mod W elements); the norm stays the whole model's.
  std::vector<std::vector<std::size_t>> segments;
  /// When set: clip_grad_norm(*max_norm_of(step)) in the steps where it has a value (the
  /// others do not clip); overrides max_norm.
  std::function<std::optional<float>(int step)> max_norm_of;
  /// ManagerConfig::q8_state and min_8bit_size: a parameter of at least that many elements
  /// keeps 8-bit slots (docs/numerics.md 8f), starting from the code of +0 and maximum 0.
  bool q8 = false;
  std::size_t min_8bit_size = 4096;
};

/// What the trainer observes after one step.
struct Step {
  StepReport report;             ///< report(); norm (also clip_grad_norm's result), clip, counts
  float effective_scale = 1.0f;  ///< effective_gradient_scale()
  std::vector<ParamState> state;
  std::vector<float> steps;  ///< per parameter: the step counter (0 for SignSGD)
};

struct Run {
  std::vector<ParamState> loaded;  ///< after load_parameter
  std::vector<Step> steps;
};

/// Returns `master` rounded to `dtype` (the compute weights of a master), as bytes.
inline std::vector<std::uint8_t> rounded(const std::vector<float>& master, DType dtype) {
  std::vector<std::uint8_t> out(master.size() * dtype_size(dtype));
  for (std::size_t j = 0; j < master.size(); ++j) {
    if (dtype == DType::f32) {
      std::memcpy(out.data() + 4 * j, &master[j], 4);
    } else {
      const std::uint16_t h =
          dtype == DType::bf16 ? f32_to_bf16_bits(master[j]) : f32_to_f16_bits(master[j]);
      std::memcpy(out.data() + 2 * j, &h, 2);
    }
  }
  return out;
}

/// Returns the chunks of docs/managers.md: consecutive parameters, never split, up to
/// `chunk_elements` elements (a larger parameter alone), as [first, last) ranges.
inline std::vector<std::pair<std::size_t, std::size_t>> chunks_of(
    const std::vector<ParamSpec>& params, std::size_t chunk_elements) {
  std::vector<std::pair<std::size_t, std::size_t>> chunks;
  std::size_t elements = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (chunks.empty() || (elements != 0 && elements + params[i].numel > chunk_elements)) {
      chunks.push_back({i, i});
      elements = 0;
    }
    chunks.back().second = i + 1;
    elements += params[i].numel;
  }
  return chunks;
}

/// Runs the stream through the contract with stepcore::reference: accumulate (copy, then
/// add), zero for parameters without a gradient in the step, then without overlap the
/// norm of the counted parameters' R(acc * s), clip = clip_coefficient(norm, max_norm)
/// (0 for a non-finite norm, 1 without clipping), found-inf skips the whole step, and
/// each parameter's update reads R(R(acc * s) * clip) with its group's hyper-parameters
/// (the schedule's lr and weight decay in that step). Overlap changes no bit: it changes
/// only the report's counts (every chunk speculated in a step the policy speculates in,
/// committed when the step is finite and its coefficient 1 (SignSGD: any coefficient),
/// else rolled back).
inline Run run(const Setup& setup, const Stream& stream) {
  const std::vector<ParamSpec>& params = setup.params;
  const std::size_t n = params.size();
  const std::vector<float> initial = initial_slots(setup.optimizer);
  std::vector<ParamState> st(n);
  std::vector<std::vector<float>> acc(n);
  std::vector<float> steps(n, 0.0f);
  const OptimizerInfo& info = optimizer_table()[setup.optimizer.index()];
  auto is_q8 = [&](std::size_t i) {
    return setup.q8 && !initial.empty() && params[i].numel >= setup.min_8bit_size;
  };
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t numel = params[i].numel;
    st[i].master.resize(numel);
    for (std::size_t j = 0; j < numel; ++j) st[i].master[j] = stream.initial_master(i, j);
    if (is_q8(i)) {  // 0 in 8 bits: the code whose map value is +0, maximum 0
      for (std::size_t s = 0; s < initial.size(); ++s) {
        const std::span<const float, 256> map = q8_map(info.slots[s].non_negative);
        std::size_t zero = 0;
        while (std::bit_cast<std::uint32_t>(map[zero]) != 0u) ++zero;
        st[i].slots.emplace_back();
        st[i].codes.emplace_back(numel, static_cast<std::uint8_t>(zero));
        st[i].absmax.emplace_back((numel + kQ8BlockSize - 1) / kQ8BlockSize, 0.0f);
      }
    } else {
      for (float v : initial) st[i].slots.emplace_back(numel, v);
    }
    if (params[i].has_compute_weights)
      st[i].compute = rounded(st[i].master, params[i].compute_dtype);
    acc[i].assign(numel, 0.0f);
  }
  const auto chunks = chunks_of(params, setup.chunk_elements);
  int step_now = 0;
  // Parameter i's configuration in the current step: its group's hyper-parameters (or the
  // optimizer's), with the schedule's lr and weight decay.
  auto config_of = [&](std::size_t i) {
    ParamGroup g;
    if (setup.groups.empty()) {
      std::visit(
          [&](const auto& x) {
            g.lr = x.lr;
            g.weight_decay = x.weight_decay;
            using C = std::decay_t<decltype(x)>;
            if constexpr (std::is_same_v<C, AdamWConfig> || std::is_same_v<C, AdamConfig>) {
              g.beta1 = x.beta1;
              g.beta2 = x.beta2;
              g.eps = x.eps;
            }
          },
          setup.optimizer);
    } else {
      g = setup.groups[params[i].group];
    }
    if (setup.schedule) {
      const StepHyper h = setup.schedule(step_now, params[i].group);
      g.lr = h.lr;
      g.weight_decay = h.weight_decay;
    }
    return with_group(setup.optimizer, g);
  };
  auto update = [&](std::size_t first, std::size_t last, GradientRead read) {
    for (std::size_t i = first; i < last; ++i) {
      const std::size_t numel = params[i].numel;
      const TensorView compute =
          params[i].has_compute_weights
              ? TensorView{st[i].compute.data(), numel, params[i].compute_dtype}
              : TensorView{};
      const OptimizerConfig c = config_of(i);
      const std::vector<std::size_t> whole{0};
      const std::vector<std::size_t>& starts = setup.segments.empty() ? whole : setup.segments[i];
      const float before = steps[i];
      for (std::size_t k = 0; k < starts.size(); ++k) {
        const std::size_t off = starts[k];
        const std::size_t len = (k + 1 < starts.size() ? starts[k + 1] : numel) - off;
        const std::size_t cs = compute.numel != 0 ? dtype_size(compute.dtype) : 0;
        float counter = before;  // every shard's counter steps alike
        OptimizerTensor t{f32_view(st[i].master.data() + off, len)};
        for (std::size_t s = 0; s < st[i].slots.size(); ++s)
          t.state[s] = f32_view(st[i].slots[s].data() + off, len);
        for (std::size_t s = 0; s < st[i].codes.size(); ++s) {  // 8-bit: whole tensors only
          t.state[s] = {};
          t.q8[s] = {st[i].codes[s].data(), st[i].absmax[s].data()};
        }
        if (counts_steps(c)) t.step = &counter;
        t.grad = const_view(acc[i].data() + off, len);
        if (compute.numel != 0)
          t.compute_param =
              TensorView{static_cast<std::uint8_t*>(compute.data) + off * cs, len, compute.dtype};
        reference_step(std::span(&t, 1), c, read);
        steps[i] = counter;
      }
    }
  };
  auto norm = [&](std::size_t first, std::size_t last, float scale, bool counted_only) {
    std::vector<ConstTensorView> views;
    for (std::size_t i = first; i < last; ++i)
      if (!counted_only || params[i].counts_toward_norm)
        views.push_back(const_view(acc[i].data(), params[i].numel));
    return finalize(reference::norm_partial(views, GradientRead{scale, 1.0f}));
  };

  Run out;
  out.loaded = st;
  bool kept = true;  // the previous step would have kept its speculated chunks
  for (int s = 0; s < stream.steps; ++s) {
    step_now = s;
    const float scale = stream.scale(s);
    std::vector<bool> got(n, false);
    for (int mb = 0; mb < stream.micro_batches(s); ++mb)
      for (std::size_t i = 0; i < n; ++i) {
        if (!stream.has_gradient(s, mb, i)) continue;
        const std::vector<std::uint8_t> g = stream.gradient(s, mb, i);
        const AccumulatePair pair{f32_view(acc[i].data(), params[i].numel),
                                  ConstTensorView(g.data(), params[i].numel, params[i].grad_dtype),
                                  !got[i]};
        reference::accumulate(std::span(&pair, 1));
        got[i] = true;
      }
    for (std::size_t i = 0; i < n; ++i)
      if (!got[i]) std::fill(acc[i].begin(), acc[i].end(), 0.0f);
    Step step;
    StepReport& r = step.report;
    const std::optional<float> max_norm = setup.max_norm_of ? setup.max_norm_of(s) : setup.max_norm;
    r.norm = norm(0, n, scale, true);
    if (max_norm)
      r.clip_coefficient = r.norm.finite ? clip_coefficient(r.norm.norm, *max_norm) : 0.0f;
    r.skipped = !r.norm.finite;
    r.stepped = !r.skipped;
    if (r.stepped) update(0, n, GradientRead{scale, r.clip_coefficient});
    const bool keep =
        r.norm.finite && (r.clip_coefficient == 1.0f || !reads_scaled(setup.optimizer));
    if (setup.overlap && (setup.speculation == Speculation::always ||
                          (setup.speculation == Speculation::automatic && kept))) {
      r.chunks_speculated = chunks.size();
      (keep ? r.chunks_committed : r.chunks_rolled_back) = chunks.size();
    }
    kept = keep;
    step.effective_scale = scale * step.report.clip_coefficient;
    step.state = st;
    step.steps = steps;
    out.steps.push_back(std::move(step));
  }
  return out;
}

}  // namespace manager_model
