// stepcore-gpu-nccl-step: gradient-manager steps on CUDA device 0 with an NCCL
// communicator of one rank (issuing on the device's compute stream), compared bit for bit
// with the same gradient stream through the same mode on the host device (the CPU
// executor, no communicator). Modes none and optimizer, AdamW and SignSGD, clipped.
// Run by tools/gpu-check.sh. Exit 0: every run agrees; 1: a mismatch; 2: an error.
// Without a CUDA device it prints a SKIP line and exits 0. `--host` runs the same
// comparison with the host device and an in-process communicator of one rank in place of
// CUDA and NCCL: a check of this program itself on a machine without a GPU.
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "stepcore/comm.hpp"
#include "stepcore/comm_nccl.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cuda.hpp"
#include "stepcore/device.hpp"
#include "stepcore/managers.hpp"

namespace {

using namespace stepcore;

constexpr int kSteps = 2;
constexpr int kMicroBatches = 2;
constexpr std::uint64_t kFingerprint = 0x6E63636C;  // any value every rank shares
constexpr float kMaxNorm = 0.05f;                   // small enough that every step clips

std::vector<ParamSpec> model() {
  const std::size_t sizes[] = {1, 4097, (std::size_t{1} << 20) + 3, 70000};
  std::vector<ParamSpec> out;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    ParamSpec p;
    p.name = "p" + std::to_string(i);
    p.numel = sizes[i];
    p.grad_dtype = i == 3 ? DType::f32 : DType::bf16;
    p.compute_dtype = DType::bf16;
    p.group = i == 0 ? 1 : 0;  // group 1: no weight decay
    out.push_back(p);
  }
  return out;
}

std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Element j of parameter i's gradient in (step, micro): values over eight binades.
float gradient_value(int step, int micro, std::size_t i, std::size_t j) {
  const std::uint64_t r = mix(mix((static_cast<std::uint64_t>(step + 1) << 40) ^
                                  (static_cast<std::uint64_t>(micro) << 32) ^ i) ^
                              j);
  const float u = static_cast<float>(r >> 40) * 0x1p-24f;
  return (2.0f * u - 1.0f) * std::ldexp(1.0f, -static_cast<int>((r >> 8) & 7));
}

std::vector<std::uint8_t> gradient_bytes(const ParamSpec& p, int step, int micro, std::size_t i) {
  std::vector<std::uint8_t> out(p.numel * dtype_size(p.grad_dtype));
  for (std::size_t k = 0; k < p.numel; ++k) {
    const float x = gradient_value(step, micro, i, k);
    if (p.grad_dtype == DType::f32) {
      std::memcpy(out.data() + 4 * k, &x, 4);
    } else {
      const std::uint16_t h = f32_to_bf16_bits(x);
      std::memcpy(out.data() + 2 * k, &h, 2);
    }
  }
  return out;
}

/// Everything observable after one step, as bytes to compare.
struct StepOut {
  std::uint32_t norm_bits = 0, clip_bits = 0;
  bool stepped = false, skipped = false;
  std::vector<std::vector<float>> master, exp_avg, exp_avg_sq;
  std::vector<std::vector<std::uint8_t>> compute;
};

std::vector<StepOut> run(device::Device& dev, comm::Communicator* comm, OffloadMode mode,
                         const std::string& optimizer) {
  ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer.kind = parse_optimizer(optimizer);
  cfg.optimizer.adamw.lr = 2e-3;
  cfg.optimizer.adamw.weight_decay = 0.1;
  cfg.optimizer.sign_sgd.lr = 1e-3;
  cfg.optimizer.sign_sgd.weight_decay = 0.05;
  // Two groups: "decay" with the optimizer's values, "no_decay" (parameter 0) without.
  const bool is_adamw = cfg.optimizer.kind == OptimizerKind::adamw;
  ParamGroup decay;
  decay.name = "decay";
  decay.lr = is_adamw ? cfg.optimizer.adamw.lr : cfg.optimizer.sign_sgd.lr;
  decay.weight_decay = is_adamw ? cfg.optimizer.adamw.weight_decay : 0.05;
  ParamGroup no_decay = decay;
  no_decay.name = "no_decay";
  no_decay.weight_decay = 0.0;
  cfg.groups = {decay, no_decay};
  cfg.params = model();
  cfg.chunk_elements = 300000;  // chunks {0, 1}, {2}, {3}
  cfg.device = &dev;
  cfg.comm = comm;
  cfg.layout_fingerprint = kFingerprint;
  auto m = make_gradient_manager(cfg);
  const std::size_t n = cfg.params.size();
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<float> init(cfg.params[i].numel);
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = 0.05f * gradient_value(-1, 0, i, j);
    m->load_parameter(i, init);
  }
  const bool adamw = optimizer == "adamw";
  std::vector<StepOut> out;
  for (int s = 0; s < kSteps; ++s) {
    m->begin_step(1.0f / static_cast<float>(1000 + 37 * s), /*overlap_optimizer=*/false);
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      m->begin_backward(mb + 1 == kMicroBatches);
      for (std::size_t i = n; i-- > 0;) {  // backward order: last parameter first
        const TensorView g = m->gradient(i);
        const std::vector<std::uint8_t> bytes = gradient_bytes(cfg.params[i], s, mb, i);
        dev.copy(device::Queue::compute, g.data, bytes.data(), bytes.size());
        dev.synchronize(dev.record(device::Queue::compute));
        m->gradient_ready(i);
      }
      m->finish_backward();
    }
    m->clip_grad_norm(kMaxNorm);
    m->step();
    const StepReport rep = m->report();
    StepOut o;
    o.norm_bits = std::bit_cast<std::uint32_t>(rep.norm.norm);
    o.clip_bits = std::bit_cast<std::uint32_t>(rep.clip_coefficient);
    o.stepped = rep.stepped;
    o.skipped = rep.skipped;
    for (std::size_t i = 0; i < n; ++i) {
      const ParamSpec& p = cfg.params[i];
      o.master.emplace_back(p.numel);
      o.exp_avg.emplace_back(adamw ? p.numel : 0);
      o.exp_avg_sq.emplace_back(adamw ? p.numel : 0);
      o.compute.emplace_back(p.numel * dtype_size(p.compute_dtype));
      m->read_parameter(i, o.master.back(), o.exp_avg.back(), o.exp_avg_sq.back(),
                        o.compute.back());
    }
    out.push_back(std::move(o));
  }
  m->close();
  return out;
}

