// stepcore-bench-offload: the full-offload manager's per-step cost beyond the CPU
// optimizer itself. A whole step (begin_step .. gradient_ready per parameter and
// micro-batch .. clip_grad_norm .. step .. report) of OffloadGradientManager on the host
// device, against the bare engine calls on the same sizes (accumulate per micro-batch,
// norm, AdamW with the bf16 compute copy). The manager's first step is validated bit for
// bit against the bare calls before anything is timed.
//
// Usage: stepcore-bench-offload [million elements = 100] [micro-batches = 1] [steps = 5]
//                              [ring slot elements = ManagerConfig's default]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
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

constexpr float kMaxNorm = 1.0f;

using namespace bench_offload;

// The bare engine path: acc, p, m, v (f32), the gradients (bf16) and the compute copy.
struct Bare {
  std::vector<std::size_t> sizes, offsets;
  std::size_t total = 0;
  numa::HostBuffer acc, p, m, v, out;
  std::vector<std::uint16_t*> grads;  // per micro-batch, the same gradients as the manager's
  std::vector<float> steps;

  Bare(const std::vector<std::size_t>& s, std::size_t total_elements)
      : sizes(s),
        total(total_elements),
        acc(total * 4),
        p(total * 4),
        m(total * 4),
        v(total * 4),
        out(total * 2) {
    std::size_t o = 0;
    for (std::size_t n : sizes) {
      offsets.push_back(o);
      o += n;
    }
    steps.assign(sizes.size(), 0.0f);
  }
  float* f(const numa::HostBuffer& b) const { return static_cast<float*>(b.data()); }

  void step(const cpu::Engine& engine, const AdamWConfig& cfg, float scale, NormResult& norm) {
    for (std::size_t mb = 0; mb < grads.size(); ++mb) {
      std::vector<AccumulatePair> pairs;
      for (std::size_t k = 0; k < sizes.size(); ++k)
        pairs.push_back({{f(acc) + offsets[k], sizes[k], DType::f32},
                         {grads[mb] + offsets[k], sizes[k], DType::bf16},
                         mb == 0});
      engine.accumulate(pairs);
    }
    std::vector<ConstTensorView> accs;
    for (std::size_t k = 0; k < sizes.size(); ++k)
      accs.push_back({f(acc) + offsets[k], sizes[k], DType::f32});
    norm = engine.norm(accs, {scale, 1.0f});
    const float clip = clip_coefficient(norm.norm, kMaxNorm);
    std::vector<OptimizerTensor> t;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const std::size_t o = offsets[k], n = sizes[k];
      t.push_back({{f(p) + o, n, DType::f32},
                   {TensorView{f(m) + o, n, DType::f32}, TensorView{f(v) + o, n, DType::f32}},
                   &steps[k],
                   {f(acc) + o, n, DType::f32},
                   {static_cast<std::uint16_t*>(out.data()) + o, n, DType::bf16}});
    }
    engine.step(t, cfg, {scale, clip});
  }
};

}  // namespace

