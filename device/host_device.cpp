// The host device, the stand-in GPU of CPU-only tests: "device memory" is 256-byte
// aligned host memory, Queue::compute runs inline on the calling thread through
// gpu::emulate (the kernels' own block bodies), Queue::d2h and Queue::h2d are worker
// threads running FIFOs of memcpy/memset tasks, and events are mutex + condition variable.
//
// Errors of queued work: the first one is stored and every later copy, zero and wait is
// skipped (event markers still complete, so nothing waits forever); the next
// synchronize() or enqueueing call drains the queues and raises it, once, after which
// the device runs new work again. Work that failed or was skipped is never lost without
// a trace: the first event recorded on its queue after it completes carrying that error,
// and the first synchronize(event) (or compute wait) of any event carrying it raises it,
// whoever took the device's stored error first (unless that caller named the same
// queue: it has been told); a queue told to wait for such an event counts its own next
// piece of work as lost in the same way. So a failure reaches two callers at most: the
// device's next caller, and the owner of the lost work.
#include "device/host_device.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/validate.hpp"
#include "device/device_internal.hpp"
#include "kernels/checked_plans.hpp"
#include "kernels/plan_cache.hpp"
#include "kernels/plans.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"
#include "stepcore/numa.hpp"

namespace stepcore::device {

// The interface's out-of-line members, defined once for both devices (this file is in
// every build).
Event::State::~State() = default;
bool Event::complete() const { return state_ == nullptr || state_->complete(); }
void Event::wait() const {
  if (state_ != nullptr) state_->wait();
}
bool Event::wait_for(std::chrono::milliseconds timeout) const {
  return state_ == nullptr || state_->wait_for(timeout);
}
Device::~Device() = default;

namespace {

constexpr std::size_t kAlignment = 256;

// An event of the host device: set once by the queue's marker task (or born complete),
// with the error of lost work before it on its queue, if any.
class HostEventState final : public Event::State {
 public:
  explicit HostEventState(bool done) : done_(done) {}
  // The error it completed with, left in place (null while none or incomplete).
  std::exception_ptr error() {
    const std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  // The error it completed with, handed over once.
  std::exception_ptr take_error() {
    const std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(error_, nullptr);
  }
  bool complete() override {
    const std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
  }
  bool wait_for(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [this] { return done_; });
  }
  void set(std::exception_ptr error = nullptr) {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      error_ = std::move(error);
      done_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_;
  std::exception_ptr error_;
};

// The host event behind `e`, or null (an empty event, or another device's).
HostEventState* host_state(const Event& e) {
  return dynamic_cast<HostEventState*>(e.state().get());
}

// The first error of queued work, shared by the queues; failed() makes them skip work.
class Failure {
 public:
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  void set(std::exception_ptr e) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (!first_) first_ = std::move(e);
    failed_.store(true, std::memory_order_release);
  }
  // Returns the stored error and clears the failed state.
  std::exception_ptr take() {
    const std::lock_guard<std::mutex> lock(mu_);
    failed_.store(false, std::memory_order_release);
    return std::exchange(first_, nullptr);
  }
  // The stored error, left in place (null while none).
  std::exception_ptr peek() {
    const std::lock_guard<std::mutex> lock(mu_);
    return first_;
  }
  // Whether `e`, carried by an event, is to be raised: true the first time an event hands
  // it over (the stored error, if it is `e`, then counts as raised), false after that.
  bool raise_through_event(const std::exception_ptr& e) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (e == raised_by_event_) return false;
    raised_by_event_ = e;
    if (first_ == e) {
      first_ = nullptr;
      failed_.store(false, std::memory_order_release);
    }
    return true;
  }

 private:
  std::mutex mu_;
  std::exception_ptr first_;
  std::exception_ptr raised_by_event_;  // the last error an event handed over
  std::atomic<bool> failed_{false};
};

// Rethrows a stored error as stepcore::Error (an Error as it is, anything else internal).
[[noreturn]] void raise_error(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& x) {
    throw Error(Errc::internal, "device", std::string("host device queue: ") + x.what());
  } catch (...) {
    throw Error(Errc::internal, "device", "host device queue: unknown exception");
  }
}

// One task of a copy queue: work (a copy or zero), a marker completing an event, or a
// wait for an event. Markers run even after a failure; work and waits are skipped.
struct Task {
  std::function<void()> run;
  std::shared_ptr<HostEventState> marks;  // a marker: the event it completes
  std::shared_ptr<Event::State> awaits;   // a wait: the event the queue waits for
};