template <class T>
bool same(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() ||
        (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(T)) != 0))
      return false;
  return true;
}

/// Prints one line per step and returns the number of steps that differ.
int compare(const std::string& label, const std::vector<StepOut>& got,
            const std::vector<StepOut>& want) {
  int bad = 0;
  for (std::size_t s = 0; s < want.size(); ++s) {
    const StepOut& g = got[s];
    const StepOut& w = want[s];
    std::string diff;
    if (g.norm_bits != w.norm_bits) diff += " norm";
    if (g.clip_bits != w.clip_bits) diff += " clip";
    if (g.stepped != w.stepped || g.skipped != w.skipped) diff += " stepped/skipped";
    if (!same(g.master, w.master)) diff += " master";
    if (!same(g.exp_avg, w.exp_avg) || !same(g.exp_avg_sq, w.exp_avg_sq)) diff += " moments";
    if (!same(g.compute, w.compute)) diff += " compute-weights";
    std::printf("%-28s step %zu: norm %a (0x%08x) clip %a  %s\n", label.c_str(), s + 1,
                std::bit_cast<float>(g.norm_bits), g.norm_bits, std::bit_cast<float>(g.clip_bits),
                diff.empty() ? "same bits as the host device" : ("DIFFERS:" + diff).c_str());
    if (!diff.empty()) ++bad;
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const bool host_only = argc > 1 && std::string(argv[1]) == "--host";
  if (argc > 2 || (argc == 2 && !host_only)) {
    std::fprintf(stderr, "usage: stepcore-gpu-nccl-step [--host]\n");
    return 2;
  }
  if (!host_only && cuda::device_count() == 0) {
    std::printf("stepcore-gpu-nccl-step: SKIP: no CUDA device: %s\n",
                cuda::unavailable_reason().c_str());
    return 0;
  }
  if (!host_only && !comm::built_with_nccl()) {
    std::printf("stepcore-gpu-nccl-step: FAIL: stepcore was built without NCCL\n");
    return 2;
  }
  try {
    auto host = device::make_host_device();
    std::unique_ptr<device::Device> dev;
    std::unique_ptr<comm::Communicator> comm;
    if (host_only) {
      dev = device::make_host_device();
      comm = std::move(comm::make_in_process_group(1, 60s).front());
    } else {
      dev = device::make_cuda_device(0);
      comm = comm::make_nccl_communicator(comm::nccl_unique_id(), /*rank=*/0, /*nranks=*/1,
                                          /*device=*/0, dev->compute_stream(), 60s);
    }
    const char* what = host_only ? "host+in-process" : "cuda+nccl";
    int bad = 0;
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer})
      for (const char* opt : {"adamw", "sign_sgd"}) {
        const std::string label = std::string(offload_mode_name(mode)) + " " + opt + " x1";
        const auto t0 = std::chrono::steady_clock::now();
        const auto got = run(*dev, comm.get(), mode, opt);
        const auto t1 = std::chrono::steady_clock::now();
        const auto want = run(*host, nullptr, mode, opt);
        std::printf("%-28s %s %.1f ms\n", label.c_str(), what,
                    std::chrono::duration<double, std::milli>(t1 - t0).count());
        bad += compare(label, got, want);
      }
    comm.reset();
    std::printf("stepcore-gpu-nccl-step: %s (%s, one rank)\n",
                bad == 0 ? "PASS: every step gave the host device's bits"
                         : (std::to_string(bad) + " step(s) DIFFER").c_str(),
                what);
    return bad == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("stepcore-gpu-nccl-step: FAIL: %s\n", e.what());
    return 2;
  }
}
