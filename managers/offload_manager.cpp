// OffloadGradientManager (managers/offload_manager.hpp): construction (the device, pinned
// and host state slabs carved into each parameter's views, the state pages placed, the
// worker started), the state's import and export, and close.
#include "managers/offload_manager.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "managers/common.hpp"
#include "managers/factories.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

using device::Event;
using device::Queue;

OffloadGradientManager::OffloadGradientManager(ManagerConfig config)
    : ManagerImpl(std::move(config)), dev_(*this->config().device), engine_(this->config().engine) {
  const ManagerConfig& cfg = this->config();
  // Layouts: device (gradients, compute weights), pinned (staging, upload buffers) and
  // host state (acc, master, state slots), each one slab of 256-byte aligned views: per
  // parameter i views 2i, 2i + 1 of the device and pinned slabs, kStateViews * i + v of
  // the state (v = 0 acc, 1 master, 2 + s slot s).
  SlabViews dev_views, pin_views, state_views;
  for (const ParamSpec& p : cfg.params) {
    const std::size_t gb = p.numel * dtype_size(p.grad_dtype);
    const std::size_t cb = p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0;
    const std::size_t fb = p.numel * sizeof(float);
    // Device: the gradient and compute buffers the caller does not provide.
    dev_views.add(p.gradient_buffer ? gb : 0);
    dev_views.add(p.compute_into.data == nullptr && p.compute_into.numel == 0 ? cb : 0);
    pin_views.add(gb);
    pin_views.add(cb);
    for (std::size_t v = 0; v < kStateViews; ++v) state_views.add(v < 1 + slots() ? fb : 0);
  }
  const SlabLayout dl = dev_views.layout(), pl = pin_views.layout(), sl = state_views.layout();
  state_ = numa::HostBuffer(std::max<std::size_t>(sl.total_bytes, 1), cfg.numa_node);
  dev_slab_ = dev_.allocate(slab_allocation_bytes(dl));
  try {
    pinned_slab_ = dev_.allocate_host(slab_allocation_bytes(pl), cfg.numa_node);
    carve(dl, pl, sl);
  } catch (...) {
    if (pinned_slab_ != nullptr) dev_.deallocate_host(pinned_slab_);
    dev_.deallocate(dev_slab_);
    throw;
  }
  worker_ = std::thread([this] { worker_loop(); });  // last: nothing below can throw
}

void OffloadGradientManager::carve(const SlabLayout& dl, const SlabLayout& pl,
                                   const SlabLayout& sl) {
  const ManagerConfig& cfg = config();
  const std::size_t n = cfg.params.size();
  auto at = [](void* base, std::size_t off) { return static_cast<char*>(base) + off; };
  auto f32_at = [&](std::size_t off, std::size_t numel) {
    return f32_view(reinterpret_cast<float*>(at(state_.data(), off)), numel);
  };
  params_.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const ParamSpec& p = cfg.params[i];
    const std::size_t cn = p.has_compute_weights ? p.numel : 0;
    Param& v = params_[i];
    if (p.gradient_buffer) v.grad = {at(dev_slab_, dl.offsets[2 * i]), p.numel, p.grad_dtype};
    if (p.compute_into.data != nullptr || p.compute_into.numel != 0)
      v.compute = p.compute_into;  // the caller's storage (validated by the base)
    else
      v.compute = {cn ? at(dev_slab_, dl.offsets[2 * i + 1]) : nullptr, cn, p.compute_dtype};
    v.staging = {at(pinned_slab_, pl.offsets[2 * i]), p.numel, p.grad_dtype};
    v.out = {cn ? at(pinned_slab_, pl.offsets[2 * i + 1]) : nullptr, cn, p.compute_dtype};
    v.acc = f32_at(sl.offsets[kStateViews * i], p.numel);
    for (std::size_t s = 0; s < slots(); ++s)
      v.state[s] = f32_at(sl.offsets[kStateViews * i + 1 + s], p.numel);
    if (p.counts_toward_norm) counted_acc_.push_back(v.acc);
  }
  steps_.assign(n, 0.0f);
  spec_steps_.assign(n, 0.0f);
  staging_task_.assign(n, 0);
  released_.resize(n);
  const std::size_t nchunks = chunks().size();
  has_spare_.assign(nchunks, 0);
  has_stage_.assign(nchunks, 0);
  chunk_compute_bytes_.assign(nchunks, 0);
  speculated_.assign(nchunks, 0);
  chunk_partial_.assign(nchunks, NormPartial{});
  chunk_state_bytes_.assign(nchunks, 0);
  // Place the state pages: each chunk's buffers touched in the partition its step uses.
  chunk_counted_.resize(nchunks);
  auto aligned = [](std::size_t bytes) {
    return (bytes + kSlabViewAlignment - 1) / kSlabViewAlignment * kSlabViewAlignment;
  };
  for (std::size_t k = 0; k < nchunks; ++k) {
    // One list per array (acc, then each slot), as the step partitions its tensors.
    std::vector<std::vector<TensorView>> touch(1 + slots());
    for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i) {
      touch[0].push_back(params_[i].acc);
      for (std::size_t s = 0; s < slots(); ++s) {
        touch[1 + s].push_back(params_[i].state[s]);
        chunk_state_bytes_[k] += aligned(params_[i].state[s].bytes());
      }
      chunk_compute_bytes_[k] += aligned(params_[i].out.bytes());
      if (cfg.params[i].counts_toward_norm) chunk_counted_[k].push_back(params_[i].acc);
    }
    for (const auto& list : touch) engine_.first_touch(list);
  }
}

