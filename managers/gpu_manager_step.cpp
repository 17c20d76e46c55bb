// GpuGradientManager's step (managers/gpu_manager.hpp): the gradients accumulated, the
// global norm partial and its finalization, the optimizer over the parameters (in place,
// or chunk by chunk through the ring of device slots), and the outcome learned.
// A step never waits on the host except in clip_grad_norm, which must return the norm.
// Without it, the found-inf flag travels to a pinned word behind the step's work. The
// per-step scalars live in device memory (step counters, lr and weight decay per
// weight-decay group, the bias table): the kernels read them when they run, and a
// skipped step leaves the counters as they were, so nothing is rolled back on the host.
//
// Ordering with the trainer: gradient_ready(i, written) makes the compute queue wait for
// `written` before reading the gradient; gradient_released(i) is the compute-queue event
// after that read. Every host wait goes through wait_for(), which with a device-memory
// communicator (NCCL) first waits on the communicator with its timeout, so a dead peer
// raises Errc::timeout instead of hanging an event wait.
#include <algorithm>
#include <chrono>
#include <span>
#include <utility>
#include <vector>

#include "managers/common.hpp"
#include "managers/device_step.hpp"
#include "managers/gpu_manager.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

using device::Event;
using device::Queue;

// Blocks until `e` is complete. With a device-memory communicator the device's work may
// sit behind a collective whose peer died: the communicator's bounded wait (its
// timeout, then abort: Errc::timeout) comes first, so no event wait hangs.
void GpuGradientManager::wait_for(const Event& e) {
  comm::Communicator* comm = config().comm;
  if (comm != nullptr && comm->memory() == comm::MemorySpace::device) comm->synchronize();
  dev_.synchronize(e);
}

// Blocks until every queue is idle, bounded like wait_for.
void GpuGradientManager::wait_all() {
  comm::Communicator* comm = config().comm;
  if (comm != nullptr && comm->memory() == comm::MemorySpace::device) comm->synchronize();
  dev_.synchronize();
}

// Learns the outcome of the last step once its work is done: found-inf flags (the device
// skipped what they mark, counters included) and the layout check. Raises the work's
// errors once.
void GpuGradientManager::settle() {
  if (!pending_) return;
  pending_ = false;
  const Event done = std::exchange(done_, Event());
  wait_for(done);
  report_.exposed_seconds = std::max(
      0.0, std::chrono::duration<double>(std::chrono::steady_clock::now() - last_gradient_time())
               .count());
  if (!flag_known_) {
    const Summary s = h_->summary;
    report_.norm = s.result;
    report_.skipped = s.found_inf != 0;
    report_.stepped = !report_.skipped;
    set_would_commit(!report_.skipped);  // no clipping: the coefficient is 1
    if (config().comm != nullptr) comm::check_reduced(s.check, config().layout_fingerprint);
  }
}

void GpuGradientManager::wait_idle() {
  settle();
  wait_all();
}

// Uploads the groups' lr and weight decay when set_hyperparameters (or a checkpoint)
// changed them since the last upload: through the pinned staging words, which no queued
// work still reads (the previous step was waited for by begin_step, and load/import wait
// for everything), on the compute queue ahead of the step's kernels. No host wait.
void GpuGradientManager::ensure_hyper() {
  if (hyper_uploaded_ == hyper_version()) return;
  for (std::size_t g = 0; g < groups().size(); ++g)
    h_hyper_[g] = {groups()[g].lr, groups()[g].weight_decay};
  dev_.copy(Queue::compute, d_hyper_, h_hyper_, sizeof(StepHyper) * groups().size());
  hyper_uploaded_ = hyper_version();
}

void GpuGradientManager::ensure_scale() {
  if (scale_uploaded_) return;
  h_->scale = gradient_scale();
  dev_.copy(Queue::compute, &d_->scale, &h_->scale, sizeof(float));
  scale_uploaded_ = true;
}

// All-reduces a partial (with the layout record) when there is a communicator. A host
// communicator reads host memory at the call, so the compute queue is drained first (the
// host device only: a CUDA device pairs with NCCL, which enqueues on the compute stream).
void GpuGradientManager::reduce(NormPartial* d_partial) {
  comm::Communicator* comm = config().comm;
  if (comm == nullptr) return;
  if (comm->memory() == comm::MemorySpace::host) dev_.synchronize(dev_.record(Queue::compute));
  comm->all_reduce_partial(d_partial, &d_->summary.check);  // device: on the compute stream
}

