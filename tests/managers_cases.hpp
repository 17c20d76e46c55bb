// Shared by the gradient managers' tests (in-process and MPI): the test cases, a run of
// the synthetic stream through a manager of any mode on a fresh host device, the
// independent expectation (the stream through manager_model, stepcore::reference alone),
// and sharding helpers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gradient_stream.hpp"
#include "manager_model.hpp"
#include "ranks.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace managers_cases {

using namespace stepcore;
using namespace stepcore::testing;

/// The device every run uses: the host device, or CUDA device 0 in the gpu variant.
inline std::unique_ptr<device::Device> (*make_device)() = [] { return device::make_host_device(); };

inline constexpr std::size_t kChunk = 5000;  // several chunks in the test model

/// A NaN written over the first element of parameter i's gradient (this rank's shard of
/// it) in micro-batch `micro` of step `step`; on every rank, or (rank >= 0) on that one
/// rank only (the reference, which sees the whole model, always has it: one NaN anywhere
/// skips the whole step).
struct Poison {
  int step = 0, micro = 0;
  std::size_t param = 0;
  int rank = -1;
};

struct Case {
  DType grad_dtype = DType::bf16;
  /// The optimizer (its other hyper-parameters; lr and weight decay are the groups').
  OptimizerConfig optimizer = AdamWConfig{};
  std::optional<float> max_norm;
  Flow flow = Flow::sft;
  bool overlap = false;
  AdamWFormula formula = AdamWConfig{}.formula;
  bool schedule = false;  ///< warm-up + cosine lr per group (schedule_of) before every step
  int steps = 3;
  bool caller_gradients = false;  ///< the trainer's own gradient buffers (poisoned on release)
  /// The model's parameter sizes (each of grad_dtype); empty: stream_model's.
  std::vector<std::size_t> sizes;
  std::size_t chunk = kChunk;  ///< ManagerConfig::chunk_elements
  /// When set: the max_norm of each step (no value: no clip_grad_norm); overrides max_norm.
  std::function<std::optional<float>(int step)> max_norm_of;
  std::vector<Poison> poisons;
  Speculation speculation = Speculation::automatic;            ///< ManagerConfig::speculation
  std::int64_t speculation_bytes = ManagerConfig::kAllChunks;  ///< ManagerConfig's budget
  std::int64_t speculation_device_bytes = 0;  ///< ManagerConfig's (full offload) staging
  std::int64_t ring_slots = ManagerConfig::kDefaultRing;  ///< ManagerConfig's (full offload)
  std::size_t ring_slot_elements = ManagerConfig{}.ring_slot_elements;
  /// When set: the stream's gradients and scales instead of the generated ones
  /// (StreamOptions::fill, scale).
  GradientFill fill;
  std::function<float(int step)> scale;
  bool q8 = false;                   ///< ManagerConfig::q8_state (8-bit slots)
  std::size_t min_8bit_size = 4096;  ///< ManagerConfig::min_8bit_size
  /// The optimizer's fixed hyper-parameters that differ from its defaults, for labels.
  std::string optimizer_flags() const {
    std::string out;
    const auto mine = optimizer_fields(optimizer);
    const auto defaults = optimizer_fields(parse_optimizer(optimizer_name(optimizer)));
    for (std::size_t k = 0; k < mine.size(); ++k)
      if (mine[k].name != "lr" && mine[k].name != "weight_decay" && mine[k].name != "formula" &&
          mine[k].value != defaults[k].value)
        out += " " + mine[k].name + "=" + std::to_string(std::get<double>(mine[k].value));
    return out;
  }
  std::string label() const {
    return std::string(dtype_name(grad_dtype)) + " " + std::string(optimizer_name(optimizer)) +
           optimizer_flags() + (formula == AdamWFormula::native ? " (native)" : "") + " max_norm " +
           (max_norm ? std::to_string(*max_norm) : "none") +
           (flow == Flow::sft  ? " sft"
            : flow == Flow::rl ? " rl"
                               : " rl-single") +
           (overlap ? " overlap" : "") + (schedule ? " schedule" : "") +
           (caller_gradients ? " caller-gradients" : "") +
           (q8 ? " q8 min " + std::to_string(min_8bit_size) : "") + " " + std::to_string(steps) +
           " steps" + (max_norm_of ? " max_norm per step" : "") +
           (poisons.empty() ? "" : " " + std::to_string(poisons.size()) + " poisons") +
           (overlap ? " speculation " + std::string(speculation_name(speculation)) + " budget " +
                          std::to_string(speculation_bytes) +
                          (speculation_device_bytes != 0
                               ? " device staging " + std::to_string(speculation_device_bytes)
                               : "")
                    : "");
  }
};

