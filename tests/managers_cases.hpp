// Shared by the gradient managers' tests (in-process and MPI): the test cases, a run of
// the synthetic stream through a manager of any mode on a fresh host device, the
// independent expectation (the stream through manager_model, stepcore::reference alone),
// and sharding helpers.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <optional>
#include <string>
#include <vector>

#include "gradient_stream.hpp"
#include "manager_model.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace managers_cases {

using namespace stepcore;
using namespace stepcore::testing;

/// The device every run uses: the host device, or CUDA device 0 in the gpu variant.
inline std::unique_ptr<device::Device> (*make_device)() = [] { return device::make_host_device(); };

inline constexpr std::size_t kChunk = 5000;  // several chunks in the test model

struct Case {
  DType grad_dtype = DType::bf16;
  OptimizerKind optimizer = OptimizerKind::adamw;
  std::optional<float> max_norm;
  Flow flow = Flow::sft;
  bool overlap = false;
  AdamWFormula formula = AdamWConfig{}.formula;
  std::string label() const {
    return std::string(dtype_name(grad_dtype)) + " " + std::string(optimizer_name(optimizer)) +
           (formula == AdamWFormula::native ? " (native)" : "") + " max_norm " +
           (max_norm ? std::to_string(*max_norm) : "none") + (flow == Flow::sft ? " sft" : " rl") +
           (overlap ? " overlap" : "");
  }
};

inline OptimizerSpec optimizer_of(OptimizerKind kind,
                                  AdamWFormula formula = AdamWConfig{}.formula) {
  OptimizerSpec o;
  o.kind = kind;
  o.adamw.formula = formula;
  o.adamw.lr = 1e-3;
  o.adamw.weight_decay = 0.1;
  o.sign_sgd.lr = 1e-3;
  o.sign_sgd.weight_decay = 0.1;
  return o;
}

/// The parameters of a rank holding shard [offset, offset + numel) of each full one.
/// Returns true for the parameters the test model excludes from weight decay (like a
/// trainer's norms and biases): indexes 1 and 5.
inline bool no_decay(std::size_t i) { return i == 1 || i == 5; }

inline std::vector<ParamSpec> param_specs(const std::vector<StreamParam>& model) {
  std::vector<ParamSpec> out;
  for (std::size_t i = 0; i < model.size(); ++i)
    out.push_back({"p" + std::to_string(i), model[i].numel, model[i].grad_dtype, DType::bf16, true,
                   true, no_decay(i)});
  return out;
}

/// Runs the stream through the manager of `mode` on a fresh host device.
inline std::vector<StepRecord> run_mode(OffloadMode mode, const Case& c, bool lazy = false,
                                        comm::Communicator* comm = nullptr,
                                        const std::vector<StreamParam>* shard = nullptr,
                                        const std::vector<std::size_t>* offsets = nullptr) {
  auto dev = make_device();
  const std::vector<StreamParam> model = shard ? *shard : stream_model(c.grad_dtype);
  ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer = optimizer_of(c.optimizer, c.formula);
  cfg.params = param_specs(model);
  cfg.chunk_elements = kChunk;
  cfg.device = dev.get();
  cfg.comm = comm;
  cfg.layout_fingerprint = 42;
  cfg.engine.threads = 2;
  cfg.lazy_gpu_scale = lazy;
  auto m = make_gradient_manager(cfg);
  for (std::size_t i = 0; i < model.size(); ++i) {
    std::vector<float> init(model[i].numel);
    const std::size_t off = offsets ? (*offsets)[i] : 0;
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = initial_master(i, off + j);
    m->load_parameter(i, init);
  }
  StreamOptions o;
  o.flow = c.flow;
  o.max_norm = c.max_norm;
  o.overlap = c.overlap;
  if (offsets) o.shard_offset = *offsets;
  auto rec = run_stream(*m, *dev, o);
  m->close();
  return rec;
}