// The global norm partial of the counted accumulators, reduced over the ranks; eager:
// the accumulators are scaled in place in the same pass. The scale is read from device
// memory (d_->scale) when the kernels run, as every other per-step scalar.
void GpuGradientManager::ensure_global_partial() {
  if (partial_done_) return;
  ensure_scale();
  if (eager_) {
    dev_.scale_and_norm_partial(counted_, &d_->scale, &d_->partial, workspace_, workspace_bytes_);
    if (!uncounted_.empty())
      dev_.scale_and_norm_partial(uncounted_, &d_->scale, &d_->scratch, workspace_,
                                  workspace_bytes_);
  } else {
    dev_.norm_partial(counted_const_, DeviceGradientRead{&d_->scale, &d_->one}, &d_->partial,
                      workspace_, workspace_bytes_);
  }
  reduce(&d_->partial);
  partial_done_ = true;
}

// Finalizes the reduced partial into the summary (norm, clip, flag), with the exact
// fallback and its reduction (always enqueued: every rank takes part).
void GpuGradientManager::enqueue_finalize(float max_norm) {
  Summary* s = &d_->summary;
  // Eager: the accumulators hold the scaled values already.
  const DeviceGradientRead read{eager_ ? &d_->one : &d_->scale, &d_->one};
  dev_.finalize_and_clip(&d_->partial, max_norm, &s->result, &s->clip, &s->found_inf);
  dev_.exact_norm_partial_if_needed(counted_const_, read, &s->found_inf, &d_->exact, workspace_,
                                    workspace_bytes_);
  reduce(&d_->exact);
  dev_.finalize_exact_and_clip(&d_->exact, max_norm, &s->result, &s->clip, &s->found_inf);
}

// The optimizer over parameters [first, last): state in device memory, or in `slot` (a
// ring slot holding their chunk's block). Gradients are the accumulators, outputs the
// device compute weights.
void GpuGradientManager::update_params(std::size_t first, std::size_t last, std::byte* slot,
                                       const float* d_scale, const float* d_clip,
                                       const std::int32_t* d_found_inf, bool to_staging) {
  const ManagerConfig& cfg = config();
  auto f32 = [](float* p, std::size_t n) { return TensorView{p, n, DType::f32}; };
  // Speculating, the state is read where it is and written to the rollback space.
  auto dst = [&](std::size_t i, std::size_t s) {
    return f32(to_staging ? spec_[i].state[s] : state_at(i, s, slot), params_[i].acc.numel);
  };
  auto src = [&](std::size_t i, std::size_t s) {
    return to_staging ? ConstTensorView(f32(state_at(i, s, slot), params_[i].acc.numel))
                      : ConstTensorView{};
  };
  // The compute weights, or (speculating) their staging.
  auto compute = [&](std::size_t i) {
    const TensorView& c = params_[i].compute;
    return to_staging && c.numel != 0 ? TensorView{spec_[i].compute, c.numel, c.dtype} : c;
  };
  // One call per parameter group; each group's lr and weight decay come from d_hyper_
  // when the kernels run.
  for_each_group(cfg.params, groups().size(), first, last,
                 [&](std::size_t group, std::span<const std::size_t> members) {
                   std::vector<OptimizerTensor> t;
                   for (std::size_t i : members) {
                     OptimizerTensor o{dst(i, 0)};
                     o.param_src = src(i, 0);
                     for (std::size_t k = 0; k < state_slots() && k < kMaxOptimizerSlots; ++k) {
                       if (params_[i].q8) {  // 8-bit: in place, speculated on a copy
                         o.q8[k] = q8_slot(i, k, slot, to_staging);
                         continue;
                       }
                       o.state[k] = dst(i, 1 + k);
                       o.state_src[k] = src(i, 1 + k);
                     }
                     if (counts()) o.step = to_staging ? spec_[i].step : d_steps_ + i;
                     o.grad = params_[i].acc;
                     o.compute_param = compute(i);
                     t.push_back(o);
                   }
                   device_optimizer_step(
                       dev_, t, group_config(group),
                       DeviceStepArgs{d_scale, d_clip, d_found_inf, d_hyper_ + group,
                                      d_bias_[group], d_codebooks_});
                 });
}