/// Returns the case's model: its sizes of grad_dtype, or stream_model's.
inline std::vector<StreamParam> case_model(const Case& c) {
  if (c.sizes.empty()) return stream_model(c.grad_dtype);
  std::vector<StreamParam> out;
  for (std::size_t n : c.sizes) out.push_back({n, c.grad_dtype});
  return out;
}

/// Returns the case's max_norm in step s (no value: the step does not clip).
inline std::optional<float> max_norm_in(const Case& c, int s) {
  return c.max_norm_of ? c.max_norm_of(s) : c.max_norm;
}

/// Returns `base` with lr 1e-3 and weight decay 0.1 (and, for AdamW, `formula`).
inline OptimizerConfig optimizer_of(OptimizerConfig base,
                                    AdamWFormula formula = AdamWConfig{}.formula) {
  std::visit(
      [](auto& c) {
        c.lr = 1e-3;
        c.weight_decay = 0.1;
      },
      base);
  if (auto* a = std::get_if<AdamWConfig>(&base)) a->formula = formula;
  return base;
}

/// True for AdamW (any formula and flags).
inline bool is_adamw(const OptimizerConfig& c) { return std::holds_alternative<AdamWConfig>(c); }

/// Returns true for the parameters the test model puts in group 1, "no_decay" (like a
/// trainer's norms and biases): indexes 1 and 5.
inline bool no_decay(std::size_t i) { return i == 1 || i == 5; }

/// The test model's groups: "decay" (lr 1e-3, weight decay 0.1) and "no_decay" (lr 1e-3,
/// weight decay 0), PyTorch's usual pair.
inline std::vector<ParamGroup> groups_of() {
  ParamGroup decay, no_decay_group;
  decay.name = "decay";
  decay.lr = 1e-3;
  decay.weight_decay = 0.1;
  no_decay_group.name = "no_decay";
  no_decay_group.lr = 1e-3;
  no_decay_group.weight_decay = 0.0;
  return {decay, no_decay_group};
}

/// A trainer's schedule over `steps` steps: linear warm-up over 5 steps, then cosine decay
/// to a tenth; group 0 from lr 1e-3 with weight decay 0.1, group 1 from lr 2e-3 with
/// weight decay 0.
inline StepHyper schedule_of(int step, std::size_t group, int steps) {
  const double base = group == 0 ? 1e-3 : 2e-3;
  const int warmup = 5;
  double lr;
  if (step < warmup) {
    lr = base * (step + 1) / warmup;
  } else {
    const double t = static_cast<double>(step - warmup) / std::max(1, steps - warmup);
    lr = 0.1 * base + 0.45 * base * (1.0 + std::cos(3.141592653589793 * t));
  }
  return {lr, group == 0 ? 0.1 : 0.0};
}

/// The parameters of the model in order (group 1 for no_decay(i)).
inline std::vector<ParamSpec> param_specs(const std::vector<StreamParam>& model) {
  std::vector<ParamSpec> out;
  for (std::size_t i = 0; i < model.size(); ++i) {
    ParamSpec p;
    p.name = "p" + std::to_string(i);
    p.numel = model[i].numel;
    p.grad_dtype = model[i].grad_dtype;
    p.compute_dtype = DType::bf16;
    p.group = no_decay(i) ? 1 : 0;
    out.push_back(p);
  }
  return out;
}

/// How a test builds its manager, beyond the case.
struct Build {
  OffloadMode mode = OffloadMode::none;
  bool lazy = false;                                  ///< ManagerConfig::lazy_gpu_scale
  comm::Communicator* comm = nullptr;                 ///< a rank's communicator
  const std::vector<StreamParam>* shard = nullptr;    ///< a rank's shard sizes (else whole)
  const std::vector<std::size_t>* offsets = nullptr;  ///< the shard's offsets
  int threads = 2;                                    ///< full offload's engine threads
  std::optional<cpu::Isa> isa;                        ///< full offload's engine ISA
};

/// Returns the test model's configuration in `mode` on `dev`: the groups, the parameters
/// (`model`, or the whole test model of bf16 gradients), kChunk, fingerprint 42, 2 threads.
inline ManagerConfig config_of(OffloadMode mode, device::Device& dev,
                               const OptimizerConfig& optimizer = AdamWConfig{},
                               const std::vector<StreamParam>& model = stream_model(DType::bf16),
                               AdamWFormula formula = AdamWConfig{}.formula) {
  ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer = optimizer_of(optimizer, formula);
  cfg.groups = groups_of();
  cfg.params = param_specs(model);
  cfg.chunk_elements = kChunk;
  cfg.device = &dev;
  cfg.layout_fingerprint = 42;
  cfg.engine.threads = 2;
  return cfg;
}