// One in-order copy queue: a worker thread running its FIFO of tasks.
class Worker {
 public:
  explicit Worker(Failure& failure) : failure_(failure), thread_([this] { loop(); }) {}
  // Runs what is queued, then joins the thread.
  ~Worker() {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void push(Task t) {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(t));
    }
    work_cv_.notify_one();
  }
  // Blocks until every task pushed so far has run (or been skipped).
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [this] { return tasks_.empty() && !busy_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and everything has run
      Task t = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      lock.unlock();
      run(t);
      t = Task{};  // release captured state outside the lock
      lock.lock();
      busy_ = false;
      if (tasks_.empty()) idle_cv_.notify_all();
    }
  }

  // Runs one task on the worker thread. Invariant: lost_ is the error of the first work
  // of this queue that failed or was skipped since its last marker; the next marker
  // carries it and clears it.
  void run(Task& t) {
    if (t.marks) {
      t.marks->set(std::exchange(lost_, nullptr));
      return;
    }
    if (std::exception_ptr first = failure_.peek()) {  // a failure is pending: skip
      if (!lost_) lost_ = std::move(first);
      return;
    }
    if (t.awaits) {
      t.awaits->wait();
      auto* h = dynamic_cast<HostEventState*>(t.awaits.get());
      if (std::exception_ptr e = h != nullptr ? h->error() : nullptr; e && !lost_) lost_ = e;
      return;
    }
    try {
      t.run();
    } catch (...) {
      if (!lost_) lost_ = std::current_exception();
      failure_.set(std::current_exception());
    }
  }

  Failure& failure_;
  std::exception_ptr lost_;  // worker thread only
  std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<Task> tasks_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

class HostDevice final : public Device {
 public:
  HostDevice(int threads, HostDeviceMemory memory, std::chrono::milliseconds wait_timeout)
      : threads_(threads), memory_kind_(memory), wait_timeout_(wait_timeout) {}

  ~HostDevice() override {
    gpu::detail::note_memory_released();  // its memory, and its memory check, go
    d2h_.reset();  // each worker runs what is queued (skipping after a failure), then joins
    h2d_.reset();
    while (!device_mem_.empty()) {
      void* p = device_mem_.first();
      device_mem_.remove(p);
      std::free(p);
    }
  }

  std::string_view name() const noexcept override { return "host"; }
  std::chrono::milliseconds wait_timeout() const noexcept override { return wait_timeout_; }
  bool host_accessible() const noexcept override { return true; }

  void* allocate(std::size_t bytes) override {
    const std::size_t n = bytes == 0 ? 1 : bytes;
    const std::size_t size = (n + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, size);
    if (p == nullptr)
      throw Error(Errc::out_of_range, "bytes",
                  "allocation of " + std::to_string(bytes) + " bytes failed");
    std::memset(p, 0, size);
    device_mem_.add(p, n);
    return p;
  }

  void deallocate(void* p) noexcept override {
    if (p == nullptr || !device_mem_.owns(p)) return;
    gpu::detail::note_memory_released();  // cached calls naming it are checked again
    drain();
    device_mem_.remove(p);
    std::free(p);
  }

  void* allocate_host(std::size_t bytes, int numa_node) override {
    return host_buffers_.add(bytes, numa_node, [](void*, std::size_t) {});  // nothing to pin
  }

  void deallocate_host(void* p) noexcept override {
    if (!host_buffers_.owns(p)) return;
    gpu::detail::note_memory_released();
    drain();
    host_buffers_.remove(p);
  }

  void check_memory(const void* p, std::size_t bytes, const std::string& name) const override {
    require_device(p, bytes, ::stepcore::detail::Arg{name.c_str()});
  }

  void copy(Queue q, void* dst, const void* src, std::size_t bytes) override {
    detail::check_queue(q);
    raise_pending(q);
    detail::check_copy(device_mem_, host_buffers_.ranges(), dst, src, bytes);
    if (bytes == 0) return;
    const bool fail = take_injected(q);
    submit(q, [dst, src, bytes, fail] {
      if (fail) throw Error(Errc::internal, "copy", "injected copy failure");
      std::memcpy(dst, src, bytes);
    });
  }

  void zero(Queue q, void* dst, std::size_t bytes) override {
    detail::check_queue(q);
    raise_pending(q);
    detail::check_zero(device_mem_, host_buffers_.ranges(), dst, bytes);
    if (bytes == 0) return;
    submit(q, [dst, bytes] { std::memset(dst, 0, bytes); });
  }