Q8Slot GpuGradientManager::q8_slot(std::size_t i, std::size_t k, std::byte* slot, bool to_staging) {
  auto* codes = reinterpret_cast<std::uint8_t*>(state_at(i, 1 + k, slot));
  float* maxima = absmax_at(i, k, slot);
  if (!to_staging) return {codes, maxima};
  // Speculating: the live codes and maxima copied to the rollback space first (in queue
  // order before the step), which the step then updates in place.
  auto* spec_codes = reinterpret_cast<std::uint8_t*>(spec_[i].state[1 + k]);
  const std::size_t n = config().params[i].numel;
  if (n != 0) {
    dev_.copy(Queue::compute, spec_codes, codes, n);
    dev_.copy(Queue::compute, spec_[i].absmax[k], maxima, absmax_bytes(i));
  }
  return {spec_codes, spec_[i].absmax[k]};
}

// Steps chunk k: in place (mode none) or through the next ring slot (mode optimizer):
// upload on h2d once the slot is free, step on compute, download on d2h. `speculate`:
// out of place into the chunk's rollback space (its counters copied there first), and
// in mode optimizer nothing is downloaded (the host block keeps the old state).
void GpuGradientManager::update_chunk(std::size_t k, const float* d_scale, const float* d_clip,
                                      const std::int32_t* d_found_inf, bool speculate) {
  const Chunk& c = chunks()[k];
  if (speculate && counts() && c.last > c.first)
    dev_.copy(Queue::compute, spec_[c.first].step, d_steps_ + c.first,
              sizeof(float) * (c.last - c.first));
  if (!streamed()) {
    update_params(c.first, c.last, nullptr, d_scale, d_clip, d_found_inf, speculate);
    return;
  }
  const std::size_t j = ring_next_++ % slots_.size();
  dev_.wait(Queue::h2d, slot_free_[j]);
  dev_.copy(Queue::h2d, slots_[j], chunk_host_[k], chunk_bytes_[k]);
  dev_.wait(Queue::compute, dev_.record(Queue::h2d));
  update_params(c.first, c.last, slots_[j], d_scale, d_clip, d_found_inf, speculate);
  if (speculate) {
    slot_free_[j] = dev_.record(Queue::compute);
    return;
  }
  dev_.wait(Queue::d2h, dev_.record(Queue::compute));
  dev_.copy(Queue::d2h, chunk_host_[k], slots_[j], chunk_bytes_[k]);
  slot_free_[j] = dev_.record(Queue::d2h);
}

// Steps every parameter: one multi-tensor update (mode none) or chunk by chunk through
// the ring (mode optimizer).
void GpuGradientManager::update_all(const float* d_scale, const float* d_clip,
                                    const std::int32_t* d_found_inf) {
  if (!streamed()) {
    update_params(0, params_.size(), nullptr, d_scale, d_clip, d_found_inf);
    return;
  }
  for (std::size_t k = 0; k < chunks().size(); ++k) update_chunk(k, d_scale, d_clip, d_found_inf);
}

// Ends the step's enqueueing: the summary follows all of the step's work to pinned host
// words; done_ marks the end of everything.
void GpuGradientManager::finish_enqueue(bool copy_summary) {
  dev_.wait(Queue::d2h, dev_.record(Queue::compute));
  if (copy_summary) dev_.copy(Queue::d2h, &h_->summary, &d_->summary, sizeof(Summary));
  done_ = dev_.record(Queue::d2h);
  pending_ = true;
}

void GpuGradientManager::do_begin_step() {
  settle();  // the previous step's outcome; raises its errors
  report_ = StepReport{};
  scale_uploaded_ = partial_done_ = flag_known_ = false;
  ring_next_ = 0;
  spare_used_ = 0;
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
}