/// Returns the manager of `b` for the case on `dev`, parameters loaded with the stream's
/// initial masters.
inline std::unique_ptr<GradientManager> make_manager(const Build& b, const Case& c,
                                                     device::Device& dev) {
  const std::vector<StreamParam> model = b.shard ? *b.shard : case_model(c);
  ManagerConfig cfg = config_of(b.mode, dev, c.optimizer, model, c.formula);
  cfg.chunk_elements = c.chunk;
  cfg.speculation = c.speculation;
  cfg.speculation_bytes = c.speculation_bytes;
  cfg.speculation_device_bytes = b.mode == OffloadMode::full ? c.speculation_device_bytes : 0;
  cfg.ring_slots = c.ring_slots;
  cfg.ring_slot_elements = c.ring_slot_elements;
  cfg.q8_state = c.q8;
  cfg.min_8bit_size = c.min_8bit_size;
  for (ParamSpec& p : cfg.params) p.gradient_buffer = !c.caller_gradients;
  cfg.comm = b.comm;
  cfg.engine.threads = b.threads;
  cfg.engine.isa = b.isa;
  cfg.lazy_gpu_scale = b.lazy;
  auto m = make_gradient_manager(cfg);
  for (std::size_t i = 0; i < model.size(); ++i) {
    std::vector<float> init(model[i].numel);
    const std::size_t off = b.offsets ? (*b.offsets)[i] : 0;
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, off + j);
    m->load_parameter(i, init);
  }
  return m;
}

/// Returns the stream options of the case (steps [first_step, first_step + steps)) for
/// rank `rank` (its poisons).
inline StreamOptions stream_options(const Case& c, const std::vector<std::size_t>* offsets,
                                    int first_step = 0, int steps = -1, int rank = 0) {
  StreamOptions o;
  o.flow = c.flow;
  o.max_norm = c.max_norm;
  o.max_norm_of = c.max_norm_of;
  for (const Poison& p : c.poisons)
    if (p.rank < 0 || p.rank == rank) o.poisons.push_back({p.step, p.micro, p.param});
  o.overlap = c.overlap;
  o.first_step = first_step;
  o.steps = steps < 0 ? c.steps : steps;
  o.caller_gradients = c.caller_gradients;
  if (c.schedule)
    o.schedule = [total = c.steps](int s, std::size_t g) { return schedule_of(s, g, total); };
  if (offsets) o.shard_offset = *offsets;
  o.fill = c.fill;
  o.scale = c.scale;
  return o;
}

/// Runs the stream through the manager of `mode` on a fresh host device.
inline std::vector<StepRecord> run_mode(OffloadMode mode, const Case& c, bool lazy = false,
                                        comm::Communicator* comm = nullptr,
                                        const std::vector<StreamParam>* shard = nullptr,
                                        const std::vector<std::size_t>* offsets = nullptr) {
  auto dev = make_device();
  Build b;
  b.mode = mode;
  b.lazy = lazy;
  b.comm = comm;
  b.shard = shard;
  b.offsets = offsets;
  auto m = make_manager(b, c, *dev);
  auto rec = run_stream(*m, *dev, stream_options(c, offsets, 0, -1, comm ? comm->rank() : 0));
  m->close();
  return rec;
}

/// The model sharded over ranks: per rank, the shard sizes and their offsets in the
/// whole parameters (shard_model).
struct Sharding {
  std::vector<std::vector<StreamParam>> shards;
  std::vector<std::vector<std::size_t>> offsets;
};

/// Returns per parameter the shard offsets of `sh` (the tensors each rank's optimizer
/// is given), for manager_model::Setup::segments.
inline std::vector<std::vector<std::size_t>> segments_of(const Sharding& sh, std::size_t params) {
  std::vector<std::vector<std::size_t>> out(params);
  for (std::size_t i = 0; i < params; ++i)
    for (const auto& rank_offsets : sh.offsets) out[i].push_back(rank_offsets[i]);
  return out;
}

