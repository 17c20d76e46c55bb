// Shared by the gradient managers' tests (in-process and MPI): the test cases, a run of
// the synthetic stream through a manager of any mode on a fresh host device, the
// independent expectation built from stepcore::reference alone, and sharding helpers.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <optional>
#include <string>
#include <vector>

#include "gradient_stream.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/reference.hpp"

namespace managers_cases {

using namespace stepcore;
using namespace stepcore::testing;

/// The device every run uses: the host device, or CUDA device 0 in the gpu variant.
inline std::unique_ptr<device::Device> (*make_device)() = [] { return device::make_host_device(); };

inline constexpr std::size_t kChunk = 5000;  // several chunks in the test model

struct Case {
  DType grad_dtype = DType::bf16;
  std::string optimizer = "adamw";
  std::optional<float> max_norm;
  Flow flow = Flow::sft;
  bool overlap = false;
  std::string label() const {
    return std::string(dtype_name(grad_dtype)) + " " + optimizer + " max_norm " +
           (max_norm ? std::to_string(*max_norm) : "none") + (flow == Flow::sft ? " sft" : " rl") +
           (overlap ? " overlap" : "");
  }
};

inline OptimizerSpec optimizer_of(const std::string& name) {
  OptimizerSpec o;
  o.name = name;
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
  cfg.optimizer = optimizer_of(c.optimizer);
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

/// The independent expectation: the same stream through stepcore::reference only.
inline std::vector<StepRecord> run_reference(const Case& c) {
  const std::vector<StreamParam> model = stream_model(c.grad_dtype);
  const std::size_t n = model.size();
  const OptimizerSpec opt = optimizer_of(c.optimizer);
  const bool adamw = c.optimizer == "adamw";
  std::vector<std::vector<float>> p(n), m(n), v(n), acc(n);
  std::vector<std::vector<std::uint16_t>> out(n);
  std::vector<float> steps(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    p[i].resize(model[i].numel);
    for (std::size_t j = 0; j < p[i].size(); ++j) p[i][j] = initial_master(i, j);
    m[i].assign(model[i].numel, 0.0f);
    v[i].assign(model[i].numel, 0.0f);
    acc[i].assign(model[i].numel, 0.0f);
    out[i].resize(model[i].numel);
    for (std::size_t j = 0; j < p[i].size(); ++j) out[i][j] = f32_to_bf16_bits(p[i][j]);
  }
  // Chunks: consecutive parameters up to kChunk elements, never split.
  std::vector<std::pair<std::size_t, std::size_t>> chunks;
  std::size_t elems = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (chunks.empty() || (elems != 0 && elems + model[i].numel > kChunk)) {
      chunks.push_back({i, i});
      elems = 0;
    }
    chunks.back().second = i + 1;
    elems += model[i].numel;
  }
  // One reference call per parameter, each with its own weight decay.
  auto step_params = [&](std::size_t first, std::size_t last, GradientRead read) {
    for (std::size_t i = first; i < last; ++i) {
      if (adamw) {
        AdamWConfig cfg = opt.adamw;
        if (no_decay(i)) cfg.weight_decay = 0.0;
        const AdamWTensor t{
            f32_view(p[i].data(), p[i].size()),       f32_view(m[i].data(), m[i].size()),
            f32_view(v[i].data(), v[i].size()),       &steps[i],
            const_view(acc[i].data(), acc[i].size()), {out[i].data(), out[i].size(), DType::bf16}};
        reference::adamw_step(std::span(&t, 1), cfg, read);
      } else {
        SignSgdConfig cfg = opt.sign_sgd;
        if (no_decay(i)) cfg.weight_decay = 0.0;
        const SignSgdTensor t{f32_view(p[i].data(), p[i].size()),
                              const_view(acc[i].data(), acc[i].size()),
                              {out[i].data(), out[i].size(), DType::bf16}};
        reference::sign_sgd_step(std::span(&t, 1), cfg, read);
      }
    }
  };
  auto norm_of = [&](std::size_t first, std::size_t last, float scale) {
    std::vector<ConstTensorView> views;
    for (std::size_t i = first; i < last; ++i)
      views.push_back(const_view(acc[i].data(), acc[i].size()));
    return finalize(reference::norm_partial(views, GradientRead{scale, 1.0f}));
  };
  std::vector<StepRecord> records;
  std::vector<std::uint8_t> g;
  for (int s = 0; s < 3; ++s) {
    const StepPlan plan = plan_step(c.flow, s, n, 1);
    std::vector<bool> got(n, false);
    for (int mb = 0; mb < plan.micro_batches; ++mb)
      for (std::size_t i = n; i-- > 0;) {
        if (!plan.has_grad[static_cast<std::size_t>(mb)][i]) continue;
        g.assign(model[i].numel * dtype_size(c.grad_dtype) + 1, 0);
        make_gradient(1, s, mb, i, 0, model[i].numel, c.grad_dtype, g.data());
        const AccumulatePair pair{f32_view(acc[i].data(), acc[i].size()),
                                  ConstTensorView(g.data(), model[i].numel, c.grad_dtype), !got[i]};
        reference::accumulate(std::span(&pair, 1));
        got[i] = true;
      }
    for (std::size_t i = 0; i < n; ++i)
      if (!got[i]) std::fill(acc[i].begin(), acc[i].end(), 0.0f);
    StepRecord r;
    if (!c.overlap) {
      const NormResult norm = norm_of(0, n, plan.scale);
      float clip = 1.0f;
      if (c.max_norm) {
        r.norm_bits = std::bit_cast<std::uint32_t>(norm.norm);
        clip = norm.finite ? clip_coefficient(norm.norm, *c.max_norm) : 0.0f;
      }
      r.scale_bits = std::bit_cast<std::uint32_t>(plan.scale * clip);
      r.skipped = !norm.finite;
      if (norm.finite) step_params(0, n, GradientRead{plan.scale, clip});
    } else {
      r.scale_bits = std::bit_cast<std::uint32_t>(plan.scale);
      for (const auto& [first, last] : chunks) {
        if (norm_of(first, last, plan.scale).finite)
          step_params(first, last, GradientRead{plan.scale, 1.0f});
        else
          ++r.chunks_skipped;
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      std::vector<std::uint8_t> bytes;
      auto append = [&](const void* d, std::size_t b) {
        const auto* c8 = static_cast<const std::uint8_t*>(d);
        bytes.insert(bytes.end(), c8, c8 + b);
      };
      append(p[i].data(), p[i].size() * 4);
      if (adamw) {
        append(m[i].data(), m[i].size() * 4);
        append(v[i].data(), v[i].size() * 4);
      }
      append(out[i].data(), out[i].size() * 2);
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
