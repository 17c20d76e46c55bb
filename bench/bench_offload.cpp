// stepcore-bench-offload: the full-offload manager's per-step cost beyond the CPU
// optimizer itself. A whole step (begin_step .. gradient_ready per parameter and
// micro-batch .. clip_grad_norm .. step .. report) of OffloadGradientManager on the host
// device, against the bare engine calls on the same sizes (accumulate per micro-batch,
// norm, AdamW with the bf16 compute copy). The manager's first step is validated bit for
// bit against the bare calls before anything is timed.
//
// With "q8" as the fifth argument, the same run also times both paths with AdamW's state in
// block-wise 8 bits (ManagerConfig::q8_state; the bare calls with 8-bit slots), validated
// the same way, alternating with the f32 paths: the 8-bit step against the f32 step.
//
// Usage: stepcore-bench-offload [million elements = 100] [micro-batches = 1] [steps = 5]
//                              [ring slot elements = ManagerConfig's default] [q8]
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

// The bare engine path: acc, p, m, v (f32, or with `q8` for tensors of at least
// kMin8bit elements 8-bit codes and block maxima, laid out tensor after tensor), the
// gradients (bf16) and the compute copy.
constexpr std::size_t kMin8bit = 4096;  // ManagerConfig::min_8bit_size
struct Bare {
  std::vector<std::size_t> sizes, offsets, block_offsets;
  std::size_t total = 0;
  bool q8 = false;
  numa::HostBuffer acc, p, m, v, out, m_codes, v_codes, m_max, v_max;
  std::vector<std::uint16_t*> grads;  // per micro-batch, the same gradients as the manager's
  std::vector<float> steps;