/// The independent expectation: the same stream through manager_model (the reference);
/// with `sharding`, each shard of every parameter is updated as a tensor of its own.
inline std::vector<StepRecord> run_reference(const Case& c, const Sharding* sharding = nullptr) {
  const std::vector<StreamParam> model = case_model(c);
  manager_model::Setup setup;
  setup.params = param_specs(model);
  setup.optimizer = optimizer_of(c.optimizer, c.formula);
  setup.groups = groups_of();
  if (c.schedule)
    setup.schedule = [steps = c.steps](int s, std::size_t g) { return schedule_of(s, g, steps); };
  setup.chunk_elements = c.chunk;
  setup.max_norm = c.max_norm;
  setup.max_norm_of = c.max_norm_of;
  setup.overlap = c.overlap;
  setup.speculation = c.speculation;
  setup.q8 = c.q8;
  setup.min_8bit_size = c.min_8bit_size;
  if (sharding != nullptr) setup.segments = segments_of(*sharding, model.size());
  // The flow's plan of each step (seed 1, as run_stream's default StreamOptions).
  auto plan = [&](int s) {
    StepPlan p = plan_step(c.flow, s, model.size(), 1);
    if (c.scale) p.scale = c.scale(s);
    return p;
  };
  const manager_model::Stream stream{
      c.steps,
      [&](int s) { return plan(s).scale; },
      [&](int s) { return plan(s).micro_batches; },
      [&](int s, int mb, std::size_t i) {
        return static_cast<bool>(plan(s).has_grad[static_cast<std::size_t>(mb)][i]);
      },
      [&](int s, int mb, std::size_t i) {
        std::vector<std::uint8_t> g(model[i].numel * dtype_size(c.grad_dtype) + 1);
        if (c.fill)
          c.fill(s, mb, i, 0, model[i].numel, c.grad_dtype, g.data());
        else
          make_gradient(1, s, mb, i, 0, model[i].numel, c.grad_dtype, g.data());
        for (const Poison& p : c.poisons)  // as run_stream writes it (any rank: the same skip)
          if (p.step == s && p.micro == mb && p.param == i && model[i].numel > 0) {
            const float nan = std::numeric_limits<float>::quiet_NaN();
            const std::uint16_t h = 0x7FC0;
            if (c.grad_dtype == DType::f32)
              std::memcpy(g.data(), &nan, 4);
            else
              std::memcpy(g.data(), &h, 2);
          }
        return g;
      },
      initial_master};
  std::vector<StepRecord> records;
  int s = 0;
  for (const manager_model::Step& step : manager_model::run(setup, stream).steps) {
    StepRecord r;
    // clip_grad_norm's result when the stream clips (else 0), effective_gradient_scale().
    if (max_norm_in(c, s++)) r.norm_bits = std::bit_cast<std::uint32_t>(step.report.norm.norm);
    r.report_norm_bits = std::bit_cast<std::uint32_t>(step.report.norm.norm);
    r.clip_bits = std::bit_cast<std::uint32_t>(step.report.clip_coefficient);
    r.stepped = step.report.stepped;
    r.scale_bits = std::bit_cast<std::uint32_t>(step.effective_scale);
    r.skipped = step.report.skipped;
    r.speculated = step.report.chunks_speculated;
    r.committed = step.report.chunks_committed;
    r.rolled_back = step.report.chunks_rolled_back;
    for (const manager_model::ParamState& p : step.state) {  // master|slots|compute bytes
      std::vector<std::uint8_t> bytes;
      auto append = [&](const void* d, std::size_t b) {
        const auto* c8 = static_cast<const std::uint8_t*>(d);
        bytes.insert(bytes.end(), c8, c8 + b);
      };
      append(p.master.data(), p.master.size() * 4);
      for (std::size_t k = 0; k < p.slots.size(); ++k) {  // f32 values, or codes and maxima
        append(p.slots[k].data(), p.slots[k].size() * 4);
        if (k < p.codes.size()) {
          append(p.codes[k].data(), p.codes[k].size());
          append(p.absmax[k].data(), p.absmax[k].size() * 4);
        }
      }
      append(p.compute.data(), p.compute.size());
      r.state.push_back(std::move(bytes));
    }
    r.steps = step.steps;
    records.push_back(std::move(r));
  }
  return records;
}

inline void expect_same(const std::vector<StepRecord>& got, const std::vector<StepRecord>& want,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t s = 0; s < got.size(); ++s) {
    EXPECT_EQ(got[s].norm_bits, want[s].norm_bits) << what << " step " << s << " norm";
    EXPECT_EQ(got[s].scale_bits, want[s].scale_bits) << what << " step " << s << " scale*clip";
    EXPECT_EQ(got[s].skipped, want[s].skipped) << what << " step " << s;
    EXPECT_EQ(got[s].speculated, want[s].speculated) << what << " step " << s << " speculated";
    EXPECT_EQ(got[s].committed, want[s].committed) << what << " step " << s << " committed";
    EXPECT_EQ(got[s].rolled_back, want[s].rolled_back) << what << " step " << s << " rolled back";
    ASSERT_EQ(got[s].state.size(), want[s].state.size()) << what;
    EXPECT_EQ(got[s].steps, want[s].steps) << what << " step " << s << " step counters";
    for (std::size_t i = 0; i < got[s].state.size(); ++i)
      ASSERT_TRUE(got[s].state[i] == want[s].state[i])
          << what << " step " << s << " parameter " << i << ": state bits differ";
  }
}

