// The device the gradient managers drive, as an interface: memory, three in-order
// queues (compute, device-to-host, host-to-device), events, and the multi-tensor
// kernels of gpu.hpp. Two implementations: the CUDA device (streams, events, the CUDA
// kernels) and the host device, which stands in for a GPU in CPU-only tests and runs:
// its "device memory" is host memory, its copy queues are worker threads doing memcpy,
// its events are real synchronisation points, and its kernels are the CPU executor of
// the very same block bodies (gpu::emulate), so a manager's results on the host device
// are the bits the GPU gives.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "stepcore/comm.hpp"  // comm::kDefaultTimeout
#include "stepcore/cuda_host.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::device {

/// The in-order queues of a device. Work on one queue runs in submission order; work
/// on different queues is ordered only by events.
enum class Queue : std::uint8_t {
  compute,  ///< kernels (the CUDA device's compute stream)
  d2h,      ///< device-to-host copies
  h2d,      ///< host-to-device copies
};

/// A point in a queue's work: complete once everything submitted to that queue before
/// record() has finished. Copyable handle; an empty Event is always complete.
class Event {
 public:
  struct State;  ///< implementation-defined
  Event() = default;
  explicit Event(std::shared_ptr<State> s) : state_(std::move(s)) {}
  bool empty() const noexcept { return state_ == nullptr; }
  /// Returns true once the event is complete (true for an empty event). Never blocks.
  bool complete() const;
  /// Blocks the calling thread until the event is complete (an empty event returns at
  /// once). Any thread may call it, concurrently with anything, without the device: it
  /// raises only a failure of the wait itself (CUDA: Errc::cuda_error), never the
  /// errors of other queued work — Device::synchronize(e) waits and raises those.
  void wait() const;
  /// Blocks the calling thread until the event is complete or `timeout` has passed;
  /// returns whether it is complete (true at once for an empty event). Any thread, as
  /// wait(); raises only a failure of the wait itself. What a bounded wait uses:
  /// Device::wait_timeout() is the bound the managers give it.
  bool wait_for(std::chrono::milliseconds timeout) const;
  /// The implementation's state (for the devices).
  const std::shared_ptr<State>& state() const noexcept { return state_; }

 private:
  std::shared_ptr<State> state_;
};

/// An event completed from the host: event() is complete once set() has been called (by
/// any thread, once or more). Every device takes it where an Event is waited for: the host
/// device's copy queues wait for it in their worker; the CUDA device, the host device's
/// compute queue and Device::wait_on block the calling thread until it is set, up to the
/// device's wait_timeout() (past it Errc::timeout naming "e"). For work
/// ordered behind host work (a producer thread's write handed over before it is done),
/// and for tests of that ordering.
class HostEvent {
 public:
  HostEvent();
  /// The event (a copyable handle; complete once set()).
  const Event& event() const noexcept { return event_; }
  /// Completes the event and wakes its waiters. Never throws.
  void set() const noexcept;

 private:
  Event event_;
};

/// What the managers need from a GPU. Every enqueueing call returns at once; errors of
/// queued work (a failed copy, a kernel error) are raised by the next synchronize() or
/// the next call on the device, as stepcore::Error (Errc::cuda_error on CUDA,
/// Errc::internal or the work's own code on the host device), and by synchronize(e) of
/// an event recorded after the failed work on its queue (on CUDA the error is sticky; on
/// the host device the first such event raises it even if another caller was told
/// first, and the device then runs new work again). Thread safety:
/// synchronize(const Event&) may be called from any thread, concurrently with anything;
/// every other call must be serialised by the caller (one thread, or a mutex).
class Device {
 public:
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  /// Returns "host" or "cuda:N".
  virtual std::string_view name() const noexcept = 0;
  /// Returns the bound of every wait for this device's queued work: the device's own
  /// (CUDA: allocate's zero fill, deallocate, destruction) and the full-offload manager's
  /// waits for its copies and uploads (past it the manager fails with Errc::timeout).
  /// Set where the device is made (make_cuda_device, make_host_device); default
  /// comm::kDefaultTimeout.
  virtual std::chrono::milliseconds wait_timeout() const noexcept = 0;
  /// Returns true when the CPU may read and write this device's memory in place, ordered
  /// by waiting for its events on the host (the host device: its memory is host memory).
  /// The full-offload manager then reads the gradients a step holds on the device and
  /// writes the step's compute weights where they are, instead of copying them through
  /// its fetch and upload rings. Default false.
  virtual bool host_accessible() const noexcept { return false; }

