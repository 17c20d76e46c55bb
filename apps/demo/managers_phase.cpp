// stepcore-demo's managers phase: each offload mode's manager fed the synthetic
// gradient stream in backward order under a warm-up + cosine lr schedule over two
// parameter groups, its state hashed after every step, and the per-mode lines and the
// "bitwise:" verdicts: across the modes, of each mode's overlapped run (speculation with
// exact rollback, clipping on) against the serial one, and of a run saved to a checkpoint
// half way in one mode and resumed in another against the uninterrupted one.
#include "managers_phase.hpp"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "report.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/device.hpp"
#include "synthetic.hpp"

namespace stepcore_demo {

namespace {

/// One mode's observable results, per step.
struct ManagersRun {
  std::vector<std::uint64_t> state_hash;  ///< FNV-1a over every parameter's state bytes
  std::vector<std::uint32_t> norm_bits, scale_bits;
  std::vector<bool> skipped;
  std::size_t speculated = 0, committed = 0, rolled_back = 0;  // overlapped runs' chunks
  double seconds = 0.0;
  std::string device;
  sc::MemoryReport memory;  ///< the manager's bytes by kind at the end of the run
};

/// FNV-1a 64 over bytes, continuing from `h`.
std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h;
}

/// Group `group`'s hyper-parameters at `step`: the demo's schedule (scheduled_lr, the
/// main phase's), with the configured weight decay for group 0 ("decay") and none for
/// group 1 ("no_decay": norms and biases).
sc::StepHyper scheduled(const ManagersOptions& o, std::int64_t step, std::size_t group) {
  const double peak = std::visit([](const auto& c) { return c.lr; }, o.optimizer);
  const double wd = std::visit([](const auto& c) { return c.weight_decay; }, o.optimizer);
  return {scheduled_lr(peak, step, o.steps), group == 0 ? wd : 0.0};
}

/// Which steps a run makes, and where it starts from and saves to.
struct RunSpan {
  std::int64_t first = 0, last = 0;  ///< steps [first, last)
  std::string load;                  ///< non-empty: load_checkpoint(load) instead of the init
  std::string save;                  ///< non-empty: save_checkpoint(save) after the last step
  bool overlap = false;              ///< begin_step(scale, true): speculated chunks
};

/// Runs the stream's steps `span` through the manager of `mode`; returns its results.
ManagersRun run_manager_mode(sc::OffloadMode mode, const ManagersOptions& o, const RunSpan& span) {
  ManagersRun run;
  auto dev = o.cuda ? sc::device::make_cuda_device(0) : sc::device::make_host_device();
  run.device = std::string(dev->name());
  sc::ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer = o.optimizer;
  cfg.q8_state = o.q8_state;
  cfg.min_8bit_size = kMin8bitSize;
  for (const char* name : {"decay", "no_decay"}) {
    sc::ParamGroup g;
    g.name = name;
    const sc::StepHyper h = scheduled(o, 0, cfg.groups.size());
    g.lr = h.lr;
    g.weight_decay = h.weight_decay;
    if (const auto* a = std::get_if<sc::AdamWConfig>(&o.optimizer)) {
      g.beta1 = a->beta1;
      g.beta2 = a->beta2;
      g.eps = a->eps;
    }
    cfg.groups.push_back(g);
  }
  for (const TensorSpec& t : o.layout) {
    sc::ParamSpec p;
    p.name = t.name;
    p.numel = t.numel();
    p.grad_dtype = o.grad_dtype;
    p.compute_dtype = sc::DType::bf16;
    p.group = no_decay(t.kind) ? 1 : 0;
    cfg.params.push_back(p);
  }
  cfg.chunk_elements = o.chunk_elements;
  cfg.device = dev.get();
  cfg.engine = o.engine;
  auto m = sc::make_gradient_manager(cfg);
  std::vector<float> host_f32;
  if (!span.load.empty()) {
    m->load_checkpoint(span.load);
  } else {
    for (std::size_t t = 0; t < o.layout.size(); ++t) {
      host_f32.assign(o.layout[t].numel(), 0.0f);
      fill_init(host_f32.data(), host_f32.size(), o.seed, t, o.layout[t].kind);
      m->load_parameter(t, host_f32);
    }
  }
  std::vector<sc::bfloat16_t> host_bf16;
  const auto t0 = Clock::now();
  const bool adamw = std::holds_alternative<sc::AdamWConfig>(o.optimizer);
  for (std::int64_t step = span.first; step < span.last; ++step) {
    for (std::size_t g = 0; g < m->group_count(); ++g)
      m->set_hyperparameters(g, scheduled(o, step, g));
    const std::vector<std::int64_t> tokens = micro_batch_tokens(o.seed, step, o.micro_batches);
    std::int64_t total = 0;
    for (std::int64_t n : tokens) total += n;
    const float scale = static_cast<float>(1.0 / static_cast<double>(total));
    const std::vector<double> sigma =
        grad_sigmas(o.layout, o.tied, tokens, target_norm(o.seed, step));
    m->begin_step(scale, span.overlap);
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
    const sc::StepReport rep = m->report();
    run.skipped.push_back(rep.skipped);
    run.speculated += rep.chunks_speculated;
    run.committed += rep.chunks_committed;
    run.rolled_back += rep.chunks_rolled_back;
    std::uint64_t h = 0xCBF29CE484222325ull;
    std::vector<float> master, ea, eas, ea_max, eas_max;
    std::vector<std::uint8_t> compute, ea_codes, eas_codes;
    for (std::size_t t = 0; t < o.layout.size(); ++t) {
      const std::size_t n = o.layout[t].numel();
      const bool q8 = m->q8_parameter(t);  // 8-bit moments: codes and block maxima
      master.resize(n);
      ea.resize(adamw && !q8 ? n : 0);
      eas.resize(adamw && !q8 ? n : 0);
      ea_codes.resize(q8 ? n : 0);
      eas_codes.resize(q8 ? n : 0);
      ea_max.resize(q8 ? sc::q8_blocks(n) : 0);
      eas_max.resize(q8 ? sc::q8_blocks(n) : 0);
      compute.resize(2 * n);
      std::vector<sc::SlotOut> slots;
      if (adamw)
        slots = {{"exp_avg", ea, ea_codes, ea_max}, {"exp_avg_sq", eas, eas_codes, eas_max}};
      m->read_parameter(t, master, slots, compute);
      h = fnv1a(h, master.data(), 4 * n);
      h = fnv1a(h, ea.data(), 4 * ea.size());
      h = fnv1a(h, eas.data(), 4 * eas.size());
      h = fnv1a(h, ea_codes.data(), ea_codes.size());
      h = fnv1a(h, eas_codes.data(), eas_codes.size());
      h = fnv1a(h, ea_max.data(), 4 * ea_max.size());
      h = fnv1a(h, eas_max.data(), 4 * eas_max.size());
      h = fnv1a(h, compute.data(), compute.size());
    }
    run.state_hash.push_back(h);
  }
  if (!span.save.empty()) m->save_checkpoint(span.save);
  run.memory = m->memory();
  m->close();
  run.seconds = seconds_since(t0);
  return run;
}

/// Saves a full-offload run to a checkpoint half way, resumes it in mode none (another
/// mode, device and code path), and prints the "bitwise:" verdict against `whole` (the
/// uninterrupted mode-none run): the resumed steps' norms, clip coefficients and states.
bool run_resume_check(const ManagersOptions& o, const ManagersRun& whole) {
  const std::int64_t half = o.steps / 2;
  if (half == 0 || half == o.steps) {
    std::printf("checkpoint skipped: %" PRId64 " steps cannot be split\n", o.steps);
    return true;
  }
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("stepcore-demo-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "rank-00000.stepcore").string();
  const auto t0 = Clock::now();
  (void)run_manager_mode(sc::OffloadMode::full, o, RunSpan{0, half, "", path});
  const double save_s = seconds_since(t0);
  const auto bytes = fs::file_size(path);
  const ManagersRun resumed =
      run_manager_mode(sc::OffloadMode::none, o, RunSpan{half, o.steps, path, ""});
  fs::remove_all(dir);
  for (std::size_t k = 0; k < resumed.state_hash.size(); ++k) {
    const std::size_t s = static_cast<std::size_t>(half) + k;
    if (resumed.state_hash[k] != whole.state_hash[s] ||
        resumed.norm_bits[k] != whole.norm_bits[s] ||
        resumed.scale_bits[k] != whole.scale_bits[s]) {
      std::printf("bitwise: MISMATCH resumed run != uninterrupted run on step %zu\n", s + 1);
      return false;
    }
  }
  std::printf("checkpoint %.1f MiB saved by mode full after step %" PRId64
              " (%.2f s with its steps), loaded by mode none on %s\n",
              static_cast<double>(bytes) / (1024.0 * 1024.0), half, save_s, resumed.device.c_str());
  std::printf(
      "bitwise: resumed run (full -> checkpoint -> none) == uninterrupted run on steps "
      "%" PRId64 "..%" PRId64
      ": norms, clip coefficients, parameters, moments, compute "
      "weights; state hash %016" PRIx64 "\n",
      half + 1, o.steps, resumed.state_hash.back());
  return true;
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
  mo.q8_state = o.q8;
  if (o.optimizer == Optimizer::adamw) {
    sc::AdamWConfig a;
    a.lr = o.lr;
    a.weight_decay = o.weight_decay;
    a.formula = o.formula;
    set_torch_build(a, o.torch_aarch64);
    mo.optimizer = a;
  } else {
    mo.optimizer = sc::SignSgdConfig{o.lr, o.weight_decay};
  }
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
    runs.push_back(run_manager_mode(mode, o, RunSpan{0, o.steps, "", ""}));
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
    // Every byte the manager held (GradientManager::memory()), per parameter.
    const double n = static_cast<double>(std::max<std::size_t>(params, 1));
    std::printf(
        "managers   mode %-9s bytes/param: host %.2f (peak %.2f), device %.2f (peak %.2f)\n",
        std::string(sc::offload_mode_name(mode)).c_str(),
        static_cast<double>(r.memory.host_bytes) / n, static_cast<double>(r.memory.host_peak) / n,
        static_cast<double>(r.memory.device_bytes) / n,
        static_cast<double>(r.memory.device_peak) / n);
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
  // Each mode again with the optimizer overlapped with backward: chunks speculated
  // during the final backward, committed or rolled back exactly at the decision.
  std::size_t speculated = 0, committed = 0, rolled_back = 0;
  for (std::size_t k = 0; k < std::size(modes); ++k) {
    const ManagersRun r = run_manager_mode(modes[k], o, RunSpan{0, o.steps, "", "", true});
    speculated += r.speculated;
    committed += r.committed;
    rolled_back += r.rolled_back;
    for (std::size_t s = 0; s < r.state_hash.size(); ++s)
      if (r.norm_bits[s] != runs[0].norm_bits[s] || r.scale_bits[s] != runs[0].scale_bits[s] ||
          r.skipped[s] != runs[0].skipped[s] || r.state_hash[s] != runs[0].state_hash[s]) {
        std::printf("bitwise: MISMATCH managers %s with overlap != without on step %zu\n",
                    std::string(sc::offload_mode_name(modes[k])).c_str(), s + 1);
        return false;
      }
  }
  std::printf(
      "bitwise: managers with overlap (speculation auto, %s) == without, modes none, "
      "optimizer, full, all %" PRId64
      " steps; chunks speculated %zu, committed %zu, "
      "rolled back %zu\n",
      o.max_norm > 0.0 ? "clipping on" : "no clipping", o.steps, speculated, committed,
      rolled_back);
  return run_resume_check(o, runs[0]);
}

}  // namespace stepcore_demo