  Event record(Queue q) override {
    detail::check_queue(q);
    raise_pending(q);
    if (q == Queue::compute) return Event(std::make_shared<HostEventState>(true));
    auto s = std::make_shared<HostEventState>(false);
    worker(q).push(Task{{}, s, {}});
    return Event(std::move(s));
  }

  Event record_on(cudaStream_t stream) override {
    if (stream != nullptr)
      throw Error(Errc::invalid_argument, "stream", "the host device has no CUDA streams");
    return Event(std::make_shared<HostEventState>(true));  // the caller's work is done
  }

  void wait_on(cudaStream_t stream, const Event& e) override {
    if (stream != nullptr)
      throw Error(Errc::invalid_argument, "stream", "the host device has no CUDA streams");
    if (!e.empty()) wait_inline(e);  // the caller's "stream" is the calling thread
  }

  void wait(Queue q, const Event& e) override {
    detail::check_queue(q);
    raise_pending(q);
    if (e.empty()) return;
    if (q == Queue::compute) {
      wait_inline(e);  // compute work runs inline: the "stream wait" is a host wait
      return;
    }
    worker(q).push(Task{{}, {}, e.state()});
  }

  void synchronize(const Event& e) override {
    if (!e.empty()) {
      e.state()->wait();
      raise_event_error(e);
    }
    raise_pending();
  }

  void synchronize() override {
    drain();
    raise_pending();
  }

  std::size_t norm_workspace_bytes(std::span<const TensorView> d_tensors) const override {
    return gpu::scale_and_norm_workspace_bytes(d_tensors);
  }

  void accumulate(std::span<const AccumulatePair> d_pairs) override {
    raise_pending();
    for (const auto& [copy, plan] : gpu::detail::checked_accumulate_plans(d_pairs, memory_))
      gpu::emulate::accumulate(plan, copy, threads_);
  }

  void scale_and_norm_partial(std::span<const TensorView> d_tensors, float scale,
                              NormPartial* d_partial, void* d_workspace,
                              std::size_t workspace_bytes) override {
    raise_pending();
    ::stepcore::detail::validate_scale(d_tensors, scale);
    const gpu::LaunchPlan plan = gpu::detail::checked_norm_plan(
        d_tensors, d_partial, "d_partial", d_workspace, workspace_bytes, memory_);
    *d_partial = gpu::emulate::scale_and_norm_partial(plan, scale, threads_);
  }

  void norm_partial(std::span<const ConstTensorView> d_tensors, GradientRead read,
                    NormPartial* d_partial, void* d_workspace,
                    std::size_t workspace_bytes) override {
    raise_pending();
    ::stepcore::detail::validate_device_read(read);
    const gpu::LaunchPlan plan =
        gpu::detail::checked_norm_plan(gpu::detail::as_views(d_tensors), d_partial, "d_partial",
                                       d_workspace, workspace_bytes, memory_);
    *d_partial = gpu::emulate::norm_partial(plan, read, threads_);
  }

  void finalize_and_clip(const NormPartial* d_partial, float max_norm, NormResult* d_result,
                         float* d_clip, std::int32_t* d_found_inf) override {
    raise_pending();
    gpu::detail::check_finalize_args(d_partial, "d_partial", max_norm, d_result, d_clip,
                                     d_found_inf, memory_);
    NormResult r;
    float clip = 0.0f;
    std::int32_t flag = 0;
    gpu::emulate::finalize_and_clip(*d_partial, max_norm, r, clip, flag);
    *d_result = r;
    *d_clip = clip;
    *d_found_inf = flag;
  }