/// Shards of the model over `ranks` ranks: shard r of every parameter holds
/// numel * (r + 1) / T elements (T = ranks (ranks + 1) / 2; the last takes the rest),
/// and rank 0's shard of parameter 0 is empty.
inline Sharding shard_model(const std::vector<StreamParam>& model, int ranks) {
  Sharding s;
  s.shards.resize(static_cast<std::size_t>(ranks));
  s.offsets.resize(static_cast<std::size_t>(ranks));
  const std::size_t total = static_cast<std::size_t>(ranks * (ranks + 1) / 2);
  for (std::size_t i = 0; i < model.size(); ++i) {
    std::size_t at = 0;
    for (int r = 0; r < ranks; ++r) {
      std::size_t len = model[i].numel * static_cast<std::size_t>(r + 1) / total;
      if (i == 0 && r == 0) len = 0;
      if (r == ranks - 1) len = model[i].numel - at;
      s.offsets[static_cast<std::size_t>(r)].push_back(at);
      s.shards[static_cast<std::size_t>(r)].push_back({len, model[i].grad_dtype});
      at += len;
    }
  }
  return s;
}

/// Expects rank r's records to be the slices of the unsharded run's, with the same norm
/// and scale bits.
inline void expect_shard_of(const std::vector<StepRecord>& rec,
                            const std::vector<StepRecord>& whole,
                            const std::vector<StreamParam>& model, const Sharding& sh, int r,
                            std::size_t slots) {
  ASSERT_EQ(rec.size(), whole.size());
  const auto ru = static_cast<std::size_t>(r);
  for (std::size_t s = 0; s < rec.size(); ++s) {
    EXPECT_EQ(rec[s].norm_bits, whole[s].norm_bits) << "rank " << r << " step " << s;
    EXPECT_EQ(rec[s].scale_bits, whole[s].scale_bits) << "rank " << r << " step " << s;
    EXPECT_EQ(rec[s].skipped, whole[s].skipped) << "rank " << r << " step " << s;
    EXPECT_EQ(rec[s].steps, whole[s].steps) << "rank " << r << " step " << s;
    for (std::size_t i = 0; i < model.size(); ++i) {
      // Slice the whole parameter's master|slots|compute bytes to this shard.
      const std::size_t n = model[i].numel, off = sh.offsets[ru][i], len = sh.shards[ru][i].numel;
      const auto& w = whole[s].state[i];
      std::vector<std::uint8_t> want;
      const std::size_t f32_arrays = 1 + slots;
      for (std::size_t a = 0; a < f32_arrays; ++a)
        want.insert(want.end(), w.begin() + static_cast<std::ptrdiff_t>(4 * (a * n + off)),
                    w.begin() + static_cast<std::ptrdiff_t>(4 * (a * n + off + len)));
      const std::size_t cbase = 4 * f32_arrays * n;
      want.insert(want.end(), w.begin() + static_cast<std::ptrdiff_t>(cbase + 2 * off),
                  w.begin() + static_cast<std::ptrdiff_t>(cbase + 2 * (off + len)));
      ASSERT_TRUE(rec[s].state[i] == want) << "rank " << r << " step " << s << " param " << i;
    }
  }
}

/// Runs the case sharded over `ranks` in-process ranks (threads; uneven shards, rank 0's
/// shard of parameter 0 empty) in `mode`; returns each rank's records (a rank's failure
/// aborts the group and fails the test).
inline std::vector<std::vector<StepRecord>> run_sharded(int ranks, OffloadMode mode, const Case& c,
                                                        const Sharding& sh, bool lazy = false) {
  std::vector<std::vector<StepRecord>> got(static_cast<std::size_t>(ranks));
  const auto errors = test_support::on_ranks(ranks, [&](int r, comm::Communicator& comm) {
    const auto ru = static_cast<std::size_t>(r);
    got[ru] = run_mode(mode, c, lazy, &comm, &sh.shards[ru], &sh.offsets[ru]);
  });
  for (int r = 0; r < ranks; ++r)
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  return got;
}

}  // namespace managers_cases
