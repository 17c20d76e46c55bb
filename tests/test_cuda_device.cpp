// GPU: the CUDA device (stepcore::device::make_cuda_device) through the Device interface:
// every kernel entry point against the reference and the CPU executor bit for bit,
// copies on the d2h/h2d streams ordered by events, zero() (refused on host memory under
// capture), the compute stream waiting on a copy, page-locked host memory, waits bounded
// by the wait timeout (the device's own and its events'), memory of this very device,
// and validation. Skips without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "device/device_internal.hpp"  // detail::cuda_events_made
#include "device_cases.hpp"
#include "kernels/plans.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/device.hpp"
#include "stepcore/gpu.hpp"

#if defined(STEPCORE_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda_gate.hpp"
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

// record() and record_on() reuse the CUDA events of handles that are gone (a manager
// records one per gradient, many thousands a step): a thousand handoffs make at most two
// events; events alive at once are distinct; a reused event still orders a copy after a
// write on a foreign stream.
TEST(CudaDevice, EventsComeFromAPool) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  cudaStream_t trainer = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&trainer, cudaStreamNonBlocking), cudaSuccess);
  for (int k = 0; k < 1000; ++k) {
    dev->wait(device::Queue::compute, dev->record_on(trainer));
    dev->wait_on(trainer, dev->record(device::Queue::compute));
  }
  EXPECT_LE(device::detail::cuda_events_made(*dev), 2u);
  {
    std::vector<device::Event> held;
    for (int k = 0; k < 8; ++k) held.push_back(dev->record(device::Queue::d2h));
    EXPECT_GE(device::detail::cuda_events_made(*dev), 8u) << "live events are distinct";
  }
  const std::uint64_t made = device::detail::cuda_events_made(*dev);
  std::vector<float> host(1 << 20, 5.0f), back(1 << 20, 0.0f);
  void* d = dev->allocate(host.size() * 4);
  ASSERT_EQ(cudaMemcpyAsync(d, host.data(), host.size() * 4, cudaMemcpyHostToDevice, trainer),
            cudaSuccess);
  dev->wait(device::Queue::d2h, dev->record_on(trainer));  // a reused event
  dev->copy(device::Queue::d2h, back.data(), d, back.size() * 4);
  dev->synchronize(dev->record(device::Queue::d2h));
  EXPECT_EQ(device::detail::cuda_events_made(*dev), made) << "no new event";
  EXPECT_EQ(back, host);
  dev->deallocate(d);
  ASSERT_EQ(cudaStreamSynchronize(trainer), cudaSuccess);
  cudaStreamDestroy(trainer);
}

TEST(CudaDevice, EveryKernelMatchesTheExecutorAndTheReference) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  device_cases::kernels_match_reference(*dev, gpu::kBlockThreads);
}

TEST(CudaDevice, EveryOptimizerUnitMatchesTheReference) {
  SKIP_WITHOUT_DEVICE();
  auto dev = device::make_cuda_device(0);
  device_cases::every_optimizer_unit_matches_the_reference(*dev);
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

// The device's own waits are bounded: with the compute stream held by a gate (a hung
// collective), allocate still returns zero-filled memory (it waits on its own h2d stream,
// not the trainer's), deallocate and the destructor return at the bound instead of
// hanging (the memory is abandoned, not freed under the held work), and a bound that is
// not positive is refused, naming it.
TEST(CudaDevice, WaitsAreBoundedByTheWaitTimeout) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_EQ(device_cases::error_code(
                [] { device::make_cuda_device(0, nullptr, std::chrono::milliseconds(0)); }),
            Errc::out_of_range);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    cuda_gate::Gate gate;
    auto dev = device::make_cuda_device(0, s, std::chrono::milliseconds(300));
    void* before = dev->allocate(4096);
    gate.close(s, std::chrono::seconds(20));
    const auto t0 = std::chrono::steady_clock::now();
    void* p = dev->allocate(1 << 20);
    std::vector<unsigned char> host(1 << 20, 0xFF);
    ASSERT_EQ(cudaMemcpy(host.data(), p, host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::count(host.begin(), host.end(), 0), static_cast<long>(host.size()));
    dev->deallocate(before);  // the gate holds the compute stream: bounded, abandoned
    dev.reset();              // the same for the teardown
    const double s_waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s_waited, 5.0) << "a wait was not bounded by 300 ms";
    EXPECT_FALSE(gate.opened_by_watchdog());
    gate.open();
  }
  cudaStreamDestroy(s);
}