/// The independent expectation: the same stream through manager_model (the reference).
inline std::vector<StepRecord> run_reference(const Case& c) {
  const std::vector<StreamParam> model = stream_model(c.grad_dtype);
  const manager_model::Setup setup{param_specs(model), optimizer_of(c.optimizer, c.formula), kChunk,
                                   c.max_norm, c.overlap};
  // The flow's plan of each step (seed 1, as run_stream's default StreamOptions).
  auto plan = [&](int s) { return plan_step(c.flow, s, model.size(), 1); };
  const manager_model::Stream stream{
      3,
      [&](int s) { return plan(s).scale; },
      [&](int s) { return plan(s).micro_batches; },
      [&](int s, int mb, std::size_t i) {
        return static_cast<bool>(plan(s).has_grad[static_cast<std::size_t>(mb)][i]);
      },
      [&](int s, int mb, std::size_t i) {
        std::vector<std::uint8_t> g(model[i].numel * dtype_size(c.grad_dtype) + 1);
        make_gradient(1, s, mb, i, 0, model[i].numel, c.grad_dtype, g.data());
        return g;
      },
      initial_master};
  std::vector<StepRecord> records;
  for (const manager_model::Step& step : manager_model::run(setup, stream).steps) {
    StepRecord r;
    // clip_grad_norm's result when the stream clips (else 0), effective_gradient_scale().
    if (c.max_norm) r.norm_bits = std::bit_cast<std::uint32_t>(step.report.norm.norm);
    r.scale_bits = std::bit_cast<std::uint32_t>(step.effective_scale);
    r.skipped = step.report.skipped;
    r.chunks_skipped = step.report.chunks_skipped;
    for (const manager_model::ParamState& p : step.state) {  // master|m|v|compute bytes
      std::vector<std::uint8_t> bytes;
      auto append = [&](const void* d, std::size_t b) {
        const auto* c8 = static_cast<const std::uint8_t*>(d);
        bytes.insert(bytes.end(), c8, c8 + b);
      };
      append(p.master.data(), p.master.size() * 4);
      append(p.exp_avg.data(), p.exp_avg.size() * 4);
      append(p.exp_avg_sq.data(), p.exp_avg_sq.size() * 4);
      append(p.compute.data(), p.compute.size());
      r.state.push_back(std::move(bytes));
    }
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
    EXPECT_EQ(got[s].chunks_skipped, want[s].chunks_skipped) << what << " step " << s;
    ASSERT_EQ(got[s].state.size(), want[s].state.size()) << what;
    for (std::size_t i = 0; i < got[s].state.size(); ++i)
      ASSERT_TRUE(got[s].state[i] == want[s].state[i])
          << what << " step " << s << " parameter " << i << ": state bits differ";
  }
}

/// Shards of the model over `ranks` ranks: shard r of every parameter holds
/// numel * (r + 1) / T elements (T = ranks (ranks + 1) / 2; the last takes the rest),
/// and rank 0's shard of parameter 0 is empty. Returns per rank the shard sizes and
/// their offsets in the whole parameter.
struct Sharding {
  std::vector<std::vector<StreamParam>> shards;
  std::vector<std::vector<std::size_t>> offsets;
};
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
                            bool adamw) {
  ASSERT_EQ(rec.size(), whole.size());
  const auto ru = static_cast<std::size_t>(r);
  for (std::size_t s = 0; s < rec.size(); ++s) {
    EXPECT_EQ(rec[s].norm_bits, whole[s].norm_bits) << "rank " << r << " step " << s;
    EXPECT_EQ(rec[s].scale_bits, whole[s].scale_bits) << "rank " << r << " step " << s;
    EXPECT_EQ(rec[s].skipped, whole[s].skipped) << "rank " << r << " step " << s;
    for (std::size_t i = 0; i < model.size(); ++i) {
      // Slice the whole parameter's master|m|v|compute bytes to this shard.
      const std::size_t n = model[i].numel, off = sh.offsets[ru][i], len = sh.shards[ru][i].numel;
      const auto& w = whole[s].state[i];
      std::vector<std::uint8_t> want;
      const std::size_t f32_arrays = adamw ? 3 : 1;
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

}  // namespace managers_cases
