// The mode-independent part of every gradient manager: argument and call-sequence
// validation (all before anything changes), chunking, per-step gradient bookkeeping and
// the optimizer-in-backward trigger; the modes implement the protected hooks.
#include <cmath>
#include <string>
#include <utility>

#include "core/validate.hpp"
#include "stepcore/error.hpp"
#include "stepcore/managers.hpp"

namespace stepcore {

OffloadMode parse_offload_mode(std::string_view name) {
  if (name == "none") return OffloadMode::none;
  if (name == "optimizer") return OffloadMode::optimizer;
  if (name == "full") return OffloadMode::full;
  std::string why = "unknown offload mode '" + std::string(name) +
                    "': expected exactly one of none, optimizer, full";
  if (name == "fsdp") why += " (the fsdp mode was removed: use full)";
  throw Error(Errc::invalid_argument, "offload_mode", why);
}

std::string_view offload_mode_name(OffloadMode mode) noexcept {
  switch (mode) {
    case OffloadMode::none:
      return "none";
    case OffloadMode::optimizer:
      return "optimizer";
    case OffloadMode::full:
      return "full";
  }
  return "?";
}

GradientManager::GradientManager(ManagerConfig config) : config_(std::move(config)) {
  const std::size_t n = config_.params.size();
  adamw_ = config_.optimizer.name == "adamw";
  if (!adamw_ && config_.optimizer.name != "sign_sgd")
    throw Error(Errc::not_supported, "optimizer.name",
                "'" + config_.optimizer.name + "': stepcore implements adamw and sign_sgd");
  if (config_.chunk_elements == 0) throw Error(Errc::out_of_range, "chunk_elements", "must be > 0");
  chunk_of_.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t numel = config_.params[i].numel;
    if (chunks_.empty() || (chunks_.back().elements != 0 &&
                            chunks_.back().elements + numel > config_.chunk_elements)) {
      chunks_.push_back({i, i, 0});
    }
    Chunk& c = chunks_.back();
    c.last = i + 1;
    c.elements += numel;
    chunk_of_[i] = chunks_.size() - 1;
  }
  ready_in_micro_.assign(n, 0);
  got_in_step_.assign(n, 0);
  chunk_pending_.assign(chunks_.size(), 0);
}

GradientManager::~GradientManager() = default;

void GradientManager::expect(bool ok, const char* call, const char* what) const {
  if (phase_ == Phase::closed) throw Error(Errc::invalid_argument, call, "the manager is closed");
  if (failure_) std::rethrow_exception(failure_);
  if (!ok) throw Error(Errc::invalid_argument, call, what);
}

namespace {
// Returns true for the codes of work that already started (docs: error.hpp "runtime").
bool is_runtime(Errc c) {
  return c == Errc::cuda_error || c == Errc::nccl_error || c == Errc::mpi_error ||
         c == Errc::timeout || c == Errc::internal;
}
}  // namespace

template <class F>
decltype(auto) GradientManager::guarded(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    // A failure of asynchronous work leaves the step half done: every later call
    // raises it again (close() still cleans up). Argument errors change nothing.
    if (is_runtime(e.code())) failure_ = std::current_exception();
    throw;
  } catch (...) {
    failure_ = std::current_exception();
    throw;
  }
}

