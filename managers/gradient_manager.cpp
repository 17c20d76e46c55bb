// The mode-independent part of every gradient manager (detail::ManagerImpl): argument
// and call-sequence validation (all before anything changes), chunking, per-step gradient
// bookkeeping and the optimizer-in-backward trigger; the modes implement its hooks. The
// public GradientManager forwards every call to it. Also the mode and optimizer parsers.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <utility>

#include "core/validate.hpp"
#include "managers/manager_impl.hpp"
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

namespace {
// The optimizers' names, indexed by OptimizerKind.
constexpr std::string_view kOptimizerNames[] = {"adamw", "sign_sgd"};
static_assert(static_cast<std::size_t>(OptimizerKind::adamw) == 0 &&
              static_cast<std::size_t>(OptimizerKind::sign_sgd) == 1);
}  // namespace

OptimizerKind parse_optimizer(std::string_view name) {
  for (std::size_t k = 0; k < std::size(kOptimizerNames); ++k)
    if (name == kOptimizerNames[k]) return static_cast<OptimizerKind>(k);
  throw Error(
      Errc::invalid_argument, "optimizer",
      "unknown optimizer '" + std::string(name) +
          "': expected exactly one of adamw, sign_sgd (the optimizers stepcore implements)");
}

std::string_view optimizer_name(OptimizerKind kind) noexcept {
  const auto k = static_cast<std::size_t>(kind);
  return k < std::size(kOptimizerNames) ? kOptimizerNames[k] : "?";
}

// ---- the state the call sequence keeps, and the modes' chunks -------------------------

namespace detail {

ManagerImpl::ManagerImpl(ManagerConfig config) : config_(std::move(config)) {
  const std::size_t n = config_.params.size();
  const OptimizerKind kind = config_.optimizer.kind;
  if (kind != OptimizerKind::adamw && kind != OptimizerKind::sign_sgd)
    throw Error(Errc::not_supported, "optimizer.kind",
                std::to_string(static_cast<int>(kind)) +
                    " is not an OptimizerKind: stepcore implements adamw and sign_sgd");
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

ManagerImpl::~ManagerImpl() = default;

void ManagerImpl::expect(bool ok, const char* call, const char* what) const {
  if (phase_ == CallPhase::closed)
    throw Error(Errc::invalid_argument, call, "the manager is closed");
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
decltype(auto) ManagerImpl::guarded(F&& f) {
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

}  // namespace detail

// ---- the call sequence: validated here, then the mode's hook ---------------------------

using detail::CallPhase;

GradientManager::GradientManager(std::unique_ptr<detail::ManagerImpl> impl) noexcept
    : impl_(std::move(impl)) {}
GradientManager::~GradientManager() = default;

OffloadMode GradientManager::mode() const noexcept { return impl_->config_.mode; }
const ManagerConfig& GradientManager::config() const noexcept { return impl_->config_; }
float GradientManager::effective_gradient_scale() const noexcept {
  return impl_->scale_ * impl_->clip_;
}

void GradientManager::load_parameter(std::size_t i, std::span<const float> master) {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "load_parameter", "only between steps");
  if (i >= m.config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  if (master.size() != m.config_.params[i].numel)
    throw Error(Errc::size_mismatch, "master",
                std::to_string(master.size()) + " values for " +
                    std::to_string(m.config_.params[i].numel) + " elements");
  for (float x : master)
    if (!std::isfinite(x)) throw Error(Errc::non_finite, "master", "non-finite master weight");
  m.guarded([&] { m.do_load_parameter(i, master); });
}

void GradientManager::begin_step(float gradient_scale, bool overlap_optimizer) {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "begin_step",
           "the previous step has not ended with step()");
  ::stepcore::detail::check_gradient_scale(gradient_scale, "gradient_scale");
  m.guarded([&] { m.do_begin_step(); });  // may raise errors of the previous step's work
  m.scale_ = gradient_scale;
  m.clip_ = 1.0f;
  m.overlap_ = overlap_optimizer;
  m.saw_final_ = m.clipped_ = m.stepped_ = false;
  std::fill(m.got_in_step_.begin(), m.got_in_step_.end(), std::uint8_t{0});
  m.phase_ = CallPhase::step;
}

void GradientManager::begin_backward(bool final_backward) {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::step, "begin_backward",
           "needs begin_step() first, and finish_backward() after each backward");
  m.expect(!m.saw_final_, "begin_backward", "the step's final backward has already run");
  m.guarded([&] { m.do_begin_backward(); });
  m.final_ = final_backward;
  std::fill(m.ready_in_micro_.begin(), m.ready_in_micro_.end(), std::uint8_t{0});
  if (m.final_)
    for (std::size_t c = 0; c < m.chunks_.size(); ++c)
      m.chunk_pending_[c] = m.chunks_[c].last - m.chunks_[c].first;
  m.phase_ = CallPhase::backward;
}

TensorView GradientManager::gradient(std::size_t i) {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::backward, "gradient",
           "only between begin_backward and finish_backward");
  if (i >= m.config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  return m.guarded([&] { return m.do_gradient(i); });
}

void GradientManager::gradient_ready(std::size_t i, const device::Event& written) {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::backward, "gradient_ready",
           "only between begin_backward and finish_backward");
  if (i >= m.config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  if (m.ready_in_micro_[i])
    throw Error(Errc::invalid_argument, "gradient_ready",
                "parameter " + std::to_string(i) + " is already ready in this micro-batch");
  m.guarded([&] { m.do_gradient_ready(i, m.got_in_step_[i] == 0, written); });
  m.ready_in_micro_[i] = 1;
  m.got_in_step_[i] = 1;
  if (m.final_ && m.overlap_) {
    const std::size_t c = m.chunk_of_[i];
    if (--m.chunk_pending_[c] == 0) m.guarded([&] { m.do_step_chunk(c); });
  }
}

device::Event GradientManager::gradient_released(std::size_t i) const {
  const detail::ManagerImpl& m = *impl_;
  if (i >= m.config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  return m.do_gradient_released(i);
}

void GradientManager::finish_backward() {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::backward, "finish_backward", "needs begin_backward() first");
  if (m.final_) {
    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < m.got_in_step_.size(); ++i)
      if (!m.got_in_step_[i]) missing.push_back(i);
    m.guarded([&] { m.do_finish_final_backward(missing); });
    for (std::size_t i : missing) m.got_in_step_[i] = 1;
    if (m.overlap_) {
      // Chunks whose parameters did not all report in the final micro-batch step now.
      for (std::size_t c = 0; c < m.chunks_.size(); ++c)
        if (m.chunk_pending_[c] != 0) {
          m.chunk_pending_[c] = 0;
          m.guarded([&] { m.do_step_chunk(c); });
        }
    }
    m.saw_final_ = true;
    m.phase_ = CallPhase::after_final;
  } else {
    m.phase_ = CallPhase::step;
  }
}

