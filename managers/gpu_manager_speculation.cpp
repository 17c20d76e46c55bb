// GpuGradientManager's speculation (managers/gpu_manager.hpp), overlapped steps: a chunk
// admitted by the rollback budget (device memory, carved afresh each step) is stepped out
// of place as if the coefficient were 1 and the step finite: it reads its state where it
// lives (device memory, or the ring slot its host block was uploaded to) and writes the
// new state, its step counters and compute weights into the rollback space; nothing the
// step started from is written. The decision (which needs the norm on the host:
// clip_grad_norm, or step()'s one wait) commits it (the rollback space copied over the
// state — downloaded to the host block in mode optimizer — and the compute weights) or
// drops it: the state is still the step's old one, which the step then updates with the
// coefficient (or leaves, when skipped).
#include <algorithm>
#include <string>

#include "managers/gpu_manager.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

using device::Queue;

std::size_t GpuGradientManager::rollback_bytes(std::size_t k) const {
  const Chunk& c = chunks()[k];
  std::size_t bytes = counts() ? align_up(sizeof(float) * (c.last - c.first)) : 0;
  for (std::size_t i = c.first; i < c.last; ++i) {
    for (std::size_t s = 0; s < slots(); ++s)
      bytes += align_up(array_bytes(i, s)) + (s != 0 ? align_up(absmax_bytes(i)) : 0);
    bytes += align_up(params_[i].compute.bytes());
  }
  return bytes;
}

void GpuGradientManager::do_reserve_speculation() {
  if (spare_ != nullptr) return;
  std::size_t need = 0;
  for (std::size_t k = 0; k < chunks().size(); ++k) need += rollback_bytes(k);
  const std::size_t bytes = std::min(need, speculation_budget());
  if (bytes == 0) return;
  try {
    spare_ = static_cast<std::byte*>(dev_.allocate(bytes));
  } catch (const Error& e) {
    throw Error(
        Errc::out_of_range, "speculation_bytes",
        "cannot reserve " + std::to_string(bytes) + " bytes of rollback space: " + e.what());
  }
  spare_bytes_ = bytes;
  ledger().set("speculation", true, bytes);
}

bool GpuGradientManager::admit(std::size_t k) {
  const std::size_t bytes = rollback_bytes(k);
  if (spare_ == nullptr || bytes > spare_bytes_ - spare_used_) return false;
  const Chunk& c = chunks()[k];
  std::byte* at = spare_ + spare_used_;
  auto take = [&at](std::size_t n) {
    std::byte* p = at;
    at += align_up(n);
    return p;
  };
  for (std::size_t i = c.first; i < c.last; ++i) {
    for (std::size_t s = 0; s < slots(); ++s) {
      spec_[i].state[s] = reinterpret_cast<float*>(take(array_bytes(i, s)));
      if (s != 0) spec_[i].absmax[s - 1] = reinterpret_cast<float*>(take(absmax_bytes(i)));
    }
    spec_[i].compute = take(params_[i].compute.bytes());
  }
  if (counts() && c.last > c.first) {  // the chunk's counters, consecutive
    float* steps = reinterpret_cast<float*>(take(sizeof(float) * (c.last - c.first)));
    for (std::size_t i = c.first; i < c.last; ++i) spec_[i].step = steps + (i - c.first);
  }
  speculated_[k] = 1;
  spare_used_ += bytes;
  return true;
}

// Commits chunk k: its speculated state, counters and compute weights copied from the
// rollback space to where they live (mode optimizer: the state downloaded to its host
// block on d2h, after the step's compute work).
void GpuGradientManager::commit(std::size_t k) {
  const Chunk& c = chunks()[k];
  if (streamed()) dev_.wait(Queue::d2h, dev_.record(Queue::compute));
  const Queue state_queue = streamed() ? Queue::d2h : Queue::compute;
  for (std::size_t i = c.first; i < c.last; ++i) {
    const Param& q = params_[i];
    std::byte* block = streamed() ? chunk_host_[k] : nullptr;
    for (std::size_t s = 0; s < slots() && q.acc.numel != 0; ++s) {
      dev_.copy(state_queue, state_at(i, s, block), spec_[i].state[s], array_bytes(i, s));
      if (s != 0 && q.q8)
        dev_.copy(state_queue, absmax_at(i, s - 1, block), spec_[i].absmax[s - 1], absmax_bytes(i));
    }
    if (q.compute.numel != 0)
      dev_.copy(Queue::compute, q.compute.data, spec_[i].compute, q.compute.bytes());
  }
  if (counts() && c.last > c.first)
    dev_.copy(Queue::compute, d_steps_ + c.first, spec_[c.first].step,
              sizeof(float) * (c.last - c.first));
}

// The decision of an overlapped step, the summary on the host (flag_known_): commit the
// speculated chunks, or drop them and step every chunk with the coefficient; a skipped
// step drops them and steps nothing.
void GpuGradientManager::decide_overlapped(const float* d_clip) {
  const bool finite = !report_.skipped;
  const bool keep = finite && (report_.clip_coefficient == 1.0f || !shape().reads_scaled);
  set_would_commit(keep);
  for (std::size_t k = 0; k < chunks().size(); ++k) {
    if (!speculated_[k]) continue;
    ++report_.chunks_speculated;
    ++(keep ? report_.chunks_committed : report_.chunks_rolled_back);
    if (keep) commit(k);  // rolled back: its state was never written, nothing to restore
  }
  if (streamed()) dev_.wait(Queue::h2d, dev_.record(Queue::d2h));  // committed blocks first
  if (!finite) return;
  const float* d_scale = eager_ ? &d_->one : &d_->scale;
  for (std::size_t k = 0; k < chunks().size(); ++k)
    if (!speculated_[k] || !keep) update_chunk(k, d_scale, d_clip, &d_->summary.found_inf);
}

// Optimizer in backward: chunk k, admitted by the budget, is stepped into its rollback
// space as if the coefficient were 1 and the step finite (reading R(acc * s)); otherwise
// it waits for the decision.
void GpuGradientManager::do_step_chunk(std::size_t k) {
  if (!speculating() || !admit(k)) return;
  ensure_scale();
  ensure_hyper();
  update_chunk(k, &d_->scale, &d_->one, &d_->zero, /*speculate=*/true);
}

}  // namespace stepcore::detail
