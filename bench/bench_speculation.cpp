// stepcore-bench-speculation: how much of the full-offload optimizer step an overlapped
// (speculative) step hides behind backward. OffloadGradientManager on the host device,
// AdamW, bf16 gradients and compute weights, f32 state, chunk_elements = N / 24 (29
// chunks at the default size: tensors are not split). Backward is simulated by this
// thread: the gradients are put in the manager's buffers first (a GPU's writes), then
// handed over with gradient_ready in backward order (last parameter first), each at its
// share of the backward time T_b by element count, sleeping in between (the CPU idle
// during backward, as on a GPU node). Measured: the serial step S (overlap off: from the
// final finish_backward to report()'s return) and, with overlap, the exposed time E over
// the same span for unclipped, clipped (rollback) and non-finite (skip) steps at
// T_b = 1.0 S and 2.0 S, and alternating clipped / unclipped steps under each policy.
// The overlapped steps are first validated bit for bit against a serial manager's.
// On the host device every copy is a CPU memcpy (its "DMA" competes with the engine for
// the cores); `cuda` runs the same on CUDA device 0, where the copies are DMA and the CPU
// is idle during backward, as a GPU trainer's step is. `staging on` gives the
// speculating manager device staging for every chunk's compute weights
// (ManagerConfig::speculation_device_bytes): a commit then copies device-to-device
// instead of uploading (default: on with cuda, off on the host device, where the staging
// uploads would be one more CPU memcpy during backward).
//
// Usage: stepcore-bench-speculation [million elements = 100] [steps per case = 3]
//                                   [host | cuda = host] [staging: on | off]
//                                   [backward unit in ms = S]
// The backward unit paces T_b (T_b/S = 1.0 is one unit) at a fixed duration instead of
// the measured S, so that two builds compare at the same backward duration.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "model_sizes.hpp"
#include "offload_stream.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cpu.hpp"
#include "stepcore/device.hpp"
#include "stepcore/managers.hpp"
#include "stepcore/numa.hpp"

namespace {

using namespace stepcore;

constexpr float kHugeNorm = 1e30f;  // never clips: speculated chunks commit
constexpr float kTinyNorm = 1e-6f;  // always clips (AdamW): speculated chunks roll back
constexpr int kTargetChunks = 24;

using namespace bench_offload;

double mean(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

// The model: tensor sizes and offsets and the gradients (bf16, the same every step), in
// pinned host memory of the device, from which each step copies them into the manager's
// gradient buffers (device memory) before backward's timed part.
struct Model {
  std::vector<std::size_t> sizes, offsets;
  std::size_t total = 0;
  std::uint16_t* grads = nullptr;  // total elements, pinned (Device::allocate_host)
  std::uint16_t* nan = nullptr;    // one pinned bf16 NaN
  std::size_t nan_param = 0;       // the parameter whose gradient gets a NaN in a skipped step
};

// One step's figures: from the final finish_backward to clip_grad_norm's return (the
// speculated chunks still running, and the norm: clip_grad_norm drains the worker), to
// report()'s return (E), and the manager's own exposed_seconds.
struct StepTimes {
  double drain = 0.0, exposed = 0.0, reported = 0.0;
  StepReport report;
};

enum class Kind { unclipped, clipped, skipped };

// One step of m: begin_step(scale, overlap), the final backward's gradients handed over
// over tb seconds, clip_grad_norm, step, report.
StepTimes run_step(GradientManager& m, device::Device& dev, const Model& model, int step,
                   bool overlap, double tb, Kind kind) {
  m.begin_step(scale_of(step), overlap);
  m.begin_backward(true);
  for (std::size_t k = 0; k < model.sizes.size(); ++k)
    dev.copy(device::Queue::h2d, m.gradient(k).data, model.grads + model.offsets[k],
             model.sizes[k] * 2);
  if (kind == Kind::skipped)
    dev.copy(device::Queue::h2d,
             static_cast<std::uint16_t*>(m.gradient(model.nan_param).data) +
                 model.sizes[model.nan_param] / 2,
             model.nan, 2);
  dev.synchronize(dev.record(device::Queue::h2d));
  const Clock::time_point t0 = Clock::now();
  std::size_t handed = 0;
  for (std::size_t k = model.sizes.size(); k-- > 0;) {
    handed += model.sizes[k];
    std::this_thread::sleep_until(
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                 tb * static_cast<double>(handed) / static_cast<double>(model.total))));
    m.gradient_ready(k);
  }
  StepTimes t;
  const Clock::time_point last = Clock::now();
  m.finish_backward();
  m.clip_grad_norm(kind == Kind::clipped ? kTinyNorm : kHugeNorm);
  t.drain = seconds_since(last);
  m.step();
  t.report = m.report();
  t.exposed = seconds_since(last);
  t.reported = t.report.exposed_seconds;
  return t;
}

