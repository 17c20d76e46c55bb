// Test support: the gate kernel (a spin on a host-written flag, bounded by clock64) and
// the host side that closes, opens and watches it (cuda_gate.hpp).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda_gate.hpp"

namespace cuda_gate {
namespace {

// How long the kernel may hold its stream on its own: a backstop behind the watchdog.
constexpr long long kMaxSeconds = 30;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Spins until flags[0] != 0 (the host opened the gate) or `max_cycles` SM cycles passed
// (then sets flags[1]). volatile: every iteration reads the host's memory again.
__global__ void gate_kernel(volatile int* flags, long long max_cycles) {
  const long long start = clock64();
  while (flags[0] == 0) {
    if (clock64() - start > max_cycles) {
      flags[1] = 1;
      return;
    }
    __nanosleep(1000);
  }
}

}  // namespace

Gate::Gate() {
  void* p = nullptr;
  check(cudaHostAlloc(&p, 2 * sizeof(int), cudaHostAllocMapped), "cudaHostAlloc");
  flags_ = static_cast<volatile int*>(p);
  flags_[0] = 0;
  flags_[1] = 0;
  void* d = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&d, p, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(p);
    check(e, "cudaHostGetDevicePointer");
  }
  device_flags_ = static_cast<int*>(d);
}

Gate::~Gate() {
  open();
  if (watchdog_.joinable()) watchdog_.join();
  if (closed_ && cudaStreamSynchronize(stream_) != cudaSuccess) cudaGetLastError();
  if (cudaFreeHost(const_cast<int*>(flags_)) != cudaSuccess) cudaGetLastError();
}

void Gate::close(cudaStream_t stream, std::chrono::milliseconds watchdog) {
  if (closed_) throw std::runtime_error("Gate::close: a gate closes once");
  int device = 0;
  int khz = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  // The peak SM clock: the bound is at least kMaxSeconds (more when the SM runs slower).
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device) != cudaSuccess || khz <= 0) {
    cudaGetLastError();
    khz = 2'000'000;
  }
  const long long max_cycles = kMaxSeconds * 1000LL * khz;
  gate_kernel<<<1, 1, 0, stream>>>(device_flags_, max_cycles);
  check(cudaGetLastError(), "gate_kernel launch");
  stream_ = stream;
  closed_ = true;
  watchdog_ = std::thread(&Gate::watch, this, std::chrono::steady_clock::now() + watchdog);
}

void Gate::open() noexcept {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    opened_ = true;
  }
  flags_[0] = 1;
  cv_.notify_all();
}

bool Gate::opened_by_watchdog() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return by_watchdog_;
}

bool Gate::expired_on_device() const noexcept { return flags_[1] != 0; }

void Gate::watch(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (cv_.wait_until(lock, deadline, [this] { return opened_; })) return;
  by_watchdog_ = true;
  opened_ = true;
  flags_[0] = 1;
}

}  // namespace cuda_gate
