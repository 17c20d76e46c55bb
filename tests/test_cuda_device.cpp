// GPU: the CUDA device (stepcore::device::make_cuda_device) through the Device interface:
// every kernel entry point against the reference and the CPU executor bit for bit,
// copies on the d2h/h2d streams ordered by events, zero(), the compute stream waiting on
// a copy, page-locked host memory, and validation. Skips without a device.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "device_cases.hpp"
#include "kernels/plans.hpp"
#include "stepcore/cuda.hpp"
#include "stepcore/device.hpp"

#if defined(STEPCORE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using namespace stepcore;
using device::Queue;

#define SKIP_WITHOUT_DEVICE() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

#if defined(STEPCORE_WITH_CUDA)

TEST(CudaDevice, Basics) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  EXPECT_EQ(dev->name(), "cuda:0");
  EXPECT_NE(dev->compute_stream(), nullptr);
  void* h = dev->allocate_host(1 << 20, 0);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, h), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "allocate_host() is page-locked";
  void* d = dev->allocate(1000);
  ASSERT_EQ(cudaPointerGetAttributes(&attr, d), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  dev->deallocate(d);
  dev->deallocate_host(h);
  EXPECT_EQ(device_cases::error_code([] { device::make_cuda_device(cuda::device_count()); }),
            Errc::not_supported);
}

TEST(CudaDevice, UsesAGivenComputeStream) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    auto dev = device::make_cuda_device(0, s);
    EXPECT_EQ(dev->compute_stream(), s);
    device_cases::exact_fallback_resolves_a_tie(*dev);
  }
  EXPECT_EQ(cudaStreamQuery(s), cudaSuccess) << "the given stream outlives the device";
  cudaStreamDestroy(s);
}

// The legacy default stream can be the compute stream (the trainer's stream when it uses
// the default one); a kernel written there before gradient-style reads is ordered by
// the stream alone. record_on/wait_on order a foreign stream with the device's queues.
TEST(CudaDevice, TheLegacyDefaultStreamAndForeignStreamEvents) {
  SKIP_WITHOUT_DEVICE();
  {
    auto dev = device::make_cuda_device(0, cudaStreamLegacy);
    EXPECT_EQ(dev->compute_stream(), cudaStreamLegacy);
    device_cases::exact_fallback_resolves_a_tie(*dev);
  }
  auto dev = device::make_cuda_device(0);
  cudaStream_t trainer = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&trainer, cudaStreamNonBlocking), cudaSuccess);
  std::vector<float> host(1 << 20, 3.0f), back(1 << 20, 0.0f);
  void* d = dev->allocate(host.size() * 4);
  ASSERT_EQ(cudaMemcpyAsync(d, host.data(), host.size() * 4, cudaMemcpyHostToDevice, trainer),
            cudaSuccess);
  dev->wait(device::Queue::d2h, dev->record_on(trainer));  // the write, then the read
  dev->copy(device::Queue::d2h, back.data(), d, back.size() * 4);
  dev->wait_on(trainer, dev->record(device::Queue::d2h));
  ASSERT_EQ(cudaStreamSynchronize(trainer), cudaSuccess);
  EXPECT_EQ(back, host);
  dev->deallocate(d);
  cudaStreamDestroy(trainer);
}

TEST(CudaDevice, EveryKernelMatchesTheExecutorAndTheReference) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  device_cases::kernels_match_reference(*dev, gpu::kBlockThreads);
}

TEST(CudaDevice, ExactFallbackResolvesATie) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  device_cases::exact_fallback_resolves_a_tie(*dev);
}

TEST(CudaDevice, CopiesAreOrderedByEvents) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  device_cases::copies_are_ordered_by_events(*dev);
}

TEST(CudaDevice, ZeroOnEveryQueue) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  device_cases::zero_on_every_queue(*dev);
}

TEST(CudaDevice, ComputeWaitsForCopies) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  device_cases::compute_waits_for_copies(*dev);
}

TEST(CudaDevice, Validation) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  device_cases::validation(*dev);
}

#else

TEST(CudaDevice, Basics) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_EQ(device_cases::error_code([] { device::make_cuda_device(0); }), Errc::not_supported);
}

#endif

}  // namespace