float GradientManager::clip_grad_norm(float max_norm) {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::after_final, "clip_grad_norm",
           "only after the step's final finish_backward() and before step()");
  m.expect(!m.overlap_, "clip_grad_norm",
           "clipping needs every gradient before any optimizer step, but this step overlaps "
           "the optimizer with backward (begin_step(..., overlap_optimizer = true))");
  m.expect(!m.clipped_, "clip_grad_norm", "already called in this step");
  ::stepcore::detail::check_max_norm(max_norm);
  float clip = 1.0f;
  const NormResult r = m.guarded([&] { return m.do_clip_grad_norm(max_norm, clip); });
  m.clip_ = clip;
  m.clipped_ = true;
  return r.norm;
}

void GradientManager::step() {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::after_final, "step",
           "only after the step's final finish_backward()");
  m.guarded([&] { m.do_step(); });
  m.stepped_ = true;
  m.phase_ = CallPhase::idle;
}

StepReport GradientManager::report() {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ != CallPhase::closed, "report", "");
  return m.guarded([&] { return m.do_report(); });
}

ConstTensorView GradientManager::compute_weights(std::size_t i) const {
  const detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ != CallPhase::closed, "compute_weights", "");
  if (i >= m.config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  return m.do_compute_weights(i);
}

void GradientManager::read_parameter(std::size_t i, std::span<float> master,
                                     std::span<float> exp_avg, std::span<float> exp_avg_sq,
                                     std::span<std::uint8_t> compute) {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ == CallPhase::idle, "read_parameter", "only between steps");
  if (i >= m.config_.params.size())
    throw Error(Errc::out_of_range, "i", std::to_string(i) + " >= number of parameters");
  const ParamSpec& p = m.config_.params[i];
  auto check = [&](std::size_t got, std::size_t want, const char* name) {
    if (got != 0 && got != want)
      throw Error(Errc::size_mismatch, name,
                  std::to_string(got) + " for " + std::to_string(want) + " expected");
  };
  check(master.size(), p.numel, "master");
  check(exp_avg.size(), m.is_adamw() ? p.numel : 0, "exp_avg");
  check(exp_avg_sq.size(), m.is_adamw() ? p.numel : 0, "exp_avg_sq");
  check(compute.size(), p.has_compute_weights ? p.numel * dtype_size(p.compute_dtype) : 0,
        "compute");
  m.guarded([&] { m.do_read_parameter(i, master, exp_avg, exp_avg_sq, compute); });
}

void GradientManager::synchronize() {
  detail::ManagerImpl& m = *impl_;
  m.expect(m.phase_ != CallPhase::closed, "synchronize", "");
  m.guarded([&] { m.do_synchronize(); });
}

void GradientManager::close() {
  detail::ManagerImpl& m = *impl_;
  if (m.phase_ == CallPhase::closed) return;
  m.phase_ = CallPhase::closed;
  if (std::exception_ptr error = m.do_close()) std::rethrow_exception(error);
}

}  // namespace stepcore
