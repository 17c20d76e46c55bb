// The device-resident gradient managers on a real CUDA device: the same differential and
// non-finite tests as test_gpu_manager (host device), against the same reference bits.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include "gpu_manager_cases.hpp"
#include "stepcore/cuda_host.hpp"

namespace {

using namespace gpu_manager_cases;

auto cuda_device() { return device::make_cuda_device(0); }

TEST(GpuManagerDevice, EveryVariantGivesTheReferenceBitsAfterEveryStep) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  differential(cuda_device);
}

TEST(GpuManagerDevice, NonFiniteGradientsSkipTheStepOrOnlyTheirChunk) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  non_finite(cuda_device);
}

}  // namespace
