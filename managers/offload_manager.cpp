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
  ring_ = ring_geometry(cfg);
  // Layouts: device (gradients, compute weights: views 2i, 2i + 1), host state (master
  // and slots: view kMaxSlots * i + s), each one slab of 256-byte aligned views; the
  // pinned slab holds the three rings.
  SlabViews dev_views, state_views;
  std::size_t grad_bytes = 1, compute_bytes = 1;  // the widest element of each ring
  for (std::size_t i = 0; i < cfg.params.size(); ++i) {
    const ParamSpec& p = cfg.params[i];
    const std::size_t gb = p.numel * dtype_size(p.grad_dtype);
    const std::size_t cb = p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0;
    // Device: the gradient and compute buffers the caller does not provide.
    dev_views.add(p.gradient_buffer ? gb : 0);
    dev_views.add(p.compute_into.data == nullptr && p.compute_into.numel == 0 ? cb : 0);
    // Host: the master and the slots (an 8-bit slot's codes), then the 8-bit slots' maxima.
    const bool q8 = q8_param(i);
    for (std::size_t v = 0; v < kMaxSlots; ++v)
      state_views.add(v >= slots() ? 0 : q8 && v != 0 ? p.numel : p.numel * sizeof(float));
    for (std::size_t v = 1; v < kMaxSlots; ++v)
      state_views.add(q8 && v < slots() ? q8_blocks(p.numel) * sizeof(float) : 0);
    grad_bytes = std::max(grad_bytes, dtype_size(p.grad_dtype));
    if (p.has_compute_weights) compute_bytes = std::max(compute_bytes, dtype_size(p.compute_dtype));
  }
  const std::size_t slot_span = ring_.slots * ring_.slot_elements;
  SlabViews pin_views;
  pin_views.add(slot_span * grad_bytes);     // staging
  pin_views.add(slot_span * compute_bytes);  // upload
  pin_views.add(slot_span * grad_bytes);     // fetch
  const SlabLayout dl = dev_views.layout(), pl = pin_views.layout(), sl = state_views.layout();
  state_ = numa::HostBuffer(std::max<std::size_t>(sl.total_bytes, 1), cfg.numa_node);
  dev_slab_ = dev_.allocate(slab_allocation_bytes(dl));
  try {
    pinned_slab_ = dev_.allocate_host(slab_allocation_bytes(pl), cfg.numa_node);
    carve(dl, sl);
  } catch (...) {
    if (pinned_slab_ != nullptr) dev_.deallocate_host(pinned_slab_);
    dev_.deallocate(dev_slab_);
    throw;
  }
  auto pinned = [&](std::size_t v) { return static_cast<char*>(pinned_slab_) + pl.offsets[v]; };
  staging_ring_ = {pinned(0), grad_bytes, ring_.slot_elements};
  upload_ring_ = {pinned(1), compute_bytes, ring_.slot_elements};
  fetch_ring_ = {pinned(2), grad_bytes, ring_.slot_elements};
  staging_task_.assign(ring_.slots, 0);
  upload_done_.resize(ring_.slots);
  fetched_.resize(ring_.slots);

  // The ledger: every kind this mode holds, in report order.
  MemoryLedger& book = ledger();
  for (std::size_t s = 0; s < slots(); ++s) {
    std::size_t bytes = 0;
    for (std::size_t i = 0; i < cfg.params.size(); ++i) bytes += array_bytes(i, s);
    book.set(s == 0 ? std::string_view("master") : shape().slot_names[s - 1], false, bytes);
  }
  book.set("accumulator", false, 0);
  book.set("staging", false, slot_span * grad_bytes);
  book.set("upload", false, slot_span * compute_bytes);
  book.set("fetch", false, slot_span * grad_bytes);
  book.set("speculation", false, 0);
  book.set("gradient", true, 0);
  book.set("compute", true, 0);
  for (std::size_t i = 0; i < cfg.params.size(); ++i) {
    const ParamSpec& p = cfg.params[i];
    if (p.gradient_buffer)
      book.add("gradient", true, aligned_bytes(p.numel * dtype_size(p.grad_dtype)));
    if (p.has_compute_weights && p.compute_into.data == nullptr && p.compute_into.numel == 0)
      book.add("compute", true, aligned_bytes(p.numel * dtype_size(p.compute_dtype)));
  }
  book.set("speculation_device", true, 0);
  worker_ = std::thread([this] { worker_loop(); });  // last: nothing below can throw
}