void GradientManager::load_parameter(std::size_t i, std::span<const float> master) {
  expect(phase_ == Phase::idle, "load_parameter", "only between steps");
  if (i >= config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  if (master.size() != config_.params[i].numel)
    throw Error(Errc::size_mismatch, "master",
                std::to_string(master.size()) + " values for " +
                    std::to_string(config_.params[i].numel) + " elements");
  for (float x : master)
    if (!std::isfinite(x)) throw Error(Errc::non_finite, "master", "non-finite master weight");
  guarded([&] { do_load_parameter(i, master); });
}

void GradientManager::begin_step(float gradient_scale, bool overlap_optimizer) {
  expect(phase_ == Phase::idle, "begin_step", "the previous step has not ended with step()");
  ::stepcore::detail::check_gradient_scale(gradient_scale, "gradient_scale");
  guarded([&] { do_begin_step(); });  // may raise errors of the previous step's work
  scale_ = gradient_scale;
  clip_ = 1.0f;
  overlap_ = overlap_optimizer;
  saw_final_ = clipped_ = stepped_ = false;
  std::fill(got_in_step_.begin(), got_in_step_.end(), std::uint8_t{0});
  phase_ = Phase::step;
}

void GradientManager::begin_backward(bool final_backward) {
  expect(phase_ == Phase::step, "begin_backward",
         "needs begin_step() first, and finish_backward() after each backward");
  expect(!saw_final_, "begin_backward", "the step's final backward has already run");
  guarded([&] { do_begin_backward(); });
  final_ = final_backward;
  std::fill(ready_in_micro_.begin(), ready_in_micro_.end(), std::uint8_t{0});
  if (final_)
    for (std::size_t c = 0; c < chunks_.size(); ++c)
      chunk_pending_[c] = chunks_[c].last - chunks_[c].first;
  phase_ = Phase::backward;
}

TensorView GradientManager::gradient(std::size_t i) {
  expect(phase_ == Phase::backward, "gradient", "only between begin_backward and finish_backward");
  if (i >= config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  return guarded([&] { return do_gradient(i); });
}

void GradientManager::gradient_ready(std::size_t i, const device::Event& written) {
  expect(phase_ == Phase::backward, "gradient_ready",
         "only between begin_backward and finish_backward");
  if (i >= config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  if (ready_in_micro_[i])
    throw Error(Errc::invalid_argument, "gradient_ready",
                "parameter " + std::to_string(i) + " is already ready in this micro-batch");
  guarded([&] { do_gradient_ready(i, got_in_step_[i] == 0, written); });
  ready_in_micro_[i] = 1;
  got_in_step_[i] = 1;
  if (final_ && overlap_) {
    const std::size_t c = chunk_of_[i];
    if (--chunk_pending_[c] == 0) guarded([&] { do_step_chunk(c); });
  }
}

device::Event GradientManager::gradient_released(std::size_t i) const {
  if (i >= config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  return do_gradient_released(i);
}

void GradientManager::finish_backward() {
  expect(phase_ == Phase::backward, "finish_backward", "needs begin_backward() first");
  if (final_) {
    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < got_in_step_.size(); ++i)
      if (!got_in_step_[i]) missing.push_back(i);
    guarded([&] { do_finish_final_backward(missing); });
    for (std::size_t i : missing) got_in_step_[i] = 1;
    if (overlap_) {
      // Chunks whose parameters did not all report in the final micro-batch step now.
      for (std::size_t c = 0; c < chunks_.size(); ++c)
        if (chunk_pending_[c] != 0) {
          chunk_pending_[c] = 0;
          guarded([&] { do_step_chunk(c); });
        }
    }
    saw_final_ = true;
    phase_ = Phase::after_final;
  } else {
    phase_ = Phase::step;
  }
}

float GradientManager::clip_grad_norm(float max_norm) {
  expect(phase_ == Phase::after_final, "clip_grad_norm",
         "only after the step's final finish_backward() and before step()");
  expect(!overlap_, "clip_grad_norm",
         "clipping needs every gradient before any optimizer step, but this step overlaps "
         "the optimizer with backward (begin_step(..., overlap_optimizer = true))");
  expect(!clipped_, "clip_grad_norm", "already called in this step");
  ::stepcore::detail::check_max_norm(max_norm);
  float clip = 1.0f;
  const NormResult r = guarded([&] { return do_clip_grad_norm(max_norm, clip); });
  clip_ = clip;
  clipped_ = true;
  return r.norm;
}

void GradientManager::step() {
  expect(phase_ == Phase::after_final, "step", "only after the step's final finish_backward()");
  guarded([&] { do_step(); });
  stepped_ = true;
  phase_ = Phase::idle;
}

StepReport GradientManager::report() {
  expect(phase_ != Phase::closed, "report", "");
  return guarded([&] { return do_report(); });
}

ConstTensorView GradientManager::compute_weights(std::size_t i) const {
  expect(phase_ != Phase::closed, "compute_weights", "");
  if (i >= config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  return do_compute_weights(i);
}

void GradientManager::read_parameter(std::size_t i, std::span<float> master,
                                     std::span<float> exp_avg, std::span<float> exp_avg_sq,
                                     std::span<std::uint8_t> compute) {
  expect(phase_ == Phase::idle, "read_parameter", "only between steps");
  if (i >= config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  const ParamSpec& p = config_.params[i];
  auto check = [&](std::size_t got, std::size_t want, const char* name) {
    if (got != 0 && got != want)
      throw Error(Errc::size_mismatch, name,
                  std::to_string(got) + " for " + std::to_string(want) + " expected");
  };
  check(master.size(), p.numel, "master");
  check(exp_avg.size(), adamw_ ? p.numel : 0, "exp_avg");
  check(exp_avg_sq.size(), adamw_ ? p.numel : 0, "exp_avg_sq");
  check(compute.size(), p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0,
        "compute");
  guarded([&] { do_read_parameter(i, master, exp_avg, exp_avg_sq, compute); });
}

void GradientManager::synchronize() {
  expect(phase_ != Phase::closed, "synchronize", "");
  guarded([&] { do_synchronize(); });
}

void GradientManager::close() {
  if (phase_ == Phase::closed) return;
  phase_ = Phase::closed;
  if (std::exception_ptr error = do_close()) std::rethrow_exception(error);
}

}  // namespace stepcore