  void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors, GradientRead read,
                                    const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                    void* d_workspace, std::size_t workspace_bytes) override {
    raise_pending();
    ::stepcore::detail::validate_device_read(read);
    if (d_found_inf == nullptr) throw Error(Errc::null_pointer, "d_found_inf", "null");
    const gpu::LaunchPlan plan =
        gpu::detail::checked_norm_plan(gpu::detail::as_views(d_tensors), d_exact_partial,
                                       "d_exact_partial", d_workspace, workspace_bytes, memory_);
    require_device(d_found_inf, sizeof(std::int32_t), ::stepcore::detail::Arg{"d_found_inf"});
    *d_exact_partial =
        gpu::emulate::exact_norm_partial_if_needed(plan, read, *d_found_inf, threads_);
  }

  void finalize_exact_and_clip(const NormPartial* d_exact_partial, float max_norm,
                               NormResult* d_result, float* d_clip,
                               std::int32_t* d_found_inf) override {
    raise_pending();
    gpu::detail::check_finalize_args(d_exact_partial, "d_exact_partial", max_norm, d_result, d_clip,
                                     d_found_inf, memory_);
    std::int32_t flag = *d_found_inf;
    if (flag != gpu::kFoundInfNeedsExact) return;  // as the kernel: all three unchanged
    NormResult r;
    float clip = 0.0f;
    gpu::emulate::finalize_exact_and_clip(*d_exact_partial, max_norm, r, clip, flag);
    *d_result = r;
    *d_clip = clip;
    *d_found_inf = flag;
  }

  // The device-memory forms: the scalars are checked as pointers and read when the
  // executor runs (now: compute work runs inline).
  void scale_and_norm_partial(std::span<const TensorView> d_tensors, const float* d_scale,
                              NormPartial* d_partial, void* d_workspace,
                              std::size_t workspace_bytes) override {
    raise_pending();
    gpu::detail::check_device_scalar(d_scale, sizeof(float), "d_scale", nullptr);
    ::stepcore::detail::validate_scale_tensors(d_tensors);
    const gpu::LaunchPlan plan = gpu::detail::checked_norm_plan(
        d_tensors, d_partial, "d_partial", d_workspace, workspace_bytes, memory_);
    gpu::detail::check_device_scalar(d_scale, sizeof(float), "d_scale", &memory_);
    *d_partial = gpu::emulate::scale_and_norm_partial(plan, d_scale, threads_);
  }

  void norm_partial(std::span<const ConstTensorView> d_tensors, const DeviceGradientRead& d_read,
                    NormPartial* d_partial, void* d_workspace,
                    std::size_t workspace_bytes) override {
    raise_pending();
    gpu::detail::check_device_read(d_read, nullptr);
    const gpu::LaunchPlan plan =
        gpu::detail::checked_norm_plan(gpu::detail::as_views(d_tensors), d_partial, "d_partial",
                                       d_workspace, workspace_bytes, memory_);
    gpu::detail::check_device_read(d_read, &memory_);
    *d_partial = gpu::emulate::norm_partial(plan, d_read, threads_);
  }

  void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors,
                                    const DeviceGradientRead& d_read,
                                    const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                    void* d_workspace, std::size_t workspace_bytes) override {
    raise_pending();
    gpu::detail::check_device_read(d_read, nullptr);
    if (d_found_inf == nullptr) throw Error(Errc::null_pointer, "d_found_inf", "null");
    const gpu::LaunchPlan plan =
        gpu::detail::checked_norm_plan(gpu::detail::as_views(d_tensors), d_exact_partial,
                                       "d_exact_partial", d_workspace, workspace_bytes, memory_);
    require_device(d_found_inf, sizeof(std::int32_t), ::stepcore::detail::Arg{"d_found_inf"});
    gpu::detail::check_device_read(d_read, &memory_);
    *d_exact_partial =
        gpu::emulate::exact_norm_partial_if_needed(plan, d_read, *d_found_inf, threads_);
  }

  void optimizer_step(std::span<const OptimizerTensor> d_tensors, const OptimizerConfig& config,
                      const OptimizerDeviceArgs& d) override {
    raise_pending();
    gpu::detail::with_checked_optimizer_plan(d_tensors, config, d, memory_, [&](const auto& plan) {
      gpu::emulate::optimizer_step(plan, d, threads_);
    });
  }

  cudaStream_t compute_stream() const noexcept override { return nullptr; }

  // The fault-injection hook (see host_device.hpp).
  void inject(Queue q, int after_n_copies) {
    inject_[static_cast<std::size_t>(q)] = after_n_copies;
  }

 private:
  Worker& worker(Queue q) { return q == Queue::d2h ? *d2h_ : *h2d_; }

  // Blocks the calling thread until `e` is complete (the inline "stream wait" of compute
  // and wait_on); past wait_timeout_ throws Errc::timeout naming "e".
  // Raises the error `e` completed with, if any.
  void wait_inline(const Event& e) {
    if (!e.state()->wait_for(wait_timeout_))
      throw Error(Errc::timeout, "e",
                  "the event did not complete within " + std::to_string(wait_timeout_.count()) +
                      " ms (the wait_timeout of the host device)");
    raise_event_error(e);
  }

  // Raises the error complete event `e` carries, unless an event has raised it before
  // (events kept from a failed phase stay quiet once their owner has been told); the
  // device's stored error, if it is the same one, counts as raised with it.
  void raise_event_error(const Event& e) {
    HostEventState* h = host_state(e);
    if (h == nullptr) return;
    if (std::exception_ptr err = h->take_error(); err && failure_.raise_through_event(err))
      raise_error(err);
  }

  // Runs fn inline (compute) or queues it; an inline failure is stored like a queued one.
  void submit(Queue q, std::function<void()> fn) {
    if (q != Queue::compute) {
      worker(q).push(Task{std::move(fn), {}, {}});
      return;
    }
    try {
      fn();
    } catch (...) {
      failure_.set(std::current_exception());
    }
  }

  void drain() noexcept {
    d2h_->drain();  // an h2d task never queues d2h work: draining in turn suffices
    h2d_->drain();
  }

  // Raises the stored error of queued work, after the queues have drained. Raised by a
  // call naming copy queue `q`, it also settles that queue's lost work: the caller, who
  // orders work on `q`, has been told, and the next event recorded there carries nothing.
  void raise_pending(Queue q = Queue::compute) {
    if (!failure_.failed()) return;
    drain();
    // Another thread (synchronize(Event) may be called from any) can have taken it.
    if (std::exception_ptr e = failure_.take()) {
      if (q != Queue::compute)
        worker(q).push(Task{{}, std::make_shared<HostEventState>(false), {}});
      raise_error(e);
    }
  }

  bool take_injected(Queue q) {
    int& n = inject_[static_cast<std::size_t>(q)];
    if (n < 0) return false;
    if (n-- == 0) return true;  // leaves n at -1: one failure per injection
    return false;
  }

  // Throws unless [p, p + bytes) is device memory of this device.
  void require_device(const void* p, std::size_t bytes, const ::stepcore::detail::Arg& name) const {
    if (memory_kind_ == HostDeviceMemory::any_host_memory) return;  // a CPU trainer's tensors
    if (!device_mem_.check_inside(p, bytes, name))
      throw Error(Errc::invalid_argument, name.str(),
                  "not device memory of this device (from allocate()) where device memory is "
                  "needed");
  }
  // The shared checks' view of this device's memory (kernels/checked_plans.hpp).
  const gpu::detail::MemoryCheck memory_ = [this](const void* p, std::size_t bytes,
                                                  const ::stepcore::detail::Arg& name) {
    require_device(p, bytes, name);
  };

  const int threads_;
  const HostDeviceMemory memory_kind_;
  const std::chrono::milliseconds wait_timeout_;  // wait_timeout(): its users' wait bound
  detail::Allocations device_mem_;
  detail::HostBuffers host_buffers_;
  std::array<int, 3> inject_{-1, -1, -1};
  Failure failure_;
  // Last: destroyed (drained and joined) first, while memory and failure_ still exist.
  std::unique_ptr<Worker> d2h_ = std::make_unique<Worker>(failure_);
  std::unique_ptr<Worker> h2d_ = std::make_unique<Worker>(failure_);
};

}  // namespace

