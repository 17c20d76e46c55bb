// stepcore-gpu-nccl-step: gradient-manager steps on CUDA device 0 with an NCCL
// communicator of one rank (issuing on the device's compute stream), compared bit for bit
// with the same gradient stream through the same mode on the host device (the CPU
// executor, no communicator). Modes none and optimizer, AdamW and SignSGD, clipped; and
// mode full (no communicator). Each run counts the host synchronisations the manager
// makes per step (Device::synchronize calls from begin_step to report(), through a
// counting forwarder: counted, not assumed). `--json PATH` writes the counts and the
// verdicts. Run by tools/gpu-check.sh. Exit 0: every run agrees; 1: a mismatch; 2: an
// error.
// Without a CUDA device it prints a SKIP line and exits 0. `--host` runs the same
// comparison with the host device and an in-process communicator of one rank in place of
// CUDA and NCCL: a check of this program itself on a machine without a GPU.
//
// Usage: stepcore-gpu-nccl-step [--host] [--json PATH]
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
#include "stepcore/cuda_host.hpp"
#include "stepcore/device.hpp"
#include "stepcore/managers.hpp"
#include "tests/forwarding_device.hpp"

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
  int host_syncs = 0;  // the manager's Device::synchronize calls in the step
  std::uint32_t norm_bits = 0, clip_bits = 0;
  bool stepped = false, skipped = false;
  std::vector<std::vector<float>> master, exp_avg, exp_avg_sq;
  std::vector<std::vector<std::uint8_t>> compute;
};

// The manager runs on `counted` (which forwards to the device); the program's own
// uploads go to the device directly, so only the manager's waits are counted.
std::vector<StepOut> run(test_support::ForwardingDevice& counted, comm::Communicator* comm,
                         OffloadMode mode, const std::string& optimizer) {
  device::Device& dev = counted.inner();
  ManagerConfig cfg;
  cfg.mode = mode;
  cfg.optimizer = parse_optimizer(optimizer);
  // Two groups: "decay" with the optimizer's values, "no_decay" (parameter 0) without.
  const bool is_adamw = std::holds_alternative<AdamWConfig>(cfg.optimizer);
  ParamGroup decay;
  decay.name = "decay";
  decay.lr = is_adamw ? 2e-3 : 1e-3;
  decay.weight_decay = is_adamw ? 0.1 : 0.05;
  ParamGroup no_decay = decay;
  no_decay.name = "no_decay";
  no_decay.weight_decay = 0.0;
  cfg.groups = {decay, no_decay};
  cfg.params = model();
  cfg.chunk_elements = 300000;  // chunks {0, 1}, {2}, {3}
  cfg.device = &counted;
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
    const int syncs_before = counted.synchronizations();
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
    o.host_syncs = counted.synchronizations() - syncs_before;
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

/// Sums v in f32 pairwise (halves, recursively): the tree a GPU reduction makes.
float pairwise_sum(const float* v, std::size_t n) {
  if (n <= 8) {
    float s = 0.0f;
    for (std::size_t k = 0; k < n; ++k) s += v[k];
    return s;
  }
  return pairwise_sum(v, n / 2) + pairwise_sum(v + n / 2, n - n / 2);
}

/// The global norm of step `s`'s gradient (summed over the micro-batches in f32, times
/// the step's scale) two other ways: as a float all-reduce of norms computes it (each
/// tensor's sum of squares in f32 as a GPU's tree reduction, the tensors' norms combined
/// in f32; one rank's all-reduce is the identity), and in double (the squares of f32
/// values are exact in double; a reference that rounds like the exact norm but for
/// ties).
struct OtherNorms {
  float f32_allreduce = 0.0f;
  double f64 = 0.0;
};
OtherNorms other_norms(int s) {
  const std::vector<ParamSpec> params = model();
  const float scale = 1.0f / static_cast<float>(1000 + 37 * s);
  std::vector<float> norms, squares;
  double sum = 0.0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    squares.assign(params[i].numel, 0.0f);
    for (std::size_t k = 0; k < params[i].numel; ++k) {
      float acc = 0.0f;
      for (int mb = 0; mb < kMicroBatches; ++mb) {
        const float g = gradient_value(s, mb, i, k);
        acc += params[i].grad_dtype == DType::f32 ? g : bf16_bits_to_f32(f32_to_bf16_bits(g));
      }
      const float x = acc * scale;
      squares[k] = x * x;
      sum += static_cast<double>(x) * static_cast<double>(x);
    }
    const float n = std::sqrt(pairwise_sum(squares.data(), squares.size()));
    norms.push_back(n * n);
  }
  return {std::sqrt(pairwise_sum(norms.data(), norms.size())), std::sqrt(sum)};
}

