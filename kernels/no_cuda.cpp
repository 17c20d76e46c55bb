// The CUDA entry points of a build without CUDA: report that, never pretend.
#include "kernels/testing.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/device.hpp"
#include "stepcore/error.hpp"
#include "stepcore/gpu.hpp"

namespace stepcore::cuda {

bool built_with_cuda() noexcept { return false; }
int device_count() noexcept { return 0; }
std::string unavailable_reason() {
  return "stepcore was built without CUDA (STEPCORE_CUDA=OFF or no nvcc)";
}

std::string pci_bus_id(int) {
  throw Error(Errc::not_supported, "device", "stepcore was built without CUDA");
}

void host_register(void*, std::size_t) {
  throw Error(Errc::not_supported, "ptr", "stepcore was built without CUDA");
}
void host_unregister(void*) noexcept {}

CurrentDevice::CurrentDevice(int) {}  // no device to make current
CurrentDevice::~CurrentDevice() = default;

namespace testing {
void convert_all_on_device(float*, float*, const float*, std::uint16_t*, std::uint16_t*,
                           std::size_t, cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}
}  // namespace testing

}  // namespace stepcore::cuda

namespace stepcore::gpu {

void scale_and_norm_partial(std::span<const TensorView>, float, NormPartial*, void*, std::size_t,
                            cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}

void norm_partial(std::span<const ConstTensorView>, GradientRead, NormPartial*, void*, std::size_t,
                  cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}
void scale_and_norm_partial(std::span<const TensorView>, const float*, NormPartial*, void*,
                            std::size_t, cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}
void norm_partial(std::span<const ConstTensorView>, const DeviceGradientRead&, NormPartial*, void*,
                  std::size_t, cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}
void exact_norm_partial_if_needed(std::span<const ConstTensorView>, const DeviceGradientRead&,
                                  const std::int32_t*, NormPartial*, void*, std::size_t,
                                  cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}
void scale_(std::span<const TensorView>, const float*, cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}
void accumulate(std::span<const AccumulatePair>, cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}

void optimizer_step(std::span<const OptimizerTensor>, const OptimizerConfig&,
                    const OptimizerDeviceArgs&, cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}

void finalize_and_clip(const NormPartial*, float, NormResult*, float*, std::int32_t*,
                       cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}

void exact_norm_partial_if_needed(std::span<const ConstTensorView>, GradientRead,
                                  const std::int32_t*, NormPartial*, void*, std::size_t,
                                  cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}

void finalize_exact_and_clip(const NormPartial*, float, NormResult*, float*, std::int32_t*,
                             cudaStream_t) {
  throw Error(Errc::not_supported, "", "stepcore was built without CUDA");
}

}  // namespace stepcore::gpu

namespace stepcore::device {

std::unique_ptr<Device> make_cuda_device(int, cudaStream_t, std::chrono::milliseconds) {
  throw Error(Errc::not_supported, "ordinal", "stepcore was built without CUDA");
}

}  // namespace stepcore::device
