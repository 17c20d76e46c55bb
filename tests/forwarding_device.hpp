// A device for tests and tools that need to watch or disguise one: the host device (or
// any device) behind a forwarding layer that counts allocations and host
// synchronisations.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "stepcore/device.hpp"

namespace test_support {

using namespace stepcore;

/// The host device (or `inner`), forwarding every call and counting allocations and host
/// synchronisations; tests derive from it to change what it claims to be.
class ForwardingDevice : public device::Device {
 public:
  ForwardingDevice() : host_(device::make_host_device(32)), streams_(false) {}
  /// Forwards to `inner`, streams included (a CUDA device's stream calls reach it).
  explicit ForwardingDevice(std::unique_ptr<device::Device> inner)
      : host_(std::move(inner)), streams_(true) {}

  /// The device it forwards to (its calls are not counted).
  device::Device& inner() noexcept { return *host_; }

  int allocations() const noexcept { return allocations_; }
  /// The synchronize() and synchronize(event) calls so far: the host waits of its user.
  int synchronizations() const noexcept { return synchronizations_; }

  std::string_view name() const noexcept override { return host_->name(); }
  std::chrono::milliseconds wait_timeout() const noexcept override { return host_->wait_timeout(); }
  void* allocate(std::size_t bytes) override {
    ++allocations_;
    return host_->allocate(bytes);
  }
  void deallocate(void* p) noexcept override { host_->deallocate(p); }
  void* allocate_host(std::size_t bytes, int numa_node) override {
    ++allocations_;
    return host_->allocate_host(bytes, numa_node);
  }
  void deallocate_host(void* p) noexcept override { host_->deallocate_host(p); }
  void check_memory(const void* p, std::size_t bytes, const std::string& name) const override {
    host_->check_memory(p, bytes, name);
  }
  void copy(device::Queue q, void* dst, const void* src, std::size_t bytes) override {
    host_->copy(q, dst, src, bytes);
  }
  void zero(device::Queue q, void* dst, std::size_t bytes) override { host_->zero(q, dst, bytes); }
  device::Event record(device::Queue q) override { return host_->record(q); }
  void wait(device::Queue q, const device::Event& e) override { host_->wait(q, e); }
  void synchronize(const device::Event& e) override {
    ++synchronizations_;
    host_->synchronize(e);
  }
  void synchronize() override {
    ++synchronizations_;
    host_->synchronize();
  }
  std::size_t norm_workspace_bytes(std::span<const TensorView> d_tensors) const override {
    return host_->norm_workspace_bytes(d_tensors);
  }
  void accumulate(std::span<const AccumulatePair> d_pairs) override { host_->accumulate(d_pairs); }
  void scale_and_norm_partial(std::span<const TensorView> d_tensors, float scale,
                              NormPartial* d_partial, void* d_workspace,
                              std::size_t workspace_bytes) override {
    host_->scale_and_norm_partial(d_tensors, scale, d_partial, d_workspace, workspace_bytes);
  }
  void norm_partial(std::span<const ConstTensorView> d_tensors, GradientRead read,
                    NormPartial* d_partial, void* d_workspace,
                    std::size_t workspace_bytes) override {
    host_->norm_partial(d_tensors, read, d_partial, d_workspace, workspace_bytes);
  }
  void finalize_and_clip(const NormPartial* d_partial, float max_norm, NormResult* d_result,
                         float* d_clip, std::int32_t* d_found_inf) override {
    host_->finalize_and_clip(d_partial, max_norm, d_result, d_clip, d_found_inf);
  }
  void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors, GradientRead read,
                                    const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                    void* d_workspace, std::size_t workspace_bytes) override {
    host_->exact_norm_partial_if_needed(d_tensors, read, d_found_inf, d_exact_partial, d_workspace,
                                        workspace_bytes);
  }
  void finalize_exact_and_clip(const NormPartial* d_exact_partial, float max_norm,
                               NormResult* d_result, float* d_clip,
                               std::int32_t* d_found_inf) override {
    host_->finalize_exact_and_clip(d_exact_partial, max_norm, d_result, d_clip, d_found_inf);
  }
  void scale_and_norm_partial(std::span<const TensorView> d_tensors, const float* d_scale,
                              NormPartial* d_partial, void* d_workspace,
                              std::size_t workspace_bytes) override {
    host_->scale_and_norm_partial(d_tensors, d_scale, d_partial, d_workspace, workspace_bytes);
  }
  void norm_partial(std::span<const ConstTensorView> d_tensors, const DeviceGradientRead& d_read,
                    NormPartial* d_partial, void* d_workspace,
                    std::size_t workspace_bytes) override {
    host_->norm_partial(d_tensors, d_read, d_partial, d_workspace, workspace_bytes);
  }
  void exact_norm_partial_if_needed(std::span<const ConstTensorView> d_tensors,
                                    const DeviceGradientRead& d_read,
                                    const std::int32_t* d_found_inf, NormPartial* d_exact_partial,
                                    void* d_workspace, std::size_t workspace_bytes) override {
    host_->exact_norm_partial_if_needed(d_tensors, d_read, d_found_inf, d_exact_partial,
                                        d_workspace, workspace_bytes);
  }
  void optimizer_step(std::span<const OptimizerTensor> d_tensors, const OptimizerConfig& config,
                      const OptimizerDeviceArgs& d) override {
    host_->optimizer_step(d_tensors, config, d);
  }
  device::Event record_on(cudaStream_t s) override {
    return host_->record_on(streams_ ? s : nullptr);
  }
  void wait_on(cudaStream_t s, const device::Event& e) override {
    host_->wait_on(streams_ ? s : nullptr, e);
  }
  cudaStream_t compute_stream() const noexcept override { return host_->compute_stream(); }

 private:
  std::unique_ptr<device::Device> host_;
  bool streams_;  // false: the host device behind a disguise, given no stream
  // Counted from any thread (a manager's worker and the trainer's both synchronise).
  std::atomic<int> allocations_{0};
  std::atomic<int> synchronizations_{0};
};

}  // namespace test_support
