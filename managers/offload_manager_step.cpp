// OffloadGradientManager's step (managers/offload_manager.hpp): each gradient copied to
// pinned staging and accumulated by the worker, the global norm (over the ranks through
// comm's protocol), each chunk stepped on the CPU engine and its compute weights uploaded
// while the next chunk steps.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "comm/global_norm.hpp"
#include "core/validate.hpp"
#include "managers/common.hpp"
#include "managers/offload_manager.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

using device::Event;
using device::Queue;

NormResult OffloadGradientManager::global_norm(float scale) {
  const GradientRead read{scale, 1.0f};
  if (config().comm == nullptr) {
    drain();
    return engine_.norm(counted_acc_, read);
  }
  // comm's protocol: fast partials reduced with the layout check, the exact pass when
  // the result cannot be certified. A rank whose drain or partial fails still joins
  // every reduction (its peers learn of it) and then raises its own error.
  return comm::detail::global_norm(
      *config().comm, config().layout_fingerprint, counted_acc_,
      [&](std::span<const ConstTensorView> tensors, cpu::NormMode mode) {
        drain();
        return engine_.norm_partial(tensors, read, mode);
      });
}

OffloadGradientManager::GroupConfigs OffloadGradientManager::group_configs() const {
  GroupConfigs c;
  for (std::size_t g = 0; g < groups().size(); ++g) c.push_back(group_config(g));
  return c;
}

void OffloadGradientManager::step_chunk(std::size_t k, GradientRead read,
                                        const GroupConfigs& configs, bool into_spare) {
  const Chunk& c = chunks()[k];
  const std::vector<ParamSpec>& specs = config().params;
  const bool counts = shape().counts_steps;
  // An optimizer that does not read the scale and clip (SignSGD) reads them as 1, so
  // that a zero clip coefficient (max_norm = 0) is not refused.
  const GradientRead r = shape().reads_scaled ? read : GradientRead{};
  // One call per parameter group; out of place, the live state is the source and the
  // spare the destination.
  for_each_group(specs, groups().size(), c.first, c.last,
                 [&](std::size_t group, std::span<const std::size_t> members) {
                   std::vector<OptimizerTensor> t;
                   for (std::size_t i : members) {
                     const Param& p = params_[i];
                     OptimizerTensor o{into_spare ? p.spare[0] : p.state[0]};
                     for (std::size_t k = 0; k < state_slots() && k < kMaxOptimizerSlots; ++k) {
                       o.state[k] = into_spare ? p.spare[1 + k] : p.state[1 + k];
                       if (into_spare) o.state_src[k] = p.state[1 + k];
                     }
                     if (into_spare) o.param_src = p.state[0];
                     if (counts) o.step = into_spare ? &(spec_steps_[i] = steps_[i]) : &steps_[i];
                     o.grad = p.acc;
                     o.compute_param = p.out;
                     t.push_back(o);
                   }
                   with_unit(configs[group], [&](auto, const auto& cfg) {
                     engine_.step(std::span<const OptimizerTensor>(t), cfg, r);
                   });
                 });
}

void OffloadGradientManager::upload_chunk(std::size_t k, const Event& after, bool staged) {
  const Chunk& c = chunks()[k];
  on_device([&] {
    dev_.wait(Queue::h2d, after);  // backward's use of the old weights comes first
    for (std::size_t i = c.first; i < c.last; ++i) {
      const Param& p = params_[i];
      if (p.out.numel != 0)
        dev_.copy(Queue::h2d, p.compute.data, staged ? p.staged.data : p.out.data, p.out.bytes());
    }
    last_upload_ = dev_.record(Queue::h2d);
    last_upload_what_ = {Awaited::chunk_upload, k};
  });
}

void OffloadGradientManager::stage_chunk(std::size_t k) {
  // The h2d queue is FIFO: this follows the previous commit's reads of the staging, and
  // the commit's copy out of it follows this. A re-step that rewrites the upload buffers
  // waits for it (wait_uploads).
  const Chunk& c = chunks()[k];
  on_device([&] {
    for (std::size_t i = c.first; i < c.last; ++i) {
      const Param& p = params_[i];
      if (p.out.numel != 0) dev_.copy(Queue::h2d, p.staged.data, p.out.data, p.out.bytes());
    }
    last_upload_ = dev_.record(Queue::h2d);
    last_upload_what_ = {Awaited::chunk_upload, k};
  });
}

void OffloadGradientManager::wait_uploads() {
  Event e;
  Awaited what{};
  {
    const std::lock_guard lock(dev_mu_);
    e = last_upload_;
    what = last_upload_what_;
  }
  sync_event(e, what);
}

void OffloadGradientManager::do_begin_step() {
  drain();  // the previous step's tasks, and their errors
  ++generation_;
  wait_uploads();
  norm_known_ = false;
  norm_ = NormResult{};
  clip_ = 1.0f;
  report_ = StepReport{};
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
  std::fill(chunk_partial_.begin(), chunk_partial_.end(), NormPartial{});
}