void OffloadGradientManager::carve(const SlabLayout& dl, const SlabLayout& sl) {
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
    const std::size_t* views = &sl.offsets[kStateViews * i];
    for (std::size_t s = 0; s < slots(); ++s) {
      if (s == 0 || !q8_param(i)) {
        v.state[s] = f32_at(views[s], p.numel);
        continue;
      }
      v.q8[s - 1] = {reinterpret_cast<std::uint8_t*>(at(state_.data(), views[s])),
                     reinterpret_cast<float*>(at(state_.data(), views[kMaxSlots + s - 1]))};
    }
  }
  steps_.assign(n, 0.0f);
  spec_steps_.assign(n, 0.0f);
  released_.resize(n);
  const std::size_t nchunks = chunks().size();
  has_spare_.assign(nchunks, 0);
  has_stage_.assign(nchunks, 0);
  chunk_compute_bytes_.assign(nchunks, 0);
  speculated_.assign(nchunks, 0);
  chunk_partial_.assign(nchunks, NormPartial{});
  chunk_state_bytes_.assign(nchunks, 0);
  chunk_counted_.resize(nchunks);
  // Place the state pages: each chunk's buffers touched in the partition its step uses.
  for (std::size_t k = 0; k < nchunks; ++k) {
    // One list per array (each slot), as the step partitions its tensors.
    std::vector<std::vector<TensorView>> touch(slots());
    for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i) {
      for (std::size_t s = 0; s < slots(); ++s) {
        // An 8-bit slot's pages as f32 views of its codes' and maxima's bytes: placed
        // where the threads that step its blocks run (the split follows the elements).
        const Q8Slot& q = s == 0 ? Q8Slot{} : params_[i].q8[s - 1];
        const std::size_t numel = cfg.params[i].numel;
        if (q.codes != nullptr) {
          touch[s].push_back(f32_view(reinterpret_cast<float*>(q.codes), (numel + 3) / 4));
          touch[s].push_back(f32_view(q.absmax, q8_blocks(numel)));
        } else {
          touch[s].push_back(params_[i].state[s]);
        }
        chunk_state_bytes_[k] += array_bytes(i, s);
      }
      if (cfg.params[i].has_compute_weights)
        chunk_compute_bytes_[k] +=
            aligned_bytes(cfg.params[i].numel * dtype_size(cfg.params[i].compute_dtype));
    }
    for (const auto& list : touch) engine_.first_touch(list);
  }
}

std::size_t OffloadGradientManager::array_bytes(std::size_t i, std::size_t s) const {
  const std::size_t numel = config().params[i].numel;
  if (s == 0 || !q8_param(i)) return aligned_bytes(numel * sizeof(float));
  return aligned_bytes(numel) + aligned_bytes(q8_blocks(numel) * sizeof(float));
}

void OffloadGradientManager::allocate_accumulators() {
  const ManagerConfig& cfg = config();
  SlabViews views;
  for (const ParamSpec& p : cfg.params) views.add(p.numel * sizeof(float));
  const SlabLayout l = views.layout();
  // Allocated here (a refusal fails nothing), placed by the worker: after construction
  // only the worker runs the engine (its thread team), and it is idle until this returns.
  numa::HostBuffer space(std::max<std::size_t>(l.total_bytes, 1), cfg.numa_node);
  post([this, &l, &space] { place_accumulators(l, std::move(space)); }, main);
  drain(main);
}

void OffloadGradientManager::place_accumulators(const SlabLayout& l, numa::HostBuffer space) {
  const ManagerConfig& cfg = config();
  acc_space_ = std::move(space);
  acc_bytes_ = 0;  // what the ledger counts: each view's aligned bytes
  for (const ParamSpec& p : cfg.params) acc_bytes_ += aligned_bytes(p.numel * sizeof(float));
  for (std::size_t i = 0; i < cfg.params.size(); ++i) {
    params_[i].acc =
        f32_view(reinterpret_cast<float*>(static_cast<char*>(acc_space_.data()) + l.offsets[i]),
                 cfg.params[i].numel);
    if (cfg.params[i].counts_toward_norm) {
      counted_acc_.push_back(params_[i].acc);
      chunk_counted_[chunk_of(i)].push_back(params_[i].acc);
    }
  }
  for (const Chunk& c : chunks()) {  // each chunk's pages where its step runs
    std::vector<TensorView> touch;
    for (std::size_t i = c.first; i < c.last; ++i) touch.push_back(params_[i].acc);
    engine_.first_touch(touch);
  }
  ledger().set("accumulator", false, acc_bytes_);
}

