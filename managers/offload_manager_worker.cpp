// OffloadGradientManager's worker and errors (managers/offload_manager.hpp): the two task
// lanes it runs, posting and draining them, the sticky error an asynchronous failure
// leaves (every later hook raises it), and recovery from it.
#include <exception>
#include <functional>
#include <mutex>
#include <utility>

#include "managers/offload_manager.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

using device::Event;

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

void OffloadGradientManager::sync_event(const Event& e) {
  // Wait without the lock (the other thread keeps enqueueing), then let the device raise
  // its errors under the lock, so that no two threads ever collect them at once.
  if (!e.empty()) {
    try {
      e.wait();
    } catch (...) {
      store_error(std::current_exception());
      raise_if_failed();
    }
  }
  on_device([&] { dev_.synchronize(e); });
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

void OffloadGradientManager::wait_done(Lane lane, std::uint64_t seq) {
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
  {
    const std::lock_guard lock(dev_mu_);
    try {
      dev_.synchronize();  // the queued work; its errors are the stored one's
    } catch (const Error&) {
    }
    dev_.synchronize();  // a device that fails again cannot continue
  }
  {
    const std::lock_guard lock(err_mu_);
    error_ = nullptr;
  }
  norm_known_ = false;
  norm_ = NormResult{};
  clip_ = 1.0f;
  report_ = StepReport{};
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
}

}  // namespace stepcore::detail