std::unique_ptr<GradientManager> make_manager(const Model& model, device::Device& dev,
                                              Speculation policy, std::size_t chunk_elements,
                                              bool staging) {
  ManagerConfig cfg;
  cfg.mode = OffloadMode::full;
  AdamWConfig adamw;
  adamw.lr = 1e-4;
  adamw.weight_decay = 0.1;
  cfg.optimizer = adamw;
  for (std::size_t k = 0; k < model.sizes.size(); ++k)
    cfg.params.push_back(
        {"t" + std::to_string(k), model.sizes[k], DType::bf16, DType::bf16, true, true});
  cfg.chunk_elements = chunk_elements;
  cfg.speculation = policy;
  cfg.speculation_device_bytes = staging ? ManagerConfig::kAllChunks : 0;
  cfg.device = &dev;
  auto m = make_gradient_manager(cfg);
  std::vector<float> init;
  for (std::size_t k = 0; k < model.sizes.size(); ++k) {
    init.resize(model.sizes[k]);
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = 0.02f * unit(model.offsets[k] + j);
    m->load_parameter(k, init);
  }
  return m;
}

// True when every parameter's master, moments and compute weights are the same bits in a
// and b.
bool same_state(GradientManager& a, GradientManager& b, const Model& model) {
  std::vector<float> pa, ma, va, pb, mb, vb;
  std::vector<std::uint8_t> ca, cb;
  for (std::size_t k = 0; k < model.sizes.size(); ++k) {
    const std::size_t n = model.sizes[k];
    for (auto* v : {&pa, &ma, &va, &pb, &mb, &vb}) v->resize(n);
    ca.resize(2 * n);
    cb.resize(2 * n);
    a.read_parameter(k, pa, ma, va, ca);
    b.read_parameter(k, pb, mb, vb, cb);
    if (std::memcmp(pa.data(), pb.data(), 4 * n) != 0 ||
        std::memcmp(ma.data(), mb.data(), 4 * n) != 0 ||
        std::memcmp(va.data(), vb.data(), 4 * n) != 0 || ca != cb ||
        a.step_count(k) != b.step_count(k))
      return false;
  }
  return true;
}

const char* kind_name(Kind kind) {
  return kind == Kind::unclipped ? "unclipped (commit)"
         : kind == Kind::clipped ? "clipped (rollback)"
                                 : "non-finite (skip)";
}