  Bare(const std::vector<std::size_t>& s, std::size_t total_elements, bool eight_bit)
      : sizes(s),
        total(total_elements),
        q8(eight_bit),
        acc(total * 4),
        p(total * 4),
        m(total * 4),
        v(total * 4),
        out(total * 2),
        m_codes(eight_bit ? total : 1),
        v_codes(eight_bit ? total : 1),
        m_max(eight_bit ? 4 * (total / kQ8BlockSize + s.size()) : 4),
        v_max(eight_bit ? 4 * (total / kQ8BlockSize + s.size()) : 4) {
    std::size_t o = 0, b = 0;
    for (std::size_t n : sizes) {
      offsets.push_back(o);
      block_offsets.push_back(b);
      o += n;
      b += q8_blocks(n);
    }
    steps.assign(sizes.size(), 0.0f);
    std::memset(m.data(), 0, total * 4);
    std::memset(v.data(), 0, total * 4);
    if (q8) {  // 0 in 8 bits: the zero codes, maxima 0 (the manager's start)
      std::memset(m_codes.data(), 127, total);
      std::memset(v_codes.data(), 0, total);
      std::memset(m_max.data(), 0, 4 * b);
      std::memset(v_max.data(), 0, 4 * b);
    }
  }
  bool eight_bit(std::size_t k) const { return q8 && sizes[k] >= kMin8bit; }
  std::uint8_t* codes(const numa::HostBuffer& b, std::size_t k) const {
    return static_cast<std::uint8_t*>(b.data()) + offsets[k];
  }
  float* maxima(const numa::HostBuffer& b, std::size_t k) const {
    return static_cast<float*>(b.data()) + block_offsets[k];
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
      OptimizerTensor x{{f(p) + o, n, DType::f32}};
      if (eight_bit(k)) {
        x.q8[0] = {codes(m_codes, k), maxima(m_max, k)};
        x.q8[1] = {codes(v_codes, k), maxima(v_max, k)};
      } else {
        x.state[0] = {f(m) + o, n, DType::f32};
        x.state[1] = {f(v) + o, n, DType::f32};
      }
      x.step = &steps[k];
      x.grad = {f(acc) + o, n, DType::f32};
      x.compute_param = {static_cast<std::uint16_t*>(out.data()) + o, n, DType::bf16};
      t.push_back(x);
    }
    engine.step(t, cfg, {scale, clip});
  }

  // True when the manager's parameter k equals this path's (master, moments, compute).
  bool same_as(GradientManager& mgr, std::size_t k) const {
    const std::size_t n = sizes[k], o = offsets[k];
    const bool e8 = eight_bit(k);
    if (e8 != mgr.q8_parameter(k)) return false;
    std::vector<float> pp(n), mm(e8 ? 0 : n), vv(e8 ? 0 : n), ma(e8 ? q8_blocks(n) : 0),
        va(ma.size());
    std::vector<std::uint8_t> c(n * 2), mc(e8 ? n : 0), vc(e8 ? n : 0);
    const SlotOut slots[] = {{"exp_avg", mm, mc, ma}, {"exp_avg_sq", vv, vc, va}};
    mgr.read_parameter(k, pp, slots, c);
    bool ok = std::memcmp(pp.data(), f(p) + o, n * 4) == 0 &&
              std::memcmp(c.data(), static_cast<std::uint16_t*>(out.data()) + o, n * 2) == 0;
    if (e8)
      return ok && std::memcmp(mc.data(), codes(m_codes, k), n) == 0 &&
             std::memcmp(vc.data(), codes(v_codes, k), n) == 0 &&
             std::memcmp(ma.data(), maxima(m_max, k), ma.size() * 4) == 0 &&
             std::memcmp(va.data(), maxima(v_max, k), va.size() * 4) == 0;
    return ok && std::memcmp(mm.data(), f(m) + o, n * 4) == 0 &&
           std::memcmp(vv.data(), f(v) + o, n * 4) == 0;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const std::size_t millions = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 100;
  const int micro = argc > 2 ? std::atoi(argv[2]) : 1;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 5;
  const std::size_t ring_elements =
      argc > 4 ? std::strtoul(argv[4], nullptr, 10) : ManagerConfig{}.ring_slot_elements;
  const bool with_q8 = argc > 5 && std::string(argv[5]) == "q8";
  if (millions == 0 || micro < 1 || steps < 1 || ring_elements == 0 || (argc > 5 && !with_q8)) {
    std::fprintf(stderr,
                 "usage: %s [million elements] [micro-batches] [steps] [ring slot elements] "
                 "[q8]\n",
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
      "of %zu elements%s\n",
      sizes.size(), total / 1e6, micro, kMaxNorm, std::string(engine.isa_name()).c_str(),
      engine.threads(), ring_elements, with_q8 ? "; f32 and 8-bit state" : "");

  // The gradients of each micro-batch, the same for every path and every step.
  auto t0 = Clock::now();
  std::vector<std::vector<std::uint16_t>> grads(micro, std::vector<std::uint16_t>(total));
  for (int mb = 0; mb < micro; ++mb) {
#pragma omp parallel for schedule(static)
    for (std::size_t j = 0; j < total; ++j)
      grads[mb][j] = f32_to_bf16_bits(0.01f * unit((std::uint64_t{7} + mb) << 40 ^ j));
  }
  const double grads_s = seconds_since(t0);

  // A state kind's two paths: the manager on the host device and the bare engine calls.
  auto dev = device::make_host_device();
  struct Path {
    bool q8 = false;
    std::unique_ptr<GradientManager> mgr;
    std::unique_ptr<Bare> bare;
    std::vector<double> t_bare, t_mgr, t_overlap, t_wait;
    MemoryReport memory;
  };
  std::vector<Path> paths(with_q8 ? 2 : 1);
  for (std::size_t k = 0; k < paths.size(); ++k) {
    Path& path = paths[k];
    path.q8 = k == 1;
    ManagerConfig cfg;
    cfg.mode = OffloadMode::full;
    cfg.optimizer = adamw;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      cfg.params.push_back(
          {"t" + std::to_string(t), sizes[t], DType::bf16, DType::bf16, true, true});
    cfg.device = dev.get();
    cfg.ring_slot_elements = ring_elements;
    cfg.q8_state = path.q8;
    cfg.min_8bit_size = kMin8bit;
    t0 = Clock::now();
    path.mgr = make_gradient_manager(cfg);
    const double construct_s = seconds_since(t0);
    path.bare = std::make_unique<Bare>(sizes, total, path.q8);
    Bare& bare = *path.bare;
    for (int mb = 0; mb < micro; ++mb) bare.grads.push_back(grads[mb].data());
    t0 = Clock::now();
    std::vector<float> init;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      init.resize(sizes[t]);
      const std::size_t o = bare.offsets[t];
#pragma omp parallel for schedule(static)
      for (std::size_t j = 0; j < sizes[t]; ++j) init[j] = 0.02f * unit(o + j);
      path.mgr->load_parameter(t, init);
      std::memcpy(bare.f(bare.p) + o, init.data(), sizes[t] * 4);
    }
    std::printf("%s state: construct %.2f s, load %.2f s (gradients %.2f s)\n",
                path.q8 ? "8-bit" : "f32", construct_s, seconds_since(t0), grads_s);
  }

  // One manager step; micro-batch mb's gradients are copied into the device buffers
  // before that micro-batch's hooks (backward's work: subtracted from the step's time).
  auto manager_step = [&](GradientManager& mgr, int s, bool overlap) {
    double inside = 0.0;
    auto tstep = Clock::now();
    mgr.begin_step(scale_of(s), overlap);
    for (int mb = 0; mb < micro; ++mb) {
      mgr.begin_backward(mb == micro - 1);
      {  // backward writes the gradients: not the manager's time
        const auto tc = Clock::now();
        for (std::size_t k = 0; k < sizes.size(); ++k)
          std::memcpy(mgr.gradient(k).data, grads[mb].data() + paths[0].bare->offsets[k],
                      sizes[k] * 2);
        inside += seconds_since(tc);
      }
      for (std::size_t k = sizes.size(); k-- > 0;) mgr.gradient_ready(k);
      mgr.finish_backward();
    }
    if (!overlap) mgr.clip_grad_norm(kMaxNorm);
    mgr.step();
    const StepReport r = mgr.report();
    return std::make_pair(seconds_since(tstep) - inside, r);
  };
  // Validate: the first step of both paths must give the same norm and state.
  for (Path& path : paths) {
    NormResult bare_norm;
    path.bare->step(engine, adamw, scale_of(0), bare_norm);
    const StepReport first = manager_step(*path.mgr, 0, false).second;
    bool ok = first.stepped && std::memcmp(&first.norm.norm, &bare_norm.norm, 4) == 0;
    for (std::size_t k = 0; k < sizes.size() && ok; ++k) ok = path.bare->same_as(*path.mgr, k);
    if (!ok) {
      std::fprintf(stderr,
                   "validation FAILED (%s state): the manager's step differs from the "
                   "engine's\n",
                   path.q8 ? "8-bit" : "f32");
      return 1;
    }
    std::printf("validated (%s state): step 1 bit-identical (norm %.6g, clip %.6g)\n",
                path.q8 ? "8-bit" : "f32", first.norm.norm, first.clip_coefficient);
  }

  // Time: alternate bare and manager steps (and the state kinds) so the VM's drift hits
  // all alike.
  for (int s = 1; s <= steps; ++s)
    for (Path& path : paths) {
      NormResult n;
      const auto tb = Clock::now();
      path.bare->step(engine, adamw, scale_of(s), n);
      path.t_bare.push_back(seconds_since(tb));
      const auto [seconds, report] = manager_step(*path.mgr, s, false);
      path.t_mgr.push_back(seconds);
      path.t_wait.push_back(report.staging_wait_seconds);
      path.t_overlap.push_back(manager_step(*path.mgr, s, true).first);
    }
  for (Path& path : paths) {
    path.memory = path.mgr->memory();
    path.mgr->close();
  }
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
  for (const Path& path : paths) {
    const double b = median(path.t_bare), m = median(path.t_mgr), o = median(path.t_overlap);
    const char* kind = path.q8 ? "8-bit" : "f32";
    std::printf("%-44s %9s %9s %9s\n",
                (std::string("per step (median of runs), seconds, ") + kind + " state").c_str(),
                "median", "min", "overhead");
    std::printf("%-44s %9.4f %9.4f %9s\n", "bare engine: accumulate + norm + AdamW", b,
                *std::min_element(path.t_bare.begin(), path.t_bare.end()), "-");
    std::printf("%-44s %9.4f %9.4f %8.1f%%\n", "manager, clip_grad_norm, no overlap", m,
                *std::min_element(path.t_mgr.begin(), path.t_mgr.end()), 100.0 * (m - b) / b);
    std::printf("%-44s %9.4f %9.4f %8.1f%%\n", "manager, overlap (no clip)", o,
                *std::min_element(path.t_overlap.begin(), path.t_overlap.end()),
                100.0 * (o - b) / b);
    std::printf("overhead per step: %.1f ms (no overlap), %.1f ms (overlap); %.2f ns/element\n",
                1e3 * (m - b), 1e3 * (o - b), 1e9 * (m - b) / static_cast<double>(total));
    // Backward here hands every gradient over at once, so the CPU is always behind it: the
    // most a full staging ring can hold backward back.
    std::printf(
        "backward held by a full staging ring (no overlap): %.1f ms per step (%.1f MiB of "
        "rings, host memory %.2f B/element, peak %.2f)\n",
        1e3 * median(path.t_wait),
        static_cast<double>(path.memory.kind("staging").bytes + path.memory.kind("upload").bytes +
                            path.memory.kind("fetch").bytes) /
            (1 << 20),
        static_cast<double>(path.memory.host_bytes) / static_cast<double>(total),
        static_cast<double>(path.memory.host_peak) / static_cast<double>(total));
  }
  std::printf("of which the host device's copies alone (1-thread memcpy D2H + H2D): %.1f ms\n",
              1e3 * median(t_copy));
  if (with_q8)
    std::printf(
        "8-bit state against f32 state: manager step %.2fx, overlapped %.2fx, "
        "bare engine %.2fx (time ratio f32 / 8-bit)\n",
        median(paths[0].t_mgr) / median(paths[1].t_mgr),
        median(paths[0].t_overlap) / median(paths[1].t_overlap),
        median(paths[0].t_bare) / median(paths[1].t_bare));
  return 0;
}
