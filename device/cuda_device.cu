// The CUDA device: three non-blocking streams (compute, d2h, h2d), cudaMalloc'd device
// memory, NUMA-placed page-locked host memory, CUDA events, and the kernels of
// step_kernels.cu enqueued on the compute stream. Every CUDA call is checked
// (Errc::cuda_error naming the call); every entry point makes the device current for
// its duration and restores the caller's device. The device's own waits (allocate,
// deallocate, teardown) poll events recorded at the call, bounded by its wait timeout:
// never a whole-stream synchronise (the compute stream may be the trainer's), and memory
// that work may still use after a timeout is abandoned, never freed under it.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device/device_internal.hpp"
#include "kernels/check.cuh"
#include "kernels/checked_plans.hpp"
#include "kernels/plan_cache.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/numa.hpp"

namespace stepcore::device {
namespace {

using cuda::detail::check;

// Makes device `ordinal` current while alive, then restores the caller's device. The
// quiet form (for never-throwing paths) ignores failures.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != ordinal) {
      check(cudaSetDevice(ordinal), "cudaSetDevice");
      switched_ = true;
    }
  }
  DeviceGuard(int ordinal, std::nothrow_t) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    if (previous_ != ordinal) {
      if (cudaSetDevice(ordinal) == cudaSuccess)
        switched_ = true;
      else
        cudaGetLastError();
    }
  }
  ~DeviceGuard() {
    if (switched_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Polls done() until it returns true or `timeout` has passed, yielding for the first 2 ms,
// then sleeping 50 us between polls; returns whether done() did. The one polling loop of
// the device's bounded waits (its own, and Event::wait_for).
template <class Done>
bool poll_until(std::chrono::milliseconds timeout, Done&& done) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (;;) {
    if (done()) return true;
    const auto waited = clock::now() - start;
    if (waited >= timeout) return false;
    if (waited < std::chrono::milliseconds(2))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// The CUDA events of one device, reused: record() and record_on() take a free one (made
// only when none is free), and an event goes back once its last handle is gone. Sharing
// the pool keeps it alive for events that outlive their device. Re-recording a returned
// event is safe: no handle is left to query or wait on it, and a stream wait enqueued
// earlier waited on the record of its own time (cudaStreamWaitEvent's rule).
class EventPool {
 public:
  EventPool() = default;
  ~EventPool() {
    for (cudaEvent_t e : free_)
      if (cudaEventDestroy(e) != cudaSuccess) cudaGetLastError();
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // Returns a free event of the device (the caller made the device current).
  cudaEvent_t take() {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        const cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    created_.fetch_add(1, std::memory_order_relaxed);
    return e;
  }
  // Takes `e` back (any thread); destroys it when the free list cannot grow.
  void give(cudaEvent_t e) noexcept {
    try {
      const std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(e);
      return;
    } catch (...) {
    }
    if (cudaEventDestroy(e) != cudaSuccess) cudaGetLastError();
  }
  // Returns how many events the pool has made (for the device's tests).
  std::uint64_t created() const noexcept { return created_.load(std::memory_order_relaxed); }

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
  std::atomic<std::uint64_t> created_{0};
};

// A CUDA event (timing disabled) of a pool, back in the pool with its last handle.
class CudaEventState final : public Event::State {
 public:
  CudaEventState(std::shared_ptr<EventPool> pool, cudaEvent_t e)
      : pool_(std::move(pool)), event_(e) {}
  ~CudaEventState() override { pool_->give(event_); }
  // An event whose query fails counts as complete: wait() raises the failure.
  bool complete() override {
    if (cudaEventQuery(event_) != cudaErrorNotReady) return true;
    cudaGetLastError();  // "not ready" must not be reported by a later launch check
    return false;
  }
  void wait() override { check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }
  // Polled (a failed query counts as complete: the caller's synchronize raises it).
  bool wait_for(std::chrono::milliseconds timeout) override {
    return poll_until(timeout, [this] { return complete(); });
  }
  cudaEvent_t event() const noexcept { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_;
};

// A host memset enqueued on a stream (cudaLaunchHostFunc): host memory need not be
// mapped into the device's address space for Queue::d2h/h2d to zero it in order. Its
// argument is a record the device owns (detail::HostZeroRecords), so the callback may
// run any number of times: a captured graph replays it safely.
void CUDART_CB run_host_zero(void* record) { detail::HostZeroRecords::run(record); }

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, cudaStream_t compute, std::chrono::milliseconds wait_timeout)
      : ordinal_(ordinal), name_("cuda:" + std::to_string(ordinal)), wait_timeout_(wait_timeout) {
    const DeviceGuard guard(ordinal_);
    try {
      if (compute != nullptr) {
#if CUDART_VERSION >= 12080
        int dev = -1;
        check(cudaStreamGetDevice(compute, &dev), "cudaStreamGetDevice");
        if (dev != ordinal_)
          throw Error(Errc::invalid_argument, "compute",
                      "a stream of device " + std::to_string(dev) + ", not " + name_);
#endif
        streams_[0] = compute;
      } else {
        check(cudaStreamCreateWithFlags(&streams_[0], cudaStreamNonBlocking),
              "cudaStreamCreateWithFlags");
        owns_compute_ = true;
      }
      check(cudaStreamCreateWithFlags(&streams_[1], cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags");
      check(cudaStreamCreateWithFlags(&streams_[2], cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags");
    } catch (...) {
      destroy_streams();
      throw;
    }
  }

  ~CudaDevice() override {
    gpu::detail::note_memory_released();  // its memory goes
    const DeviceGuard guard(ordinal_, std::nothrow);
    if (!drain_bounded()) {
      // Work still runs (a hung kernel or collective): freeing or unpinning would block
      // on it, or pull memory from under it. Abandon everything; the streams go (a
      // stream's destruction does not wait for its work).
      host_buffers_.abandon();
      host_zeros_.abandon();  // a queued callback may still read its record
      destroy_streams();
      return;
    }
    while (!device_mem_.empty()) {
      void* p = device_mem_.first();
      device_mem_.remove(p);
      if (cudaFree(p) != cudaSuccess) cudaGetLastError();
    }
    host_buffers_.for_each([](void* p) { cuda::host_unregister(p); });
    destroy_streams();
  }

  std::string_view name() const noexcept override { return name_; }
  std::chrono::milliseconds wait_timeout() const noexcept override { return wait_timeout_; }

  void* allocate(std::size_t bytes) override {
    const DeviceGuard guard(ordinal_);
    const std::size_t n = bytes == 0 ? 1 : bytes;
    void* p = nullptr;
    check(cudaMalloc(&p, n), "cudaMalloc");  // 256-byte aligned (at least)
    // Zero-filled on the h2d stream (the device's own, never the trainer's), waited for
    // with a bound; a memset still queued at the bound leaves the memory abandoned.
    try {
      check(cudaMemsetAsync(p, 0, n, stream(Queue::h2d)), "cudaMemsetAsync");
    } catch (...) {
      cudaFree(p);
      throw;
    }
    if (!wait_bounded({stream(Queue::h2d)}))
      throw Error(Errc::timeout, "wait_timeout",
                  "zero-filling " + std::to_string(bytes) +
                      " bytes of new device memory did not finish within " +
                      std::to_string(wait_timeout_.count()) + " ms (the h2d queue is stuck)");
    device_mem_.add(p, n);
    return p;
  }

  void deallocate(void* p) noexcept override {
    if (p == nullptr || !device_mem_.owns(p)) return;
    gpu::detail::note_memory_released();  // cached calls naming it are checked again
    const DeviceGuard guard(ordinal_, std::nothrow);
    const bool idle = drain_bounded();
    device_mem_.remove(p);
    if (!idle) return;  // queued work may still use p: abandoned, not freed under it
    if (cudaFree(p) != cudaSuccess) cudaGetLastError();
  }

  void* allocate_host(std::size_t bytes, int numa_node) override {
    const DeviceGuard guard(ordinal_);
    // Pinning faults the pages in on the node the buffer is bound to.
    return host_buffers_.add(bytes, numa_node,
                             [](void* p, std::size_t n) { cuda::host_register(p, n); });
  }

  void deallocate_host(void* p) noexcept override {
    if (!host_buffers_.owns(p)) return;
    gpu::detail::note_memory_released();
    const DeviceGuard guard(ordinal_, std::nothrow);
    if (!drain_bounded()) {
      host_buffers_.abandon(p);  // queued copies may still use it
      return;
    }
    cuda::host_unregister(p);
    host_zeros_.release(p, host_buffers_.ranges().find(p).second);
    host_buffers_.remove(p);
  }

  void check_memory(const void* p, std::size_t bytes, const std::string& name) const override {
    if (device_mem_.check_inside(p, bytes, name)) return;
    gpu::detail::check_pointer_device(gpu::detail::pointer_info(p), ordinal_,
                                      ::stepcore::detail::Arg{name.c_str()});
  }

  void copy(Queue q, void* dst, const void* src, std::size_t bytes) override {
    detail::check_queue(q);
    detail::check_copy(device_mem_, host_buffers_.ranges(), dst, src, bytes);
    if (bytes == 0) return;
    const DeviceGuard guard(ordinal_);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream(q)), "cudaMemcpyAsync");
  }

  void zero(Queue q, void* dst, std::size_t bytes) override {
    detail::check_queue(q);
    detail::check_zero(device_mem_, host_buffers_.ranges(), dst, bytes);
    if (bytes == 0) return;
    const DeviceGuard guard(ordinal_);
    if (is_device_memory(dst)) {
      check(cudaMemsetAsync(dst, 0, bytes, stream(q)), "cudaMemsetAsync");
      return;
    }
    // Capturable: the record outlives every replay (until its buffer is released).
    check(cudaLaunchHostFunc(stream(q), run_host_zero, host_zeros_.get(dst, bytes)),
          "cudaLaunchHostFunc");
  }

  Event record(Queue q) override {
    detail::check_queue(q);
    return record_event(stream(q));
  }

  Event record_on(cudaStream_t stream) override { return record_event(stream); }

  void wait_on(cudaStream_t stream, const Event& e) override {
    if (e.empty()) return;
    if (auto* c = dynamic_cast<CudaEventState*>(e.state().get())) {
      const DeviceGuard guard(ordinal_);
      check(cudaStreamWaitEvent(stream, c->event(), 0), "cudaStreamWaitEvent");
    } else {
      wait_foreign(e);
    }
  }

  void wait(Queue q, const Event& e) override {
    detail::check_queue(q);
    if (e.empty()) return;
    if (auto* c = dynamic_cast<CudaEventState*>(e.state().get())) {
      const DeviceGuard guard(ordinal_);
      check(cudaStreamWaitEvent(stream(q), c->event(), 0), "cudaStreamWaitEvent");
    } else {
      wait_foreign(e);  // another kind of device's event: wait on the host
    }
  }

  void synchronize(const Event& e) override {
    if (!e.empty()) e.state()->wait();
  }

  void synchronize() override {
    const DeviceGuard guard(ordinal_);
    for (cudaStream_t s : streams_) check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }

  std::size_t norm_workspace_bytes(std::span<const TensorView> d_tensors) const override {
    return gpu::scale_and_norm_workspace_bytes(d_tensors);
  }

  void accumulate(std::span<const AccumulatePair> d_pairs) override {
    const DeviceGuard guard(ordinal_);
    gpu::accumulate(d_pairs, compute());
  }

  void scale_and_norm_partial(std::span<const TensorView> d_tensors, float scale,
                              NormPartial* d_partial, void* d_workspace,
                              std::size_t workspace_bytes) override {
    const DeviceGuard guard(ordinal_);
    gpu::scale_and_norm_partial(d_tensors, scale, d_partial, d_workspace, workspace_bytes,
                                compute());
  }

  void norm_partial(std::span<const ConstTensorView> d_tensors, GradientRead read,
                    NormPartial* d_partial, void* d_workspace,
                    std::size_t workspace_bytes) override {
    const DeviceGuard guard(ordinal_);
    gpu::norm_partial(d_tensors, read, d_partial, d_workspace, workspace_bytes, compute());
  }

  void finalize_and_clip(const NormPartial* d_partial, float max_norm, NormResult* d_result,
                         float* d_clip, std::int32_t* d_found_inf) override {
    const DeviceGuard guard(ordinal_);
    gpu::finalize_and_clip(d_partial, max_norm, d_result, d_clip, d_found_inf, compute());
  }

  void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors, GradientRead read,
                                    const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                    void* d_workspace, std::size_t workspace_bytes) override {
    const DeviceGuard guard(ordinal_);
    gpu::exact_norm_partial_if_needed(d_tensors, read, d_found_inf, d_exact_partial, d_workspace,
                                      workspace_bytes, compute());
  }

  void finalize_exact_and_clip(const NormPartial* d_exact_partial, float max_norm,
                               NormResult* d_result, float* d_clip,
                               std::int32_t* d_found_inf) override {
    const DeviceGuard guard(ordinal_);
    gpu::finalize_exact_and_clip(d_exact_partial, max_norm, d_result, d_clip, d_found_inf,
                                 compute());
  }

  void scale_and_norm_partial(std::span<const TensorView> d_tensors, const float* d_scale,
                              NormPartial* d_partial, void* d_workspace,
                              std::size_t workspace_bytes) override {
    const DeviceGuard guard(ordinal_);
    gpu::scale_and_norm_partial(d_tensors, d_scale, d_partial, d_workspace, workspace_bytes,
                                compute());
  }

  void norm_partial(std::span<const ConstTensorView> d_tensors, const DeviceGradientRead& d_read,
                    NormPartial* d_partial, void* d_workspace,
                    std::size_t workspace_bytes) override {
    const DeviceGuard guard(ordinal_);
    gpu::norm_partial(d_tensors, d_read, d_partial, d_workspace, workspace_bytes, compute());
  }

  void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors,
                                    const DeviceGradientRead& d_read,
                                    const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                    void* d_workspace, std::size_t workspace_bytes) override {
    const DeviceGuard guard(ordinal_);
    gpu::exact_norm_partial_if_needed(d_tensors, d_read, d_found_inf, d_exact_partial, d_workspace,
                                      workspace_bytes, compute());
  }

  void optimizer_step(std::span<const OptimizerTensor> d_tensors, const OptimizerConfig& config,
                      const OptimizerDeviceArgs& d) override {
    const DeviceGuard guard(ordinal_);
    gpu::optimizer_step(d_tensors, config, d, compute());
  }

  cudaStream_t compute_stream() const noexcept override { return streams_[0]; }

  // The events the pool has made so far (detail::cuda_events_made).
  std::uint64_t events_made() const noexcept { return events_->created(); }

 private:
  cudaStream_t compute() const noexcept { return streams_[0]; }
  cudaStream_t stream(Queue q) const noexcept { return streams_[static_cast<std::size_t>(q)]; }

  // Blocks until `e`, an event that is not a CUDA event (a HostEvent), is complete; past
  // wait_timeout_ throws Errc::timeout naming "e".
  void wait_foreign(const Event& e) const {
    if (!e.state()->wait_for(wait_timeout_))
      throw Error(Errc::timeout, "e",
                  "a host event did not complete within " + std::to_string(wait_timeout_.count()) +
                      " ms (the wait_timeout of " + name_ + ")");
  }

  // Returns an event of the pool recorded on `s` now.
  Event record_event(cudaStream_t s) {
    const DeviceGuard guard(ordinal_);
    const cudaEvent_t e = events_->take();
    std::shared_ptr<CudaEventState> state;
    try {
      state = std::make_shared<CudaEventState>(events_, e);
    } catch (...) {
      events_->give(e);
      throw;
    }
    check(cudaEventRecord(e, s), "cudaEventRecord");  // on failure e goes back with state
    return Event(std::move(state));
  }

  bool is_device_memory(const void* p) const {
    if (device_mem_.find(p).second != 0) return true;
    const auto kind = gpu::detail::pointer_info(p).kind;
    return kind == gpu::detail::PointerInfo::device || kind == gpu::detail::PointerInfo::managed;
  }

  // Returns true once the work queued so far on `streams` is done, false when it is not
  // within wait_timeout_: an event recorded on each now, polled (poll_until). Work queued
  // after the call is not waited for. A failed record or query counts as done (its error
  // is the next call's).
  bool wait_bounded(std::initializer_list<cudaStream_t> streams) noexcept {
    std::array<cudaEvent_t, 3> events{};
    std::size_t n = 0;
    for (cudaStream_t s : streams) {
      if (s == nullptr || n == events.size()) continue;
      cudaEvent_t e = nullptr;
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      if (cudaEventRecord(e, s) != cudaSuccess) {
        cudaGetLastError();
        cudaEventDestroy(e);
        continue;
      }
      events[n++] = e;
    }
    const bool done = poll_until(wait_timeout_, [&] {
      bool all = true;
      for (std::size_t i = 0; i < n; ++i) {
        const cudaError_t q = cudaEventQuery(events[i]);
        if (q == cudaErrorNotReady) all = false;
        if (q != cudaSuccess) cudaGetLastError();  // not sticky: reported by later work
      }
      return all;
    });
    for (std::size_t i = 0; i < n; ++i)
      if (cudaEventDestroy(events[i]) != cudaSuccess) cudaGetLastError();
    return done;
  }

  // wait_bounded on every queue.
  bool drain_bounded() noexcept { return wait_bounded({streams_[0], streams_[1], streams_[2]}); }

  void destroy_streams() noexcept {
    for (std::size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i] != nullptr && (i != 0 || owns_compute_) &&
          cudaStreamDestroy(streams_[i]) != cudaSuccess)
        cudaGetLastError();
      streams_[i] = nullptr;
    }
  }

  const int ordinal_;
  const std::string name_;
  const std::chrono::milliseconds wait_timeout_;  // bound of the device's own waits
  std::array<cudaStream_t, 3> streams_{};         // indexed by Queue: compute, d2h, h2d
  bool owns_compute_ = false;
  detail::Allocations device_mem_;
  detail::HostBuffers host_buffers_;
  detail::HostZeroRecords host_zeros_;  // the arguments of host-memory zeroes (capturable)
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();  // record(), record_on()
};

}  // namespace

std::uint64_t detail::cuda_events_made(const Device& d) noexcept {
  const auto* c = dynamic_cast<const CudaDevice*>(&d);
  return c != nullptr ? c->events_made() : 0;
}

std::unique_ptr<Device> make_cuda_device(int ordinal, cudaStream_t compute,
                                         std::chrono::milliseconds wait_timeout) {
  if (wait_timeout.count() <= 0)
    throw Error(Errc::out_of_range, "wait_timeout", "the device's wait bound must be positive");
  const int n = cuda::device_count();
  if (n == 0)
    throw Error(Errc::not_supported, "ordinal", "no CUDA device: " + cuda::unavailable_reason());
  if (ordinal < 0 || ordinal >= n)
    throw Error(
        Errc::not_supported, "ordinal",
        "no CUDA device " + std::to_string(ordinal) + " (" + std::to_string(n) + " present)");
  return std::make_unique<CudaDevice>(ordinal, compute, wait_timeout);
}

}  // namespace stepcore::device