void print_row(const char* name, double tb_over_s, double e, double reported, double drain,
               double s, std::size_t spec, std::size_t com, std::size_t rb, const char* target) {
  const std::string counts =
      std::to_string(spec) + "/" + std::to_string(com) + "/" + std::to_string(rb);
  char line[256];
  std::snprintf(line, sizeof line, "%-26s %5.1f %8.1f %8.1f %8.1f %8.1f %6.3f %6.1f%% %-11s %s",
                name, tb_over_s, 1e3 * e, 1e3 * reported, 1e3 * drain, 1e3 * (e - drain), e / s,
                100.0 * (1.0 - e / s), counts.c_str(), target);
  std::string row(line);
  row.erase(row.find_last_not_of(' ') + 1);
  std::printf("%s\n", row.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t millions = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 100;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;
  const std::string where = argc > 3 ? argv[3] : "host";
  const std::string staged = argc > 4 ? argv[4] : (where == "cuda" ? "on" : "off");
  const double unit_ms = argc > 5 ? std::atof(argv[5]) : 0.0;
  if (millions == 0 || reps < 1 || (where != "host" && where != "cuda") ||
      (staged != "on" && staged != "off") || !(unit_ms >= 0.0)) {
    std::fprintf(stderr,
                 "usage: %s [million elements] [steps per case] [host | cuda] [staging: on | "
                 "off] [backward unit ms]\n",
                 argv[0]);
    return 2;
  }
  const bool staging = staged == "on";
  std::unique_ptr<device::Device> dev;
  if (where == "host") {
    dev = device::make_host_device();
  } else {
    try {
      dev = device::make_cuda_device(0);
    } catch (const Error& e) {
      std::printf("stepcore-bench-speculation: skipped, no CUDA device: %s\n", e.what());
      return 0;
    }
  }
  Model model;
  model.sizes = bench::model_sizes(millions * 1000000);
  for (std::size_t n : model.sizes) {
    model.offsets.push_back(model.total);
    model.total += n;
  }
  model.nan_param = model.sizes.size() / 2;
  model.grads = static_cast<std::uint16_t*>(dev->allocate_host(2 * model.total));
  model.nan = static_cast<std::uint16_t*>(dev->allocate_host(2));
  *model.nan = 0x7FC0;
  for (std::size_t j = 0; j < model.total; ++j)
    model.grads[j] = f32_to_bf16_bits(0.01f * unit(std::uint64_t{7} << 40 ^ j));
  // Chunks as the manager forms them (consecutive parameters up to chunk_elements).
  const std::size_t chunk_elements = (model.total + kTargetChunks - 1) / kTargetChunks;
  std::vector<std::size_t> chunks;
  for (std::size_t n : model.sizes) {
    if (chunks.empty() || (chunks.back() != 0 && chunks.back() + n > chunk_elements))
      chunks.push_back(0);
    chunks.back() += n;
  }
  const cpu::Engine engine;
  std::printf(
      "stepcore-bench-speculation: %zu tensors, %.1f M elements, %zu chunks (chunk_elements "
      "%zu; the last to complete in backward: chunk 0, %.2f M elements), full offload, AdamW, "
      "bf16 gradients and compute weights, f32 state; engine %s, %d threads; %d step(s) per "
      "case; device %s, device staging %s\n",
      model.sizes.size(), model.total / 1e6, chunks.size(), chunk_elements, chunks[0] / 1e6,
      std::string(engine.isa_name()).c_str(), engine.threads(), reps,
      std::string(dev->name()).c_str(), staged.c_str());
  auto spec = make_manager(model, *dev, Speculation::always, chunk_elements, staging);
  int step = 0;

  // Validate: the overlapped steps (commit, rollback, skip) against a serial manager fed
  // the same gradients, every parameter's full state bit for bit after each.
  {
    auto serial = make_manager(model, *dev, Speculation::never, chunk_elements, false);
    for (Kind kind : {Kind::unclipped, Kind::clipped, Kind::skipped}) {
      const StepTimes o = run_step(*spec, *dev, model, step, true, 0.0, kind);
      const StepTimes s = run_step(*serial, *dev, model, step, false, 0.0, kind);
      ++step;
      const bool counts = o.report.chunks_speculated == chunks.size() &&
                          (kind == Kind::unclipped ? o.report.chunks_committed
                                                   : o.report.chunks_rolled_back) == chunks.size();
      if (!counts || !same_state(*spec, *serial, model) ||
          std::memcmp(&o.report.norm.norm, &s.report.norm.norm, 4) != 0 ||
          o.report.skipped != s.report.skipped) {
        std::fprintf(stderr,
                     "validation FAILED: the overlapped %s step differs from the serial one "
                     "(speculated %zu, committed %zu, rolled back %zu of %zu chunks)\n",
                     kind_name(kind), o.report.chunks_speculated, o.report.chunks_committed,
                     o.report.chunks_rolled_back, chunks.size());
        return 1;
      }
    }
    serial->close();
  }
  std::printf(
      "validated: overlapped unclipped, clipped and skipped steps bit-identical to "
      "the serial manager's (full state)\n");

  // S: the serial step, its gradients paced over the first estimate of S.
  const double s0 = run_step(*spec, *dev, model, step++, false, 0.0, Kind::unclipped).exposed;
  std::vector<double> ts, tr, td;
  for (int r = 0; r < reps; ++r) {
    const StepTimes t = run_step(*spec, *dev, model, step++, false, s0, Kind::unclipped);
    ts.push_back(t.exposed);
    tr.push_back(t.reported);
    td.push_back(t.drain);
  }
  const double s = median(ts);
  const double pace = unit_ms > 0.0 ? unit_ms / 1e3 : s;  // what T_b/S = 1.0 paces
  if (unit_ms > 0.0) std::printf("backward unit: %.1f ms (S %.1f ms)\n", unit_ms, s * 1e3);
  std::printf(
      "E: from the final finish_backward to report()'s return; rep: report().exposed_seconds; "
      "drain: to clip_grad_norm's return (the worker's queued chunk steps, the norm); decide: "
      "step() + report() (commit and uploads, or re-steps); medians of %d step(s), alternating "
      "rows: means of 8\n",
      reps);
  std::printf("%-26s %5s %8s %8s %8s %8s %6s %7s %-11s %s\n", "case", "T_b/S", "E ms", "rep ms",
              "drain ms", "decide", "E/S", "hidden", "spec/com/rb", "target");
  print_row("serial (overlap off)", 1.0, s, median(tr), median(td), s, 0, 0, 0, "");

  int misses = 0;
  for (double f : {1.0, 2.0}) {
    for (Kind kind : {Kind::unclipped, Kind::clipped, Kind::skipped}) {
      std::vector<double> e, rep, drain;
      StepReport last;
      for (int r = 0; r < reps; ++r) {
        const StepTimes t = run_step(*spec, *dev, model, step++, true, f * pace, kind);
        e.push_back(t.exposed);
        rep.push_back(t.reported);
        drain.push_back(t.drain);
        last = t.report;
      }
      const double ratio = median(e) / s, limit = kind == Kind::unclipped ? 0.15 : 1.15;
      char target[64];
      std::snprintf(target, sizeof target, "E/S <= %.2f %s", limit,
                    ratio <= limit ? "PASS" : "MISS");
      misses += ratio > limit;
      print_row(kind_name(kind), f, median(e), median(rep), median(drain), s,
                last.chunks_speculated, last.chunks_committed, last.chunks_rolled_back, target);
    }
  }

  // Alternating clipped / unclipped steps under each policy (T_b = 2 S), after a warm-up
  // step that reserves and touches the rollback space.
  constexpr int kAlternating = 8;
  constexpr double kAlternatingTb = 2.0;
  for (Speculation policy : {Speculation::always, Speculation::never, Speculation::automatic}) {
    // One manager at a time (each holds ~36 bytes per element).
    std::unique_ptr<GradientManager> owned =
        policy == Speculation::always ? std::move(spec)
                                      : make_manager(model, *dev, policy, chunk_elements, staging);
    GradientManager& m = *owned;
    (void)run_step(m, *dev, model, step++, true, 0.0, Kind::unclipped);
    std::vector<double> e, rep, drain;
    std::size_t sp = 0, co = 0, rb = 0;
    for (int r = 0; r < kAlternating; ++r) {
      const StepTimes t = run_step(m, *dev, model, step++, true, kAlternatingTb * pace,
                                   r % 2 == 0 ? Kind::clipped : Kind::unclipped);
      e.push_back(t.exposed);
      rep.push_back(t.reported);
      drain.push_back(t.drain);
      sp += t.report.chunks_speculated;
      co += t.report.chunks_committed;
      rb += t.report.chunks_rolled_back;
    }
    const std::string name = "alternating x" + std::to_string(kAlternating) + ", " +
                             std::string(speculation_name(policy));
    print_row(name.c_str(), kAlternatingTb, mean(e), mean(rep), mean(drain), s, sp, co, rb,
              "(mean)");
    m.close();
  }

  // The parts of an unclipped step's E, measured bare: the last chunk's speculative
  // (out-of-place) step and an in-place one, and the commit's uploads of every compute
  // weight, one copy per parameter on the host device's h2d queue (one thread's memcpy)
  // from pinned memory, as the manager's commit enqueues them.
  const std::size_t n0 = chunks[0];
  const std::size_t kf = 4 * n0;
  numa::HostBuffer src(3 * kf), dst(3 * kf), acc(kf), out(2 * n0);
  auto f32 = [](const numa::HostBuffer& b, std::size_t at, std::size_t n) {
    return TensorView{static_cast<float*>(b.data()) + at, n, DType::f32};
  };
  for (std::size_t j = 0; j < n0; ++j) {
    static_cast<float*>(src.data())[j] = 0.02f * unit(j);
    static_cast<float*>(acc.data())[j] = bf16_bits_to_f32(model.grads[j]);
  }
  std::memset(static_cast<float*>(src.data()) + n0, 0, 2 * kf);
  std::memset(dst.data(), 0, 3 * kf);
  AdamWConfig adamw;
  adamw.lr = 1e-4;
  adamw.weight_decay = 0.1;
  std::vector<double> t_out, t_in, t_up, t_d2d;
  auto* pinned = static_cast<std::uint16_t*>(dev->allocate_host(2 * model.total));
  auto* device_weights = static_cast<std::uint16_t*>(dev->allocate(2 * model.total));
  auto* device_staging = static_cast<std::uint16_t*>(dev->allocate(2 * model.total));
  std::memcpy(pinned, model.grads, 2 * model.total);
  for (int r = 0; r < 5; ++r) {
    float steps = 0.0f;
    OptimizerTensor t{f32(dst, 0, n0),
                      {f32(dst, n0, n0), f32(dst, 2 * n0, n0)},
                      &steps,
                      f32(acc, 0, n0),
                      {out.data(), n0, DType::bf16}};
    t.param_src = f32(src, 0, n0);
    t.state_src[0] = f32(src, n0, n0);
    t.state_src[1] = f32(src, 2 * n0, n0);
    auto tc = Clock::now();
    engine.step({&t, 1}, adamw, {scale_of(0), 1.0f});
    t_out.push_back(seconds_since(tc));
    OptimizerTensor in{f32(src, 0, n0),
                       {f32(src, n0, n0), f32(src, 2 * n0, n0)},
                       &steps,
                       f32(acc, 0, n0),
                       {out.data(), n0, DType::bf16}};
    tc = Clock::now();
    engine.step({&in, 1}, adamw, {scale_of(0), 1.0f});
    t_in.push_back(seconds_since(tc));
    tc = Clock::now();
    for (std::size_t k = 0; k < model.sizes.size(); ++k)
      dev->copy(device::Queue::h2d, device_weights + model.offsets[k], pinned + model.offsets[k],
                2 * model.sizes[k]);
    dev->record(device::Queue::h2d).wait();
    t_up.push_back(seconds_since(tc));
    tc = Clock::now();  // the commit from device staging: device-to-device, per parameter
    for (std::size_t k = 0; k < model.sizes.size(); ++k)
      dev->copy(device::Queue::h2d, device_staging + model.offsets[k],
                device_weights + model.offsets[k], 2 * model.sizes[k]);
    dev->record(device::Queue::h2d).wait();
    t_d2d.push_back(seconds_since(tc));
  }
  dev->deallocate(device_staging);
  dev->deallocate(device_weights);
  dev->deallocate_host(pinned);
  dev->deallocate_host(model.nan);
  dev->deallocate_host(model.grads);
  const double last_out = median(t_out), last_in = median(t_in), up = median(t_up),
               d2d = median(t_d2d), commit = staging ? d2d : up;
  std::printf(
      "parts (bare): the last chunk's step %.1f ms out of place (speculative), %.1f ms in "
      "place (x%.2f); the commit's copies (%.0f MB): uploads %.1f ms, from device staging "
      "%.1f ms; the last step and the commit's copies%s together %.1f ms = %.3f S\n",
      1e3 * last_out, 1e3 * last_in, last_out / last_in, 2.0 * model.total / 1e6, 1e3 * up,
      1e3 * d2d, staging ? " (staged)" : " (uploads)", 1e3 * (last_out + commit),
      (last_out + commit) / s);
  std::printf("targets: %d missed (a benchmark reports; it does not fail)\n", misses);
  return 0;
}