void OffloadGradientManager::do_import_parameter(std::size_t i, Arrays<const float> arrays, Q8In q8,
                                                 float step) {
  drain();
  wait_uploads();
  Param& p = params_[i];
  const std::size_t numel = config().params[i].numel;
  for (std::size_t s = 0; s < q8.size(); ++s) {
    const Q8Slot& dst = p.q8[s];
    if (!q8[s].codes.empty()) {
      std::memcpy(dst.codes, q8[s].codes.data(), numel);
      std::memcpy(dst.absmax, q8[s].absmax.data(), q8[s].absmax.size_bytes());
    } else {  // the initial value 0: the zero code, maxima 0 (no 8-bit slot starts elsewhere)
      std::memset(dst.codes, q8_zero_code(slot_non_negative(shape().name, shape().slot_names[s])),
                  numel);
      std::fill(dst.absmax, dst.absmax + q8_blocks(numel), 0.0f);
    }
  }
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
  if (p.compute.numel == 0) return;
  upload_rounded_range(i, 0, p.compute.numel);
  wait_uploads();
}

void OffloadGradientManager::do_import_range(std::size_t i, std::size_t offset,
                                             Arrays<const float> arrays, float step, bool last) {
  drain();
  Param& p = params_[i];
  for (std::size_t s = 0; s < slots(); ++s)
    if (!arrays[s].empty())
      std::memcpy(static_cast<float*>(p.state[s].data) + offset, arrays[s].data(),
                  arrays[s].size_bytes());
  if (!arrays[0].empty() && p.compute.numel != 0) upload_rounded_range(i, offset, arrays[0].size());
  if (last) {
    steps_[i] = step;
    wait_uploads();
  }
}

void OffloadGradientManager::do_import_q8_range(std::size_t i, std::size_t s, bool absmax,
                                                std::size_t offset,
                                                std::span<const std::byte> bytes) {
  drain();
  const Q8Slot& q = params_[i].q8[s];
  if (absmax)
    std::memcpy(q.absmax + offset, bytes.data(), bytes.size());
  else
    std::memcpy(q.codes + offset, bytes.data(), bytes.size());
}

ConstTensorView OffloadGradientManager::do_compute_weights(std::size_t i) const {
  raise_if_failed();
  return params_[i].compute;
}

void OffloadGradientManager::do_read_parameter(std::size_t i, Arrays<float> arrays, Q8Out q8,
                                               std::span<std::uint8_t> compute) {
  drain();
  wait_uploads();
  const Param& p = params_[i];
  for (std::size_t s = 0; s < slots(); ++s)
    if (!arrays[s].empty()) std::memcpy(arrays[s].data(), p.state[s].data, arrays[s].size_bytes());
  for (std::size_t s = 0; s < q8.size(); ++s) {
    if (!q8[s].codes.empty()) std::memcpy(q8[s].codes.data(), p.q8[s].codes, q8[s].codes.size());
    if (!q8[s].absmax.empty())
      std::memcpy(q8[s].absmax.data(), p.q8[s].absmax, q8[s].absmax.size_bytes());
  }
  if (compute.empty()) return;
  // What the device holds, piece by piece through the (idle) upload ring.
  const std::size_t width = dtype_size(p.compute.dtype);
  for (std::size_t off = 0; off < p.compute.numel; off += ring_.slot_elements) {
    const std::size_t n = std::min(ring_.slot_elements, p.compute.numel - off);
    const std::size_t slot = next_upload_slot();
    char* piece = upload_ring_.at(slot, 0);
    const Event e = on_device([&] {
      dev_.copy(Queue::d2h, piece, static_cast<const char*>(p.compute.data) + off * width,
                n * width);
      return upload_done_[slot] = dev_.record(Queue::d2h);
    });
    sync_event(e, {Awaited::read_back, i});
    std::memcpy(compute.data() + off * width, piece, n * width);
  }
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
  const std::size_t numel = config().params[i].numel;
  for (std::size_t s = 0; s + 1 < slots(); ++s)
    if (p.q8[s].codes != nullptr)
      h.q8[s] = {{p.q8[s].codes, numel}, {p.q8[s].absmax, q8_blocks(numel)}};
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
    if (out_space_ != nullptr) dev_.deallocate_host(out_space_);
  }
  pinned_slab_ = dev_slab_ = stage_space_ = out_space_ = nullptr;
  state_ = numa::HostBuffer{};
  acc_space_ = numa::HostBuffer{};
  spare_space_ = numa::HostBuffer{};
  const std::lock_guard lock(err_mu_);
  return error_;
}

std::unique_ptr<ManagerImpl> make_offload_gradient_manager(ManagerConfig config) {
  return std::make_unique<OffloadGradientManager>(std::move(config));
}

}  // namespace stepcore::detail
