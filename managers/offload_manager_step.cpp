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
  if (config().comm == nullptr) {
    if (!holding_ && !overlap()) {
      drain();
      return engine_.norm(counted_acc_, GradientRead{scale, 1.0f});
    }
    const NormResult r = finalize(local_partial(NormMode::fast, scale));
    return r.needs_exact ? finalize(local_partial(NormMode::exact, scale)) : r;
  }
  // comm's protocol: fast partials reduced with the layout check, the exact pass when
  // the result cannot be certified. A rank whose drain or partial fails still joins
  // every reduction (its peers learn of it) and then raises its own error.
  return comm::detail::global_norm(*config().comm, config().layout_fingerprint, counted_acc_,
                                   [&](std::span<const ConstTensorView>, cpu::NormMode mode) {
                                     return local_partial(mode, scale);
                                   });
}

OffloadGradientManager::GroupConfigs OffloadGradientManager::group_configs() const {
  GroupConfigs c;
  for (std::size_t g = 0; g < groups().size(); ++g) c.push_back(group_config(g));
  return c;
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
  holding_ = step_posted_ = false;
  staging_wait_ = 0.0;
  for (Param& p : params_) p.held = {};
  std::fill(speculated_.begin(), speculated_.end(), std::uint8_t{0});
  std::fill(chunk_partial_.begin(), chunk_partial_.end(), NormPartial{});
}

void OffloadGradientManager::do_begin_backward(bool final_backward, bool first_backward) {
  raise_if_failed();
  // Backward rewrites the gradient buffers: the previous micro-batch's copies must be done.
  sync_event(last_d2h_, {Awaited::gradient_copy, last_d2h_param_});
  const bool have_acc = acc_space_.data() != nullptr;
  if (first_backward) holding_ = final_backward && !have_acc;
  if (!final_backward && !have_acc) {  // the first step that accumulates
    try {
      allocate_accumulators();
    } catch (const Error& e) {
      throw Error(Errc::out_of_range, "accumulators",
                  std::string("cannot allocate the f32 accumulators a step of several "
                              "micro-batches needs: ") +
                      e.what());
    }
  }
}

TensorView OffloadGradientManager::do_gradient(std::size_t i) {
  raise_if_failed();
  return params_[i].grad;
}

void OffloadGradientManager::do_finish_final_backward(std::span<const std::size_t> no_gradient) {
  raise_if_failed();
  if (no_gradient.empty() || holding_) return;  // holding: no gradient reads as zero
  post(
      [this, missing = std::vector<std::size_t>(no_gradient.begin(), no_gradient.end())] {
        for (std::size_t i : missing)
          if (params_[i].acc.numel != 0)
            std::memset(params_[i].acc.data, 0, params_[i].acc.bytes());
      },
      main);
}

void OffloadGradientManager::post_step_end() {
  step_posted_ = true;
  step_end_task_ = post([this] {
    wait_uploads();
    step_end_ = std::chrono::steady_clock::now();
  });
}

NormResult OffloadGradientManager::do_clip_grad_norm(float max_norm, float& clip) {
  // No early raise: a failed rank still joins the reduction (global_norm reports it).
  norm_ = global_norm(gradient_scale());
  norm_known_ = true;
  // Not finite: the step is skipped; 0 is what the device modes' finalize_and_clip sets.
  clip_ = norm_.finite ? clip_coefficient(norm_.norm, max_norm) : 0.0f;
  clip = clip_;
  if (overlap() && !keeps_speculation()) cancel_speculation();
  return norm_;
}

void OffloadGradientManager::do_step() {
  if (!norm_known_) {  // found-inf needs the norm even without clipping
    norm_ = global_norm(gradient_scale());
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
        const Chunk& c = chunks()[k];
        for (std::size_t i = c.first; i < c.last; ++i) {
          std::swap(params_[i].state, params_[i].spare);
          std::swap(params_[i].q8, params_[i].q8_spare);
          if (shape().counts_steps) steps_[i] = spec_steps_[i];
        }
        commit_compute(k, backward);  // the compute weights the speculative step wrote
      });
    } else {  // waited, or rolled back: the live state is the step's old state
      post([this, k, read, backward, configs] {
        run_chunk(k, read, *configs, Target::live, backward);
      });
    }
  }
  post_step_end();
}

StepReport OffloadGradientManager::do_report() {
  drain();
  wait_uploads();
  StepReport r = report_;
  r.staging_wait_seconds = staging_wait_;
  if (r.stepped || r.skipped)
    r.exposed_seconds =
        std::max(0.0, std::chrono::duration<double>(step_end_ - last_gradient_time()).count());
  return r;
}

}  // namespace stepcore::detail