std::unique_ptr<Device> make_host_device(int emulated_threads, HostDeviceMemory memory,
                                         std::chrono::milliseconds wait_timeout) {
  if (emulated_threads < 32 || emulated_threads > 1024 ||
      (emulated_threads & (emulated_threads - 1)) != 0)
    throw Error(Errc::out_of_range, "emulated_threads", "must be a power of two in [32, 1024]");
  if (memory != HostDeviceMemory::allocated_only && memory != HostDeviceMemory::any_host_memory)
    throw Error(Errc::invalid_argument, "memory", "not a HostDeviceMemory");
  if (wait_timeout.count() <= 0)
    throw Error(Errc::out_of_range, "wait_timeout", "the device's wait bound must be positive");
  return std::make_unique<HostDevice>(emulated_threads, memory, wait_timeout);
}

namespace detail {

void inject_copy_failure(Device& host_device, Queue q, int after_n_copies) {
  auto* host = dynamic_cast<HostDevice*>(&host_device);
  if (host == nullptr)
    throw Error(Errc::invalid_argument, "host_device", "not a device from make_host_device");
  check_queue(q);
  if (after_n_copies < 0) throw Error(Errc::invalid_argument, "after_n_copies", "must be >= 0");
  host->inject(q, after_n_copies);
}

Event make_manual_event() { return Event(std::make_shared<HostEventState>(false)); }

void complete_manual_event(const Event& e) {
  auto* s = dynamic_cast<HostEventState*>(e.state().get());
  if (s == nullptr) throw Error(Errc::invalid_argument, "e", "not from make_manual_event()");
  s->set();
}

}  // namespace detail

HostEvent::HostEvent() : event_(detail::make_manual_event()) {}

void HostEvent::set() const noexcept {
  static_cast<HostEventState*>(event_.state().get())->set();  // made by make_manual_event
}

}  // namespace stepcore::device
