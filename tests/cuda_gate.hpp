// Test support (CUDA builds): a gate that holds a CUDA stream the way a hung collective
// would — a one-thread kernel spinning on a flag in mapped page-locked host memory until
// the host opens the gate. A watchdog thread opens it at a deadline, and the kernel
// leaves by itself after about 30 s of clock64 cycles, so a test bug never holds the GPU.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "stepcore/cuda_host.hpp"

namespace cuda_gate {

class Gate {
 public:
  /// Allocates the flags (cudaHostAlloc, mapped); throws std::runtime_error naming the call.
  Gate();
  /// Opens the gate, waits for the kernel to leave (its stream synchronised), frees.
  ~Gate();
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  /// Closes the gate on `stream` (once per Gate): enqueues the spinning kernel
  /// (launch checked) and arms the watchdog to open the gate `watchdog` from now.
  /// Throws std::runtime_error naming the failed CUDA call.
  void close(cudaStream_t stream, std::chrono::milliseconds watchdog);
  /// Opens the gate; idempotent, callable from any thread, never throws.
  void open() noexcept;
  /// Returns true when the watchdog, not the test, opened the gate.
  bool opened_by_watchdog() const;
  /// Returns true once the kernel left through its own cycle bound (read after the
  /// stream was synchronised, e.g. after the destructor's wait would have run).
  bool expired_on_device() const noexcept;

 private:
  void watch(std::chrono::steady_clock::time_point deadline);

  volatile int* flags_ = nullptr;  // [0]: open (host writes), [1]: expired (kernel writes)
  int* device_flags_ = nullptr;    // the same memory, as the device addresses it
  cudaStream_t stream_ = nullptr;
  bool closed_ = false;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool opened_ = false;
  bool by_watchdog_ = false;
  std::thread watchdog_;
};

}  // namespace cuda_gate