void OffloadGradientManager::do_begin_backward() {
  raise_if_failed();
  // Backward rewrites the gradient buffers: the previous micro-batch's copies must be done.
  sync_event(last_d2h_, {Awaited::gradient_copy, last_d2h_param_});
}

TensorView OffloadGradientManager::do_gradient(std::size_t i) {
  raise_if_failed();
  return params_[i].grad;
}

void OffloadGradientManager::do_gradient_ready(std::size_t i, bool first_in_step,
                                               ConstTensorView grad, const Event& written) {
  raise_if_failed();
  Param& p = params_[i];
  // Staging i is free once the worker has accumulated its previous contents.
  wait_done(main, staging_task_[i]);
  raise_if_failed();
  Event copied;
  if (grad.numel != 0) {
    copied = on_device([&] {
      dev_.wait(Queue::d2h, dev_.record(Queue::compute));  // backward's writes first
      dev_.wait(Queue::d2h, written);                      // and the trainer's event
      dev_.copy(Queue::d2h, p.staging.data, grad.data, grad.bytes());
      last_d2h_param_ = i;
      return last_d2h_ = dev_.record(Queue::d2h);
    });
  }
  released_[i] = copied;  // the device buffer (the manager's or the caller's) is free once staged
  staging_task_[i] = post(
      [this, &p, i, copied, first_in_step] {
        sync_event(copied, {Awaited::gradient_copy, i});
        const AccumulatePair pair{p.acc, p.staging, first_in_step};
        engine_.accumulate({&pair, 1});
      },
      main);
}

void OffloadGradientManager::do_finish_final_backward(std::span<const std::size_t> no_gradient) {
  raise_if_failed();
  if (no_gradient.empty()) return;
  post(
      [this, missing = std::vector<std::size_t>(no_gradient.begin(), no_gradient.end())] {
        for (std::size_t i : missing)
          if (params_[i].acc.numel != 0)
            std::memset(params_[i].acc.data, 0, params_[i].acc.bytes());
      },
      main);
}

void OffloadGradientManager::post_step_end() {
  post([this] {
    wait_uploads();
    step_end_ = std::chrono::steady_clock::now();
  });
}

NormResult OffloadGradientManager::do_clip_grad_norm(float max_norm, float& clip) {
  // No early raise: a failed rank still joins the reduction (global_norm reports it).
  norm_ = overlap() ? overlapped_global_norm(gradient_scale()) : global_norm(gradient_scale());
  norm_known_ = true;
  // Not finite: the step is skipped; 0 is what the device modes' finalize_and_clip sets.
  clip_ = norm_.finite ? clip_coefficient(norm_.norm, max_norm) : 0.0f;
  clip = clip_;
  if (overlap() && !keeps_speculation()) cancel_speculation();
  return norm_;
}

void OffloadGradientManager::do_step() {
  if (!norm_known_) {  // found-inf needs the norm even without clipping
    norm_ = overlap() ? overlapped_global_norm(gradient_scale()) : global_norm(gradient_scale());
    norm_known_ = true;
  }
  raise_if_failed();
  report_.norm = norm_;
  report_.clip_coefficient = clip_;
  const bool keep = keeps_speculation();
  if (overlap() && !keep) cancel_speculation();  // speculative steps not yet run: skipped
  set_would_commit(keep);
  for (std::size_t k = 0; k < chunks().size(); ++k)
    if (speculated_[k]) {
      ++report_.chunks_speculated;
      ++(keep ? report_.chunks_committed : report_.chunks_rolled_back);
    }
  if (!norm_.finite) {       // found-inf: nothing changes, the step counters stay
    report_.skipped = true;  // speculated chunks wrote only their spares: nothing to undo
    post_step_end();
    return;
  }
  report_.stepped = true;
  const GradientRead read{gradient_scale(), clip_};
  const Event backward = on_device([&] { return dev_.record(Queue::compute); });
  const auto configs = std::make_shared<const GroupConfigs>(group_configs());
  for (std::size_t k = 0; k < chunks().size(); ++k) {  // chunk k's upload overlaps k+1's step
    if (speculated_[k] && keep) {
      post([this, k, backward] {
        // Commit: the spares hold the stepped state; the old live arrays become spares.
        for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i) {
          std::swap(params_[i].state, params_[i].spare);
          if (shape().counts_steps) steps_[i] = spec_steps_[i];
        }
        upload_chunk(k, backward, has_stage_[k] != 0);
      });
    } else {  // waited, or rolled back: the live state is the step's old state
      post([this, k, read, backward, configs, staged = speculated_[k] && has_stage_[k]] {
        if (staged) wait_uploads();  // its staging upload still reads the upload buffers
        step_chunk(k, read, *configs);
        upload_chunk(k, backward);
      });
    }
  }
  post_step_end();
}

StepReport OffloadGradientManager::do_report() {
  drain();
  wait_uploads();
  StepReport r = report_;
  if (r.stepped || r.skipped)
    r.exposed_seconds =
        std::max(0.0, std::chrono::duration<double>(step_end_ - last_gradient_time()).count());
  return r;
}

}  // namespace stepcore::detail