  /// Returns `bytes` of device memory (256-byte aligned, zero-filled; synchronous).
  virtual void* allocate(std::size_t bytes) = 0;
  /// Frees device memory from allocate(); waits for queued work first (CUDA: bounded by
  /// the device's wait timeout; past it the memory is abandoned, not freed). Never throws.
  virtual void deallocate(void* p) noexcept = 0;
  /// Returns `bytes` of host memory the copy queues transfer asynchronously from/to:
  /// page-locked on CUDA, placed on `numa_node` (>= 0) (256-byte aligned, zero-filled).
  virtual void* allocate_host(std::size_t bytes, int numa_node = -1) = 0;
  /// Frees memory from allocate_host(); waits for queued work first (bounded as
  /// deallocate()). Never throws.
  virtual void deallocate_host(void* p) noexcept = 0;
  /// Throws Errc::invalid_argument naming `name` unless [p, p + bytes) is memory this
  /// device's kernels may use: its allocate()'s, or (CUDA) device memory of this very
  /// device or managed memory, or (host device) as its HostDeviceMemory says. A manager
  /// checks a caller's buffer with it once, before any work (another GPU's pointer would
  /// fault in a kernel with a sticky illegal-address error).
  virtual void check_memory(const void* p, std::size_t bytes, const std::string& name) const = 0;

  /// Enqueues a copy of `bytes` from `src` to `dst` (device or host memory, either
  /// direction) on queue `q`.
  virtual void copy(Queue q, void* dst, const void* src, std::size_t bytes) = 0;
  /// Enqueues dst[0, bytes) = 0 on queue `q`. Capturable into a CUDA graph, host memory
  /// too (a host callback whose argument the device keeps until the buffer is released,
  /// so every replay zeroes it again).
  virtual void zero(Queue q, void* dst, std::size_t bytes) = 0;
  /// Returns an event recorded on queue `q` now.
  virtual Event record(Queue q) = 0;
  /// Makes queue `q` wait for `e` before running work submitted after this call (a wait
  /// that blocks the caller, see HostEvent, is bounded by wait_timeout()).
  virtual void wait(Queue q, const Event& e) = 0;
  /// Returns an event recorded now on the caller's `stream` (the trainer's backward
  /// stream): CUDA records a CUDA event there; the host device, whose callers have no
  /// stream, returns a complete event (pass nullptr).
  virtual Event record_on(cudaStream_t stream) = 0;
  /// Makes the caller's `stream` wait for `e` before its later work (CUDA:
  /// cudaStreamWaitEvent, no host synchronisation); the host device blocks until `e`
  /// is complete.
  virtual void wait_on(cudaStream_t stream, const Event& e) = 0;
  /// Blocks the calling thread until `e` is complete (e.wait()); raises errors of queued
  /// work.
  virtual void synchronize(const Event& e) = 0;
  /// Blocks until all queues are idle; raises errors of queued work.
  virtual void synchronize() = 0;

