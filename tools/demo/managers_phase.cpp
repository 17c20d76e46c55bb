// stepcore-demo's managers phase: each offload mode's manager fed the synthetic
// gradient stream in backward order, its state hashed after every step, and the
// per-mode lines and the "bitwise:" verdict across the modes.
#include "managers_phase.hpp"

#include <cinttypes>
#include <cstdio>
#include <string>

#include "report.hpp"
#include "stepcore/cuda.hpp"
#include "stepcore/device.hpp"
#include "synthetic.hpp"

namespace stepcore_demo {

namespace {

/// One mode's observable results, per step.
struct ManagersRun {
  std::vector<std::uint64_t> state_hash;  ///< FNV-1a over every parameter's state bytes
  std::vector<std::uint32_t> norm_bits, scale_bits;
  std::vector<bool> skipped;
  double seconds = 0.0;
  std::string device;
};

/// FNV-1a 64 over bytes, continuing from `h`.
std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h;
}

/// Runs the stream through the manager of `mode`; returns its results.
ManagersRun run_manager_mode(sc::OffloadMode mode, const ManagersOptions& o) {
  ManagersRun run;
  auto dev = o.cuda ? sc::device::make_cuda_device(0) : sc::device::make_host_device();
  run.device = std::string(dev->name());
  sc::ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer = o.optimizer;
  for (const TensorSpec& t : o.layout)
    cfg.params.push_back(
        {t.name, t.numel(), o.grad_dtype, sc::DType::bf16, true, true, no_decay(t.kind)});
  cfg.chunk_elements = o.chunk_elements;
  cfg.device = dev.get();
  cfg.engine = o.engine;
  auto m = sc::make_gradient_manager(cfg);
  std::vector<float> host_f32;
  for (std::size_t t = 0; t < o.layout.size(); ++t) {
    host_f32.assign(o.layout[t].numel(), 0.0f);
    fill_init(host_f32.data(), host_f32.size(), o.seed, t, o.layout[t].kind);
    m->load_parameter(t, host_f32);
  }
  std::vector<sc::bfloat16_t> host_bf16;
  const auto t0 = Clock::now();
  const bool adamw = o.optimizer.kind == sc::OptimizerKind::adamw;
  for (std::int64_t step = 0; step < o.steps; ++step) {
    const std::vector<std::int64_t> tokens = micro_batch_tokens(o.seed, step, o.micro_batches);
    std::int64_t total = 0;
    for (std::int64_t n : tokens) total += n;
    const float scale = static_cast<float>(1.0 / static_cast<double>(total));
    const std::vector<double> sigma =
        grad_sigmas(o.layout, o.tied, tokens, target_norm(o.seed, step));
    m->begin_step(scale, false);
    for (std::int64_t k = 0; k < o.micro_batches; ++k) {
      m->begin_backward(k + 1 == o.micro_batches);
      for (std::size_t t = o.layout.size(); t-- > 0;) {  // backward: last layer first
        const sc::TensorView g = m->gradient(t);
        const float sd = static_cast<float>(sigma[t] * static_cast<double>(tokens[k]));
        const std::uint64_t key = grad_key(o.seed, step, k, t);
        const void* src = nullptr;
        if (o.grad_dtype == sc::DType::bf16) {
          host_bf16.resize(g.numel);
          fill_gauss_range(host_bf16.data(), 0, g.numel, key, sd);
          src = host_bf16.data();
        } else {
          host_f32.resize(g.numel);
          fill_gauss_range(host_f32.data(), 0, g.numel, key, sd);
          src = host_f32.data();
        }
        if (g.numel != 0) {
          dev->copy(sc::device::Queue::compute, g.data, src, g.bytes());
          dev->synchronize(dev->record(sc::device::Queue::compute));  // the host buffer is reused
        }
        m->gradient_ready(t);
      }
      m->finish_backward();
    }
    run.norm_bits.push_back(
        o.max_norm > 0.0 ? sc::f32_bits(m->clip_grad_norm(static_cast<float>(o.max_norm))) : 0u);
    run.scale_bits.push_back(sc::f32_bits(m->effective_gradient_scale()));
    m->step();
    run.skipped.push_back(m->report().skipped);
    std::uint64_t h = 0xCBF29CE484222325ull;
    std::vector<float> master, ea, eas;
    std::vector<std::uint8_t> compute;
    for (std::size_t t = 0; t < o.layout.size(); ++t) {
      const std::size_t n = o.layout[t].numel();
      master.resize(n);
      ea.resize(adamw ? n : 0);
      eas.resize(adamw ? n : 0);
      compute.resize(2 * n);
      m->read_parameter(t, master, ea, eas, compute);
      h = fnv1a(h, master.data(), 4 * n);
      h = fnv1a(h, ea.data(), 4 * ea.size());
      h = fnv1a(h, eas.data(), 4 * eas.size());
      h = fnv1a(h, compute.data(), compute.size());
    }
    run.state_hash.push_back(h);
  }
  m->close();
  run.seconds = seconds_since(t0);
  return run;
}

}  // namespace