void GpuGradientManager::do_gradient_ready(std::size_t i, bool first_in_step, ConstTensorView grad,
                                           const Event& written) {
  const Param& q = params_[i];
  dev_.wait(Queue::compute, written);  // the trainer's write, before the read
  const AccumulatePair pair{q.acc, grad, first_in_step};
  const gpu::detail::ScopedOwnedPlan<gpu::detail::AccumulatePlans> own(
      accumulate_plans_[i][first_in_step ? 1 : 0]);
  dev_.accumulate(std::span(&pair, 1));
  accumulated_[i] = 1;
}

void GpuGradientManager::do_finish_final_backward(std::span<const std::size_t> no_gradient) {
  for (std::size_t i : no_gradient)
    dev_.zero(Queue::compute, params_[i].acc.data, params_[i].acc.bytes());
  if (overlap()) {
    ensure_scale();
    return;
  }
  if (eager_) ensure_global_partial();  // lazy: at clip_grad_norm or step
}

NormResult GpuGradientManager::do_clip_grad_norm(float max_norm, float& clip) {
  ensure_global_partial();
  enqueue_finalize(max_norm);
  return learn_summary(clip);
}

// The host synchronisation of the step: the finalized summary to the host (the norm,
// coefficient and found-inf flag), into the report.
NormResult GpuGradientManager::learn_summary(float& clip) {
  dev_.wait(Queue::d2h, dev_.record(Queue::compute));
  dev_.copy(Queue::d2h, &h_->summary, &d_->summary, sizeof(Summary));
  wait_for(dev_.record(Queue::d2h));
  const Summary s = h_->summary;
  if (config().comm != nullptr) comm::check_reduced(s.check, config().layout_fingerprint);
  flag_known_ = true;
  clip = s.clip;  // 0 when the norm is not finite (the step is then skipped)
  report_.norm = s.result;
  report_.clip_coefficient = clip;
  report_.skipped = s.found_inf != 0;
  report_.stepped = !report_.skipped;
  return s.result;
}

void GpuGradientManager::do_step() {
  ensure_hyper();
  const float* d_scale = eager_ ? &d_->one : &d_->scale;
  if (!eager_) ensure_scale();
  const bool any_speculated =
      std::find(speculated_.begin(), speculated_.end(), std::uint8_t{1}) != speculated_.end();
  if (overlap() && any_speculated) {
    // The decision needs the host (commit or drop): without clip_grad_norm, the
    // step's one host synchronisation is here; the coefficient stays 1.
    const float* d_clip = &d_->summary.clip;
    if (!flag_known_) {
      ensure_global_partial();
      enqueue_finalize(kNoClipMaxNorm);
      float clip = 1.0f;
      (void)learn_summary(clip);
      report_.clip_coefficient = 1.0f;
      d_clip = &d_->one;
    }
    decide_overlapped(d_clip);
    finish_enqueue(false);
    return;
  }
  if (flag_known_) {
    if (!report_.skipped) {  // known finite: the device flag is 0, the clip is set
      set_would_commit(report_.clip_coefficient == 1.0f || !shape().reads_scaled);
      update_all(d_scale, &d_->summary.clip, &d_->summary.found_inf);
    } else {
      set_would_commit(false);
    }
    finish_enqueue(false);
    return;
  }
  // No clip: the norm is still needed for found-inf; c = 1.
  ensure_global_partial();
  enqueue_finalize(kNoClipMaxNorm);
  update_all(d_scale, &d_->one, &d_->summary.found_inf);
  finish_enqueue(true);
}

StepReport GpuGradientManager::do_report() {
  settle();
  return report_;
}

void GpuGradientManager::do_recover() {
  pending_ = false;
  done_ = Event();
  // The failed step's queued work; its errors are the stored one's. A pass stops at the
  // first error it collects: passes repeat until one collects nothing (see kRecoverPasses).
  for (int pass = 0; pass < kRecoverPasses; ++pass) {
    try {
      wait_all();
      break;
    } catch (const Error&) {
    }
  }
  wait_all();  // a device (or communicator) that fails again cannot continue
  report_ = StepReport{};
  scale_uploaded_ = partial_done_ = flag_known_ = false;
  spare_used_ = 0;
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
  // The failed step's events: its work has drained, and an event after the lost work
  // would raise the failure again in a later step.
  std::fill(slot_free_.begin(), slot_free_.end(), device::Event());
}

}  // namespace stepcore::detail
