// OffloadGradientManager's worker and errors (managers/offload_manager.hpp): the two task
// lanes it runs, posting and draining them, the bounded waits for the device's work, the
// sticky error an asynchronous failure or a timed-out wait leaves (every later hook
// raises it), and recovery from it.
#include <algorithm>
#include <array>
#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

#include "managers/offload_manager.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

using device::Event;
using device::Queue;

namespace {

// Returns `ep` if it holds a stepcore::Error, else an Errc::internal Error with its text.
std::exception_ptr as_error(std::exception_ptr ep) noexcept {
  try {
    std::rethrow_exception(ep);
  } catch (const Error&) {
    return ep;
  } catch (const std::exception& e) {
    return std::make_exception_ptr(Error(Errc::internal, "offload worker", e.what()));
  } catch (...) {
    return std::make_exception_ptr(Error(Errc::internal, "offload worker", "unknown exception"));
  }
}

}  // namespace

void OffloadGradientManager::store_error(std::exception_ptr ep) noexcept {
  const std::lock_guard lock(err_mu_);
  if (!error_) error_ = as_error(ep);
}

void OffloadGradientManager::raise_if_failed() const {
  std::exception_ptr ep;
  {
    const std::lock_guard lock(err_mu_);
    ep = error_;
  }
  if (ep) std::rethrow_exception(ep);
}

Error OffloadGradientManager::timeout_error(Awaited what) const {
  const auto& params = config().params;
  auto param = [&](std::size_t i) { return "parameter '" + params[i].name + "'"; };
  std::string arg, waited;
  switch (what.kind) {
    case Awaited::gradient_copy:
      arg = "params[" + std::to_string(what.index) + "].gradient";
      waited = "the copy of " + param(what.index) +
               "'s gradient to host staging (queued after the trainer's written event)";
      break;
    case Awaited::upload:
      arg = "params[" + std::to_string(what.index) + "].compute_weights";
      waited = "the upload of " + param(what.index) + "'s compute weights";
      break;
    case Awaited::chunk_upload: {
      const Chunk& c = chunks()[what.index];
      arg = "chunks[" + std::to_string(what.index) + "].compute_weights";
      waited = "the upload of the compute weights of chunk " + std::to_string(what.index) +
               " (parameters " + std::to_string(c.first) + ".." + std::to_string(c.last - 1) + ")";
      break;
    }
    case Awaited::read_back:
      arg = "params[" + std::to_string(what.index) + "].compute_weights";
      waited = "the read-back of " + param(what.index) + "'s compute weights";
      break;
    case Awaited::queues:
      arg = "wait_timeout";
      waited = "the work queued on the device's copy queues";
      break;
  }
  return Error(Errc::timeout, arg,
               waited + " did not complete within " + std::to_string(dev_.wait_timeout().count()) +
                   " ms (the wait_timeout of device " + std::string(dev_.name()) +
                   "): the manager is failed; load_checkpoint recovers it once the device's "
                   "queues move again");
}

void OffloadGradientManager::sync_event(const Event& e, Awaited what) {
  // Wait without the lock (the other thread keeps enqueueing), then let the device raise
  // its errors under the lock, so that no two threads ever collect them at once.
  if (!e.empty()) {
    bool done = false;
    try {
      done = e.wait_for(dev_.wait_timeout());
    } catch (...) {
      store_error(std::current_exception());
      raise_if_failed();
    }
    if (!done) {
      store_error(std::make_exception_ptr(timeout_error(what)));
      raise_if_failed();
    }
  }
  on_device([&] { dev_.synchronize(e); });
}

bool OffloadGradientManager::failed_by_timeout() const noexcept {
  std::exception_ptr ep;
  {
    const std::lock_guard lock(err_mu_);
    ep = error_;
  }
  if (!ep) return false;
  try {
    std::rethrow_exception(ep);
  } catch (const Error& e) {
    return e.code() == Errc::timeout;
  } catch (...) {
  }
  return false;
}

