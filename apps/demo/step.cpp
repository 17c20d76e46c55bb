// stepcore-demo's training step: the phases of one step through the backend, each
// printed with its time and bandwidth, the found-inf skip, and the untimed reference
// run on the shadow.
#include "step.hpp"

#include <cinttypes>
#include <cstdio>
#include <string>
#include <vector>

#include "stepcore/error.hpp"
#include "synthetic.hpp"

namespace stepcore_demo {

namespace {

/// Returns the backend without an engine: stepcore::reference, which a checked step
/// runs on the shadow's copy.
const Backend& reference_backend() {
  static const Backend reference;
  return reference;
}

/// Runs the optimizer of `o` over the calls `c` with the gradient read `read` and the
/// schedule's lr of `step`, through `b`, once per weight-decay group.
void optimizer_step(const Calls& c, const Options& o, const Backend& b, sc::GradientRead read,
                    std::int64_t step) {
  const double lr = scheduled_lr(o.lr, step, o.steps);
  for (int g = 0; g < 2; ++g) {
    const double wd = g == 0 ? o.weight_decay : 0.0;
    if (o.optimizer == Optimizer::adamw) {
      sc::AdamWConfig cfg;
      cfg.lr = lr;
      cfg.formula = o.formula;
      set_torch_build(cfg, o.torch_aarch64);
      cfg.weight_decay = wd;
      b.step(c.optimizer[g], cfg, read);
    } else {
      sc::SignSgdConfig cfg;
      cfg.lr = lr;
      cfg.weight_decay = wd;
      b.step(c.optimizer[g], cfg, read);
    }
  }
}

/// Returns the clip coefficient of `norm` under the options (1 without clipping).
float clip_of(const Options& o, float norm) {
  return o.max_norm > 0.0 ? sc::clip_coefficient(norm, static_cast<float>(o.max_norm)) : 1.0f;
}

}  // namespace

StepOutcome run_step(const Model& m, State& s, const Calls& c, const Options& o, const Backend& b,
                     std::int64_t step, Totals& totals, Shadow* shadow) {
  const std::vector<std::int64_t> tokens = micro_batch_tokens(o.seed, step, o.micro_batches);
  std::int64_t total_tokens = 0;
  std::string split;
  for (const std::int64_t n : tokens) {
    total_tokens += n;
    if (tokens.size() <= 8) split += (split.empty() ? "" : "+") + std::to_string(n);
  }
  // The step's gradient scale: 1 / loss tokens, a Python double narrowed to f32.
  const float scale = static_cast<float>(1.0 / static_cast<double>(total_tokens));
  std::printf("step %" PRId64 "/%" PRId64 ": %" PRId64 " loss tokens in %" PRId64
              " micro-batches%s%s%s, scale %s, lr %.4g\n",
              step + 1, o.steps, total_tokens, o.micro_batches, split.empty() ? "" : " (",
              split.c_str(), split.empty() ? "" : ")", f32_text(scale).c_str(),
              scheduled_lr(o.lr, step, o.steps));

  // Micro-batches: generate (not a stepcore phase), then accumulate.
  const double n = static_cast<double>(m.numel);
  const std::vector<double> stddev =
      grad_sigmas(m.layout, m.config.tied_embeddings, tokens, target_norm(o.seed, step));
  double gen_s = 0.0, acc_s = 0.0, acc_bytes = 0.0;
  std::string injected;
  for (std::int64_t k = 0; k < o.micro_batches; ++k) {
    std::vector<double> sd(stddev);
    for (double& v : sd) v *= static_cast<double>(tokens[static_cast<std::size_t>(k)]);
    auto t0 = Clock::now();
    fill_micro_batch(m, s, o, step, k, sd, b.threads());
    if (o.inject_inf == step + 1 && k == o.micro_batches - 1) injected = inject_inf(m, s, o);
    gen_s += seconds_since(t0);
    t0 = Clock::now();
    b.accumulate(k == 0 ? c.first : c.rest);
    acc_s += seconds_since(t0);
    acc_bytes += n * static_cast<double>(sc::dtype_size(o.grad_dtype)) + n * (k == 0 ? 4.0 : 8.0);
    if (shadow) {  // the same micro-batch into the reference's accumulators
      t0 = Clock::now();
      reference_backend().accumulate(k == 0 ? shadow->calls.first : shadow->calls.rest);
      shadow->seconds += seconds_since(t0);
    }
  }
  const int gen_threads = b.threads();
  print_phase("generate", gen_s, 0.0,
              std::string("synthetic ") + (o.grad_dtype == sc::DType::bf16 ? "bf16" : "f32") +
                  " gradients on " + std::to_string(gen_threads) +
                  (gen_threads == 1 ? " thread" : " threads") +
                  " (input synthesis, not a stepcore phase)" +
                  (injected.empty() ? "" : "; +Inf injected at " + injected));
  print_phase("accumulate", acc_s, acc_bytes, "into f32 accumulators (copy, then add)");

  // Exact global norm of the scaled gradients.
  const sc::GradientRead unclipped{scale, 1.0f};
  auto t0 = Clock::now();
  StepOutcome out;
  out.norm = b.norm(c.accs, unclipped);
  const sc::NormResult& r = out.norm;
  const double norm_s = seconds_since(t0);
  if (r.needs_exact)  // Engine::norm and the exact reference never leave this set
    throw sc::Error(sc::Errc::internal, "norm", "backend returned an uncertified norm");
  if (shadow) {  // the reference's own norm, clip and optimizer step on the copy
    t0 = Clock::now();
    shadow->norm = reference_backend().norm(shadow->calls.accs, unclipped);
    if (shadow->norm.finite) {
      shadow->clip = clip_of(o, shadow->norm.norm);
      optimizer_step(shadow->calls, o, reference_backend(), sc::GradientRead{scale, shadow->clip},
                     step);
      shadow->applied = true;
    }
    shadow->seconds += seconds_since(t0);
  }
  print_phase("norm", norm_s, 4.0 * n,
              "norm " + f32_text(r.norm) + "  max|g| " + f32_text(r.max_abs));
  totals.phases += acc_s + norm_s;
  if (!r.finite) {
    if (r.nan_count + r.inf_count > 0)
      std::printf("  found-inf  %" PRIu64 " NaN and %" PRIu64 " Inf gradient values", r.nan_count,
                  r.inf_count);
    else
      std::printf("  found-inf  the norm overflows f32");
    std::printf(": optimizer step SKIPPED, parameters and moments unchanged\n");
    ++totals.skipped;
    return out;
  }

  out.clip = clip_of(o, r.norm);
  const bool clipped = out.clip < 1.0f;
  std::printf("  clip       coefficient %s  %s\n", f32_text(out.clip).c_str(),
              o.max_norm > 0.0 ? (clipped ? "-> clipped" : "-> not clipped") : "(clipping off)");
  totals.clipped += clipped ? 1 : 0;

  t0 = Clock::now();
  optimizer_step(c, o, b, sc::GradientRead{scale, out.clip}, step);
  const double opt_s = seconds_since(t0);
  if (o.optimizer == Optimizer::adamw)
    print_phase("adamw", opt_s, 30.0 * n, "f32 params + moments in place, bf16 compute weights");
  else
    print_phase("sign_sgd", opt_s, 14.0 * n, "f32 params in place, bf16 compute weights");
  out.applied = true;
  totals.phases += opt_s;
  ++totals.applied;
  return out;
}

}  // namespace stepcore_demo