void OffloadGradientManager::do_import_parameter(std::size_t i, Arrays<const float> arrays,
                                                 float step) {
  drain();
  wait_uploads();
  Param& p = params_[i];
  for (std::size_t s = 0; s < slots(); ++s) {
    const TensorView& dst = p.state[s];
    if (dst.numel == 0) continue;
    if (!arrays[s].empty()) {
      std::memcpy(dst.data, arrays[s].data(), dst.bytes());
    } else {  // a slot's initial value (the master is never empty here)
      float* d = static_cast<float*>(dst.data);
      std::fill(d, d + dst.numel, initial_slot_value(s - 1));
    }
  }
  steps_[i] = step;
  if (p.out.numel == 0) return;
  round_into(arrays[0], p.out);
  const Event e = on_device([&] {
    dev_.copy(Queue::h2d, p.compute.data, p.out.data, p.out.bytes());
    last_upload_what_ = {Awaited::upload, i};
    return last_upload_ = dev_.record(Queue::h2d);
  });
  sync_event(e, {Awaited::upload, i});
}

ConstTensorView OffloadGradientManager::do_compute_weights(std::size_t i) const {
  raise_if_failed();
  return params_[i].compute;
}

void OffloadGradientManager::do_read_parameter(std::size_t i, Arrays<float> arrays,
                                               std::span<std::uint8_t> compute) {
  drain();
  wait_uploads();
  const Param& p = params_[i];
  for (std::size_t s = 0; s < slots(); ++s)
    if (!arrays[s].empty()) std::memcpy(arrays[s].data(), p.state[s].data, arrays[s].size_bytes());
  if (compute.empty()) return;
  // What the device holds, through the (idle) pinned upload buffer.
  const Event e = on_device([&] {
    dev_.copy(Queue::d2h, p.out.data, p.compute.data, p.out.bytes());
    return dev_.record(Queue::d2h);
  });
  sync_event(e, {Awaited::read_back, i});
  std::memcpy(compute.data(), p.out.data, compute.size());
}

void OffloadGradientManager::do_step_counts(std::span<float> out) {
  drain();
  std::copy(steps_.begin(), steps_.end(), out.begin());
}

ManagerImpl::HostArrays OffloadGradientManager::do_host_state(std::size_t i) {
  drain();
  wait_uploads();
  const Param& p = params_[i];
  HostArrays h;
  for (std::size_t s = 0; s < slots(); ++s)
    h.a[s] = {static_cast<const float*>(p.state[s].data), p.state[s].numel};
  return h;
}

void OffloadGradientManager::do_synchronize() {
  drain();
  wait_uploads();
  sync_event(last_d2h_, {Awaited::gradient_copy, last_d2h_param_});
}

std::exception_ptr OffloadGradientManager::do_close() noexcept {
  if (closed_) return nullptr;
  closed_ = true;
  {
    const std::lock_guard lock(mu_);
    stop_ = true;
  }
  task_cv_.notify_all();
  // Runs the queued tasks (skipped after a failure); each of their waits is bounded.
  if (worker_.joinable()) worker_.join();
  // The copy queues, bounded (not waited for again when a wait already timed out):
  // past the bound, queued copies may still read or write the slabs, so they are left to
  // the device (freed with it), never freed under the copies.
  bool drained = true;
  try {
    drained =
        wait_copy_queues(failed_by_timeout() ? std::chrono::milliseconds(0) : dev_.wait_timeout());
    if (!drained) store_error(std::make_exception_ptr(timeout_error({Awaited::queues, 0})));
  } catch (...) {
    store_error(std::current_exception());
  }
  if (drained) {
    if (pinned_slab_ != nullptr) dev_.deallocate_host(pinned_slab_);
    if (dev_slab_ != nullptr) dev_.deallocate(dev_slab_);
    if (stage_space_ != nullptr) dev_.deallocate(stage_space_);
  }
  pinned_slab_ = dev_slab_ = stage_space_ = nullptr;
  state_ = numa::HostBuffer{};
  spare_space_ = numa::HostBuffer{};
  const std::lock_guard lock(err_mu_);
  return error_;
}

std::unique_ptr<ManagerImpl> make_offload_gradient_manager(ManagerConfig config) {
  return std::make_unique<OffloadGradientManager>(std::move(config));
}

}  // namespace stepcore::detail
