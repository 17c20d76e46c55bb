// stepcore-bench-gpu: bandwidth of the GPU kernels at 1 GiB of bf16 gradients spread
// over a realistic tensor list (norm, fused scale + norm, accumulate, every optimizer),
// each as a ratio to a device-to-device copy of the same kind of traffic measured in the
// same run (CUDA events on the device's compute stream around `batch` calls issued back
// to back, so the window holds device work, not the host's checks and launches), plus
// each kernel's host cost per call, timed apart, and the host time per call for 2,000
// tensors. Validates every kernel against the reference before timing
// (bench/gpu_harness.hpp, which the test suite also runs on the host device). Exits 0
// with a message when there is no device, 1 on a validation failure.
//
// Usage: stepcore-bench-gpu [--json PATH]   (PATH: the figures as JSON, for gpu-check)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "bench/gpu_harness.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"

namespace {

using namespace stepcore;

#define CHECK(x)                                                           \
  do {                                                                     \
    const cudaError_t e_ = (x);                                            \
    if (e_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--json PATH]\n", argv[0]);
      return 2;
    }
  }
  if (cuda::device_count() == 0) {
    std::printf("stepcore-bench-gpu: skipped, no CUDA device: %s\n",
                cuda::unavailable_reason().c_str());
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device     %s, %d SMs, %zu MiB\n", prop.name, prop.multiProcessorCount,
                static_cast<std::size_t>(prop.totalGlobalMem >> 20));
    const auto dev = device::make_cuda_device(0);
    cudaStream_t stream = dev->compute_stream();
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    const bench::BestMs best_ms = [&](const std::function<void()>& fn, int reps, int batch) {
      fn();  // warm-up (and the first, validating call: later ones are cached)
      dev->synchronize();
      float best = 1e30f;
      for (int r = 0; r < reps; ++r) {
        CHECK(cudaEventRecord(a, stream));
        for (int k = 0; k < batch; ++k) fn();
        CHECK(cudaEventRecord(b, stream));
        CHECK(cudaEventSynchronize(b));
        float ms = 0.0f;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        best = std::min(best, ms / static_cast<float>(batch));
      }
      return static_cast<double>(best);
    };
    const bench::GpuBenchResult r = bench::run_gpu_bench(*dev, best_ms, bench::GpuBenchOptions{});
    if (!r.failure.empty()) {
      std::fprintf(stderr, "stepcore-bench-gpu: %s; not timing\n", r.failure.c_str());
      return 1;
    }
    const double probe_bw = r.probe_bytes / (r.probe_ms * 1e-3);
    std::printf("tensors    %zu, %zu elements (%zu blocks of %zu)\n", r.tensors, r.elements,
                r.blocks, gpu::kBlockElements);
    std::printf("%-34s %8.3f ms  %7.1f GB/s  (probe: device-to-device copy)\n", "memcpy d2d",
                r.probe_ms, probe_bw * 1e-9);
    std::string json = "{\"device\": \"" + std::string(prop.name) +
                       "\", \"sms\": " + std::to_string(prop.multiProcessorCount) +
                       ", \"tensors\": " + std::to_string(r.tensors) +
                       ", \"probe_gbps\": " + std::to_string(probe_bw * 1e-9) + ", \"rows\": [";
    for (std::size_t i = 0; i < r.rows.size(); ++i) {
      const bench::GpuBenchRow& row = r.rows[i];
      const double bw = row.bytes / (row.ms * 1e-3);
      std::printf("%-34s %8.3f ms  %7.1f GB/s  ratio to memcpy %.3f  host %.1f us/call\n",
                  row.name.c_str(), row.ms, bw * 1e-9, bw / probe_bw, row.host_us);
      json += std::string(i ? ", " : "") + "{\"name\": \"" + row.name +
              "\", \"ms\": " + std::to_string(row.ms) + ", \"gbps\": " + std::to_string(bw * 1e-9) +
              ", \"ratio\": " + std::to_string(bw / probe_bw) +
              ", \"optimizer\": " + (row.optimizer ? "true" : "false") +
              ", \"host_us\": " + std::to_string(row.host_us) + "}";
    }
    std::printf("host time per call, %zu tensors: %.1f us (scale+norm enqueue)\n",
                bench::GpuBenchOptions{}.small_tensors, r.host_us_per_small_call);
    json += "], \"host_us_small_call\": " + std::to_string(r.host_us_per_small_call) + "}\n";
    if (json_path != nullptr) {
      std::FILE* f = std::fopen(json_path, "w");
      if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
        std::fprintf(stderr, "stepcore-bench-gpu: cannot write %s\n", json_path);
        return 1;
      }
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  } catch (const Error& e) {
    std::fprintf(stderr, "stepcore-bench-gpu: %s\n", e.what());
    return 1;
  }
  return 0;
}