ManagersOptions managers_options(const Options& o, const Backend& backend) {
  ManagersOptions mo;
  ModelConfig config = *find_model(o.model);
  config.layers = o.managers_layers;
  config.vocab = o.managers_vocab;
  mo.layout = build_layout(config);
  mo.tied = config.tied_embeddings;
  mo.seed = o.seed;
  mo.steps = o.steps;
  mo.micro_batches = o.micro_batches;
  mo.max_norm = o.max_norm;
  mo.grad_dtype = o.grad_dtype;
  mo.optimizer.kind =
      o.optimizer == Optimizer::adamw ? sc::OptimizerKind::adamw : sc::OptimizerKind::sign_sgd;
  mo.optimizer.adamw.lr = o.lr;
  mo.optimizer.adamw.weight_decay = o.weight_decay;
  mo.optimizer.adamw.formula = o.formula;
  mo.optimizer.sign_sgd.lr = o.lr;
  mo.optimizer.sign_sgd.weight_decay = o.weight_decay;
  if (backend.engine) {
    mo.engine.isa = backend.engine->isa();
    mo.engine.threads = backend.engine->threads();
  }
  mo.chunk_elements = std::size_t{4} << 20;  // several chunks even for the small model
  mo.cuda = sc::cuda::device_count() > 0;
  return mo;
}

bool run_managers_phase(const ManagersOptions& o) {
  const sc::OffloadMode modes[] = {sc::OffloadMode::none, sc::OffloadMode::optimizer,
                                   sc::OffloadMode::full};
  std::vector<ManagersRun> runs;
  std::size_t params = 0;
  for (const TensorSpec& t : o.layout) params += t.numel();
  for (sc::OffloadMode mode : modes) {
    runs.push_back(run_manager_mode(mode, o));
    const ManagersRun& r = runs.back();
    std::printf("managers   mode %-9s on %-5s %" PRId64 " steps x %" PRId64
                " micro-batches, %.1f M parameters: %.2f s; %s",
                std::string(sc::offload_mode_name(mode)).c_str(), r.device.c_str(), o.steps,
                o.micro_batches, static_cast<double>(params) * 1e-6, r.seconds,
                o.max_norm > 0.0 ? "norms" : "no clipping, steps");
    for (std::size_t s = 0; s < r.norm_bits.size(); ++s) {
      if (o.max_norm > 0.0) std::printf(" 0x%08" PRIx32, r.norm_bits[s]);
      std::printf("%s", r.skipped[s] ? " skipped" : (o.max_norm > 0.0 ? "" : " applied"));
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  for (std::size_t k = 1; k < runs.size(); ++k)
    for (std::size_t s = 0; s < runs[0].state_hash.size(); ++s) {
      const char* what = runs[k].norm_bits[s] != runs[0].norm_bits[s]     ? "norm"
                         : runs[k].scale_bits[s] != runs[0].scale_bits[s] ? "clip coefficient"
                         : runs[k].skipped[s] != runs[0].skipped[s]       ? "found-inf"
                         : runs[k].state_hash[s] != runs[0].state_hash[s]
                             ? "parameters, moments or compute weights"
                             : nullptr;
      if (what != nullptr) {
        std::printf("bitwise: MISMATCH managers %s != %s on step %zu: %s\n",
                    std::string(sc::offload_mode_name(modes[k])).c_str(),
                    std::string(sc::offload_mode_name(modes[0])).c_str(), s + 1, what);
        return false;
      }
    }
  std::printf("bitwise: managers none == optimizer == full (%s device) on all %" PRId64
              " steps: norms, clip coefficients, parameters, moments, compute weights; state "
              "hash %016" PRIx64 "\n",
              runs[0].device.c_str(), o.steps, runs[0].state_hash.back());
  return true;
}

}  // namespace stepcore_demo