bool OffloadGradientManager::wait_copy_queues(std::chrono::milliseconds bound) {
  std::array<Event, 2> marks;
  {
    const std::lock_guard lock(dev_mu_);
    marks = {dev_.record(Queue::d2h), dev_.record(Queue::h2d)};
  }
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + bound;
  for (const Event& e : marks) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(
        std::max(deadline - clock::now(), clock::duration::zero()));
    if (!e.wait_for(left)) return false;
  }
  const std::lock_guard lock(dev_mu_);
  for (const Event& e : marks) dev_.synchronize(e);
  return true;
}

std::uint64_t OffloadGradientManager::post(std::function<void()> task, Lane lane) {
  std::uint64_t seq;
  {
    const std::lock_guard lock(mu_);
    tasks_[lane].push_back(std::move(task));
    seq = ++posted_[lane];
  }
  task_cv_.notify_one();
  return seq;
}

void OffloadGradientManager::wait_done(Lane lane, std::uint64_t seq) const {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return done_[lane] >= seq; });
}

void OffloadGradientManager::drain(Lane lane) {
  std::uint64_t seq;
  {
    const std::lock_guard lock(mu_);
    seq = posted_[lane];
  }
  wait_done(lane, seq);
  raise_if_failed();
}

void OffloadGradientManager::drain() {
  drain(main);
  drain(late);
}

void OffloadGradientManager::worker_loop() {
  for (;;) {
    std::function<void()> task;
    Lane lane;
    {
      std::unique_lock lock(mu_);
      task_cv_.wait(lock, [&] { return stop_ || !tasks_[main].empty() || !tasks_[late].empty(); });
      lane = !tasks_[main].empty() ? main : late;
      if (tasks_[lane].empty()) return;  // stop_ and drained
      task = std::move(tasks_[lane].front());
      tasks_[lane].pop_front();
    }
    bool failed;
    {
      const std::lock_guard lock(err_mu_);
      failed = error_ != nullptr;
    }
    if (!failed) {  // after a failure the state is suspect: later tasks are skipped
      try {
        task();
      } catch (...) {
        store_error(std::current_exception());
      }
    }
    {
      const std::lock_guard lock(mu_);
      ++done_[lane];
    }
    done_cv_.notify_all();
  }
}

void OffloadGradientManager::do_recover() {
  std::uint64_t seq;
  {
    const std::lock_guard lock(mu_);
    seq = posted_[main];
  }
  wait_done(main, seq);  // the worker skipped the failed step's remaining tasks
  {
    const std::lock_guard lock(mu_);
    seq = posted_[late];
  }
  wait_done(late, seq);
  // The queued work, bounded (a copy still stuck behind a trainer's event keeps the
  // manager failed: a later load_checkpoint tries again); its errors are the stored one's.
  // A pass stops at the first error it collects, and one failure reaches the device's
  // next caller and the events after the lost work (both queues'): passes repeat until
  // one collects nothing, so the raising pass below meets only a new failure.
  bool drained = true;
  for (int pass = 0; pass < kRecoverPasses; ++pass) {
    try {
      drained = wait_copy_queues(dev_.wait_timeout());
      break;
    } catch (const Error&) {
    }
  }
  // Then once more, raising: a device that fails again cannot continue.
  if (!drained || !wait_copy_queues(dev_.wait_timeout())) throw timeout_error({Awaited::queues, 0});
  {
    const std::lock_guard lock(err_mu_);
    error_ = nullptr;
  }
  norm_known_ = false;
  norm_ = NormResult{};
  clip_ = 1.0f;
  report_ = StepReport{};
  holding_ = false;  // the failed step's gradients are not read again
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
  // The failed step's events: its work has drained, and an event after the lost work
  // would raise the failure again in a later step.
  for (auto* events : {&upload_done_, &fetched_, &released_})
    std::fill(events->begin(), events->end(), device::Event());
  last_d2h_ = device::Event();
  {
    const std::lock_guard lock(dev_mu_);
    last_upload_ = device::Event();
  }
}

}  // namespace stepcore::detail