// Event::wait_for of a CUDA event is bounded (the trainer's stream held by a gate, as by a
// hung collective), a wait for a host event that blocks the caller is bounded by the
// wait timeout (Errc::timeout naming "e"), and check_memory takes the device's own
// memory and refuses host memory and (with two devices) another device's memory, naming
// the argument; so do the launchers with device 0 current.
TEST(CudaDevice, EventWaitsAreBoundedAndMemoryIsTheDevicesOwn) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    cuda_gate::Gate gate;
    auto dev = device::make_cuda_device(0, s, std::chrono::milliseconds(300));
    EXPECT_EQ(dev->wait_timeout(), std::chrono::milliseconds(300));
    gate.close(s, std::chrono::seconds(20));
    const device::Event held = dev->record_on(s);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_FALSE(held.wait_for(std::chrono::milliseconds(50)));
    EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(50));
    const device::HostEvent never;
    EXPECT_EQ(device_cases::error_code([&] { dev->wait(Queue::d2h, never.event()); }),
              Errc::timeout);
    gate.open();
    EXPECT_TRUE(held.wait_for(std::chrono::seconds(10)));
    EXPECT_FALSE(gate.opened_by_watchdog());

    void* d = dev->allocate(64);
    EXPECT_NO_THROW(dev->check_memory(d, 64, "x"));
    EXPECT_EQ(
        device_cases::error_code([&] { dev->check_memory(static_cast<char*>(d) + 60, 8, "x"); }),
        Errc::out_of_range);
    std::vector<float> host(16);
    EXPECT_EQ(device_cases::error_code([&] { dev->check_memory(host.data(), 64, "x"); }),
              Errc::invalid_argument);
    if (cuda::device_count() >= 2) {
      auto other = device::make_cuda_device(1);
      void* p1 = other->allocate(64);
      try {
        dev->check_memory(p1, 64, "params[2].compute_into");
        ADD_FAILURE() << "memory of device 1 accepted by device 0";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), Errc::invalid_argument);
        EXPECT_EQ(e.argument(), "params[2].compute_into");
        EXPECT_NE(std::string(e.what()).find("device memory of CUDA device 1"), std::string::npos)
            << e.what();
      }
      // The launchers on device 0 (current) refuse it too, before launching anything.
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      const AccumulatePair pair{TensorView{d, 16, DType::f32}, ConstTensorView{p1, 16, DType::f32},
                                false};
      EXPECT_EQ(device_cases::error_code([&] {
                  gpu::accumulate({&pair, 1}, s);
                }),
                Errc::invalid_argument);
      other->deallocate(p1);
    } else {
      std::printf("one CUDA device: another device's memory not tried\n");
    }
    dev->deallocate(d);
  }
  cudaStreamDestroy(s);
}

// zero() of host memory (a host callback that frees its argument after one run) is
// refused under stream capture, naming dst, instead of capturing a node whose second
// replay would read freed memory; zero() of device memory captures and replays.
TEST(CudaDevice, ZeroOfHostMemoryIsCapturedAndReplays) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    auto dev = device::make_cuda_device(0, s);
    auto* h = static_cast<unsigned char*>(dev->allocate_host(256));
    auto* d = static_cast<unsigned char*>(dev->allocate(256));
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    dev->zero(Queue::compute, h, 256);  // a host callback on a record the device owns
    dev->zero(Queue::compute, d, 256);
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int r = 0; r < 3; ++r) {  // from the second replay on, a freed argument would show
      std::memset(h, 0x5A + r, 256);
      ASSERT_EQ(cudaMemsetAsync(d, 0x5A, 256, s), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
      unsigned char back[256];
      ASSERT_EQ(cudaMemcpyAsync(back, d, 256, cudaMemcpyDeviceToHost, s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      EXPECT_EQ(std::count(back, back + 256, 0), 256) << "device, replay " << r;
      EXPECT_EQ(std::count(h, h + 256, 0), 256) << "host, replay " << r;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    dev->synchronize();
  }
  cudaStreamDestroy(s);
}

#else

TEST(CudaDevice, Basics) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_EQ(device_cases::error_code([] { device::make_cuda_device(0); }), Errc::not_supported);
}

#endif

}  // namespace