/// The distance in units in the last place between two positive floats.
long long ulps(float a, float b) {
  return static_cast<long long>(std::bit_cast<std::int32_t>(a)) - std::bit_cast<std::int32_t>(b);
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
    std::printf("%-28s step %zu: norm %a (0x%08x) clip %a, %d host syncs  %s\n", label.c_str(),
                s + 1, std::bit_cast<float>(g.norm_bits), g.norm_bits,
                std::bit_cast<float>(g.clip_bits), g.host_syncs,
                diff.empty() ? "same bits as the host device" : ("DIFFERS:" + diff).c_str());
    if (!diff.empty()) ++bad;
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  bool host_only = false;
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--host") {
      host_only = true;
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: stepcore-gpu-nccl-step [--host] [--json PATH]\n");
      return 2;
    }
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
    test_support::ForwardingDevice host(device::make_host_device());
    std::unique_ptr<test_support::ForwardingDevice> dev;
    std::unique_ptr<comm::Communicator> comm;
    if (host_only) {
      dev = std::make_unique<test_support::ForwardingDevice>(device::make_host_device());
      comm = std::move(comm::make_in_process_group(1, 60s).front());
    } else {
      dev = std::make_unique<test_support::ForwardingDevice>(device::make_cuda_device(0));
      comm = comm::make_nccl_communicator(comm::nccl_unique_id(), /*rank=*/0, /*nranks=*/1,
                                          /*device=*/0, dev->compute_stream(), 60s);
    }
    const char* what = host_only ? "host+in-process" : "cuda+nccl";
    int bad = 0;
    std::string json = std::string("{\"device\": \"") + what + "\", \"runs\": [";
    bool first = true;
    for (OffloadMode mode : {OffloadMode::none, OffloadMode::optimizer, OffloadMode::full})
      for (const char* opt : {"adamw", "sign_sgd"}) {
        // Full offload reduces its norm on the host: no NCCL communicator.
        comm::Communicator* c = mode == OffloadMode::full ? nullptr : comm.get();
        const std::string label =
            std::string(offload_mode_name(mode)) + " " + opt + (c != nullptr ? " x1" : "");
        const auto t0 = std::chrono::steady_clock::now();
        const auto got = run(*dev, c, mode, opt);
        const auto t1 = std::chrono::steady_clock::now();
        const auto want = run(host, nullptr, mode, opt);
        std::printf("%-28s %s %.1f ms\n", label.c_str(), what,
                    std::chrono::duration<double, std::milli>(t1 - t0).count());
        const int differ = compare(label, got, want);
        bad += differ;
        json += std::string(first ? "" : ", ") + "{\"mode\": \"" +
                std::string(offload_mode_name(mode)) + "\", \"optimizer\": \"" + opt +
                "\", \"nccl\": " + (c != nullptr && !host_only ? "true" : "false") +
                ", \"bitwise\": " + (differ == 0 ? "true" : "false") + ", \"host_syncs\": [";
        for (std::size_t s = 0; s < got.size(); ++s)
          json += (s ? ", " : "") + std::to_string(got[s].host_syncs);
        json += "]}";
        first = false;
      }
    json += "]";
    // The NCCL norm (the exact one) against a float all-reduce's, step 1.
    {
      const auto runs = run(*dev, comm.get(), OffloadMode::none, "adamw");
      const float exact = std::bit_cast<float>(runs[0].norm_bits);
      const OtherNorms o = other_norms(0);
      const float f64 = static_cast<float>(o.f64);
      std::printf(
          "global norm, step 1 (%s): stepcore %a, float all-reduce %a (%+lld ulp), double "
          "reference %a (%+lld ulp)\n",
          what, exact, o.f32_allreduce, ulps(o.f32_allreduce, exact), f64, ulps(f64, exact));
      json += ", \"norm\": {\"stepcore\": \"" + std::to_string(exact) +
              "\", \"float_allreduce_ulps\": " + std::to_string(ulps(o.f32_allreduce, exact)) +
              ", \"double_reference_ulps\": " + std::to_string(ulps(f64, exact)) + "}";
    }
    json += "}\n";
    comm.reset();
    if (json_path != nullptr) {
      std::FILE* f = std::fopen(json_path, "w");
      if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
        std::printf("stepcore-gpu-nccl-step: FAIL: cannot write %s\n", json_path);
        return 2;
      }
    }
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