  // ---- kernels, enqueued on Queue::compute (contracts: gpu.hpp) ----------------------
  virtual std::size_t norm_workspace_bytes(std::span<const TensorView> d_tensors) const = 0;
  virtual void accumulate(std::span<const AccumulatePair> d_pairs) = 0;
  virtual void scale_and_norm_partial(std::span<const TensorView> d_tensors, float scale,
                                      NormPartial* d_partial, void* d_workspace,
                                      std::size_t workspace_bytes) = 0;
  virtual void norm_partial(std::span<const ConstTensorView> d_tensors, GradientRead read,
                            NormPartial* d_partial, void* d_workspace,
                            std::size_t workspace_bytes) = 0;
  virtual void finalize_and_clip(const NormPartial* d_partial, float max_norm, NormResult* d_result,
                                 float* d_clip, std::int32_t* d_found_inf) = 0;
  virtual void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors,
                                            GradientRead read, const std::int32_t* d_found_inf,
                                            NormPartial* d_exact_partial, void* d_workspace,
                                            std::size_t workspace_bytes) = 0;
  virtual void finalize_exact_and_clip(const NormPartial* d_exact_partial, float max_norm,
                                       NormResult* d_result, float* d_clip,
                                       std::int32_t* d_found_inf) = 0;
  /// The norm passes with the scale (and clip) in device memory, read when the kernels run
  /// (gpu.hpp): what a manager's step enqueues, so no per-step value is a kernel argument.
  virtual void scale_and_norm_partial(std::span<const TensorView> d_tensors, const float* d_scale,
                                      NormPartial* d_partial, void* d_workspace,
                                      std::size_t workspace_bytes) = 0;
  virtual void norm_partial(std::span<const ConstTensorView> d_tensors,
                            const DeviceGradientRead& d_read, NormPartial* d_partial,
                            void* d_workspace, std::size_t workspace_bytes) = 0;
  virtual void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors,
                                            const DeviceGradientRead& d_read,
                                            const std::int32_t* d_found_inf,
                                            NormPartial* d_exact_partial, void* d_workspace,
                                            std::size_t workspace_bytes) = 0;
  /// One step of any optimizer (the alternative `config` holds; gpu::optimizer_step):
  /// step counters, lr, weight decay and the optimizer's table in device memory, read
  /// when the kernels run; found-inf leaves everything, counters too, unchanged.
  virtual void optimizer_step(std::span<const OptimizerTensor> d_tensors,
                              const OptimizerConfig& config, const OptimizerDeviceArgs& d) = 0;

  /// Returns the CUDA stream of Queue::compute (null on the host device): an NCCL
  /// communicator used with this device must enqueue on it.
  virtual cudaStream_t compute_stream() const noexcept = 0;

 protected:
  Device() = default;
};

/// What the host device takes as its "device memory" in kernel arguments.
enum class HostDeviceMemory : std::uint8_t {
  /// Only memory from its allocate(), as a GPU would insist (a host pointer where device
  /// memory is needed is refused, naming the argument): the stand-in GPU of tests.
  allocated_only,
  /// Any host memory: the device of a CPU-only trainer, whose gradients and parameters
  /// are its framework's CPU tensors (caller-owned gradients, compute destinations). A
  /// stray pointer is then not caught as on a GPU.
  any_host_memory,
};

/// Returns the host device: the stand-in GPU of CPU-only tests (see the file comment), or
/// with HostDeviceMemory::any_host_memory the device of a CPU-only trainer.
/// `emulated_threads` is the thread count per block of the CPU executor; `wait_timeout`
/// is its wait_timeout() (its own waits are not bounded: its queues are memcpy workers).
/// Throws Errc::out_of_range naming "wait_timeout" unless it is positive.
std::unique_ptr<Device> make_host_device(
    int emulated_threads = 256, HostDeviceMemory memory = HostDeviceMemory::allocated_only,
    std::chrono::milliseconds wait_timeout = comm::kDefaultTimeout);

/// Returns CUDA device `ordinal` with three new non-blocking streams (or `compute`, when
/// given, as the compute stream: the trainer's stream, so gradients written on it are
/// ordered before the manager's reads; cudaStreamLegacy or cudaStreamPerThread name the
/// default streams). `wait_timeout` bounds the device's own waits for queued work
/// (allocate's zero fill, deallocate, deallocate_host, destruction) and is its
/// wait_timeout(): pass the communicator's timeout() with NCCL. Past it, allocate throws
/// Errc::timeout naming "wait_timeout", and memory the work may still use is abandoned instead of
/// freed. Throws Errc::not_supported without CUDA or a device, Errc::out_of_range naming
/// "wait_timeout" unless it is positive.
std::unique_ptr<Device> make_cuda_device(
    int ordinal = 0, cudaStream_t compute = nullptr,
    std::chrono::milliseconds wait_timeout = comm::kDefaultTimeout);

}  // namespace stepcore::device