int main(int argc, char** argv) {
  const std::size_t millions = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 100;
  const int micro = argc > 2 ? std::atoi(argv[2]) : 1;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 5;
  const std::size_t ring_elements =
      argc > 4 ? std::strtoul(argv[4], nullptr, 10) : ManagerConfig{}.ring_slot_elements;
  if (millions == 0 || micro < 1 || steps < 1 || ring_elements == 0) {
    std::fprintf(stderr,
                 "usage: %s [million elements] [micro-batches] [steps] [ring slot elements]\n",
                 argv[0]);
    return 2;
  }
  const std::vector<std::size_t> sizes = bench::model_sizes(millions * 1000000);
  std::size_t total = 0;
  for (std::size_t n : sizes) total += n;

  const cpu::Engine engine;
  AdamWConfig adamw;
  adamw.lr = 1e-4;
  adamw.weight_decay = 0.1;
  std::printf(
      "stepcore-bench-offload: %zu tensors, %.1f M elements, %d micro-batch(es), "
      "bf16 gradients and compute weights, AdamW, clip %.1f; engine %s, %d threads; ring slots "
      "of %zu elements\n",
      sizes.size(), total / 1e6, micro, kMaxNorm, std::string(engine.isa_name()).c_str(),
      engine.threads(), ring_elements);

  // The manager on the host device.
  auto dev = device::make_host_device();
  ManagerConfig cfg;
  cfg.mode = OffloadMode::full;
  cfg.optimizer = adamw;
  for (std::size_t k = 0; k < sizes.size(); ++k)
    cfg.params.push_back({"t" + std::to_string(k), sizes[k], DType::bf16, DType::bf16, true, true});
  cfg.device = dev.get();
  cfg.ring_slot_elements = ring_elements;
  auto t0 = Clock::now();
  auto mgr = make_gradient_manager(cfg);
  const double construct_s = seconds_since(t0);

  Bare bare(sizes, total);
  t0 = Clock::now();
  {
    std::vector<float> init;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      init.resize(sizes[k]);
      const std::size_t o = bare.offsets[k];
#pragma omp parallel for schedule(static)
      for (std::size_t j = 0; j < sizes[k]; ++j) init[j] = 0.02f * unit(o + j);
      mgr->load_parameter(k, init);
      std::memcpy(bare.f(bare.p) + o, init.data(), sizes[k] * 4);
    }
  }
  // The gradients of each micro-batch, the same for both paths and every step.
  std::vector<std::vector<std::uint16_t>> grads(micro, std::vector<std::uint16_t>(total));
  for (int mb = 0; mb < micro; ++mb) {
    bare.grads.push_back(grads[mb].data());
#pragma omp parallel for schedule(static)
    for (std::size_t j = 0; j < total; ++j)
      grads[mb][j] = f32_to_bf16_bits(0.01f * unit((std::uint64_t{7} + mb) << 40 ^ j));
  }
  const double setup_s = seconds_since(t0);

  // One manager step; micro-batch mb's gradients are copied into the device buffers
  // before that micro-batch's hooks (backward's work: subtracted from the step's time).
  auto manager_step = [&](int s, bool overlap) {
    double inside = 0.0;
    auto tstep = Clock::now();
    mgr->begin_step(scale_of(s), overlap);
    for (int mb = 0; mb < micro; ++mb) {
      mgr->begin_backward(mb == micro - 1);
      {  // backward writes the gradients: not the manager's time
        const auto tc = Clock::now();
        for (std::size_t k = 0; k < sizes.size(); ++k)
          std::memcpy(mgr->gradient(k).data, grads[mb].data() + bare.offsets[k], sizes[k] * 2);
        inside += seconds_since(tc);
      }
      for (std::size_t k = sizes.size(); k-- > 0;) mgr->gradient_ready(k);
      mgr->finish_backward();
    }
    if (!overlap) mgr->clip_grad_norm(kMaxNorm);
    mgr->step();
    const StepReport r = mgr->report();
    return std::make_pair(seconds_since(tstep) - inside, r);
  };
  // Validate: the first step of both paths must give the same norm and parameters.
  NormResult bare_norm;
  bare.step(engine, adamw, scale_of(0), bare_norm);
  const StepReport first = manager_step(0, false).second;
  bool ok = first.stepped && std::memcmp(&first.norm.norm, &bare_norm.norm, 4) == 0;
  {
    std::vector<float> p, mm, vv;
    std::vector<std::uint8_t> c;
    for (std::size_t k = 0; k < sizes.size() && ok; ++k) {
      const std::size_t n = sizes[k], o = bare.offsets[k];
      p.resize(n);
      mm.resize(n);
      vv.resize(n);
      c.resize(n * 2);
      mgr->read_parameter(k, p, mm, vv, c);
      ok = std::memcmp(p.data(), bare.f(bare.p) + o, n * 4) == 0 &&
           std::memcmp(mm.data(), bare.f(bare.m) + o, n * 4) == 0 &&
           std::memcmp(vv.data(), bare.f(bare.v) + o, n * 4) == 0 &&
           std::memcmp(c.data(), static_cast<std::uint16_t*>(bare.out.data()) + o, n * 2) == 0;
    }
  }
  if (!ok) {
    std::fprintf(stderr, "validation FAILED: the manager's step differs from the engine's\n");
    return 1;
  }
  std::printf(
      "validated: step 1 bit-identical (norm %.6g, clip %.6g); construct %.2f s, "
      "load + setup %.2f s\n",
      first.norm.norm, first.clip_coefficient, construct_s, setup_s);

  // Time: alternate bare and manager steps so the VM's drift hits both alike.
  std::vector<double> t_bare, t_mgr, t_overlap, t_wait;
  for (int s = 1; s <= steps; ++s) {
    NormResult n;
    const auto tb = Clock::now();
    bare.step(engine, adamw, scale_of(s), n);
    t_bare.push_back(seconds_since(tb));
    const auto [seconds, report] = manager_step(s, false);
    t_mgr.push_back(seconds);
    t_wait.push_back(report.staging_wait_seconds);
    t_overlap.push_back(manager_step(s, true).first);
  }
  const MemoryReport memory = mgr->memory();
  mgr->close();
  // What the host device's copies cost by themselves: one thread memcpy of the gradient
  // bytes (D2H) and of the compute-weight bytes (H2D) per micro-batch / step. On a GPU
  // these are DMA transfers overlapping the CPU; here they take CPU time and bandwidth.
  std::vector<std::uint16_t> sink(total);
  std::vector<double> t_copy;
  for (int r = 0; r < 3; ++r) {
    const auto tc = Clock::now();
    for (int mb = 0; mb < micro; ++mb) std::memcpy(sink.data(), grads[mb].data(), total * 2);
    std::memcpy(grads[0].data(), sink.data(), total * 2);
    t_copy.push_back(seconds_since(tc));
  }
  const double b = median(t_bare), m = median(t_mgr), o = median(t_overlap);
  std::printf("%-44s %9s %9s %9s\n", "per step (median of runs), seconds", "median", "min",
              "overhead");
  std::printf("%-44s %9.4f %9.4f %9s\n", "bare engine: accumulate + norm + AdamW", b,
              *std::min_element(t_bare.begin(), t_bare.end()), "-");
  std::printf("%-44s %9.4f %9.4f %8.1f%%\n", "manager, clip_grad_norm, no overlap", m,
              *std::min_element(t_mgr.begin(), t_mgr.end()), 100.0 * (m - b) / b);
  std::printf("%-44s %9.4f %9.4f %8.1f%%\n", "manager, overlap (no clip)", o,
              *std::min_element(t_overlap.begin(), t_overlap.end()), 100.0 * (o - b) / b);
  std::printf("overhead per step: %.1f ms (no overlap), %.1f ms (overlap); %.2f ns/element\n",
              1e3 * (m - b), 1e3 * (o - b), 1e9 * (m - b) / static_cast<double>(total));
  std::printf("of which the host device's copies alone (1-thread memcpy D2H + H2D): %.1f ms\n",
              1e3 * median(t_copy));
  // Backward here hands every gradient over at once, so the CPU is always behind it: the
  // most a full staging ring can hold backward back.
  std::printf(
      "backward held by a full staging ring (no overlap): %.1f ms per step (%.1f MiB of "
      "rings, host memory %.2f B/element, peak %.2f)\n",
      1e3 * median(t_wait),
      static_cast<double>(memory.kind("staging").bytes + memory.kind("upload").bytes +
                          memory.kind("fetch").bytes) /
          (1 << 20),
      static_cast<double>(memory.host_bytes) / static_cast<double>(total),
      static_cast<double>(memory.host_peak) / static_cast<double>(total));
  return 0;
}
