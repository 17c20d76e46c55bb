// GPU: the shared __host__ __device__ conversions give the host's bits on the
// device, for all 65,536 16-bit patterns and a sweep of f32 inputs.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/testing.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cuda_host.hpp"
#include "stepcore/host_slab.hpp"

#if defined(STEPCORE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

TEST(GpuConversions, DeviceBitsEqualHostBits) {
  if (stepcore::cuda::device_count() == 0)
    GTEST_SKIP() << "no CUDA device: " << stepcore::cuda::unavailable_reason();
#if defined(STEPCORE_WITH_CUDA)
  // Inputs: every bf16-aligned pattern's neighbourhood plus random bits.
  std::vector<float> in;
  for (std::uint32_t hi = 0; hi < 65536; ++hi)
    for (std::uint32_t lo : {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu})
      in.push_back(stepcore::f32_from_bits((hi << 16) | lo));
  std::mt19937 rng(7);
  for (int i = 0; i < 1 << 20; ++i) in.push_back(stepcore::f32_from_bits(rng()));
  const std::size_t n = in.size();

  float *d_bw = nullptr, *d_fw = nullptr, *d_in = nullptr;
  std::uint16_t *d_bo = nullptr, *d_fo = nullptr;
  ASSERT_EQ(cudaMalloc(&d_bw, 65536 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_fw, 65536 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_in, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_bo, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_fo, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  stepcore::cuda::testing::convert_all_on_device(d_bw, d_fw, d_in, d_bo, d_fo, n, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> bw(65536), fw(65536);
  std::vector<std::uint16_t> bo(n), fo(n);
  cudaMemcpy(bw.data(), d_bw, 65536 * sizeof(float), cudaMemcpyDeviceToHost);
  cudaMemcpy(fw.data(), d_fw, 65536 * sizeof(float), cudaMemcpyDeviceToHost);
  cudaMemcpy(bo.data(), d_bo, n * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(fo.data(), d_fo, n * 2, cudaMemcpyDeviceToHost);
  cudaFree(d_bw);
  cudaFree(d_fw);
  cudaFree(d_in);
  cudaFree(d_bo);
  cudaFree(d_fo);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(stepcore::f32_bits(bw[i]), stepcore::f32_bits(stepcore::bf16_bits_to_f32(i))) << i;
    ASSERT_EQ(stepcore::f32_bits(fw[i]), stepcore::f32_bits(stepcore::f16_bits_to_f32(i))) << i;
  }
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(bo[i], stepcore::f32_to_bf16_bits(in[i])) << std::hex << stepcore::f32_bits(in[i]);
    ASSERT_EQ(fo[i], stepcore::f32_to_f16_bits(in[i])) << std::hex << stepcore::f32_bits(in[i]);
  }
#endif
}

TEST(GpuHostSlab, PinsWhenADeviceIsPresent) {
  if (stepcore::cuda::device_count() == 0)
    GTEST_SKIP() << "no CUDA device: " << stepcore::cuda::unavailable_reason();
  const std::vector<std::size_t> sizes = {std::size_t{4} << 20, 12345};
  stepcore::HostSlab slab(sizes, -1, stepcore::PinMode::required);
  EXPECT_TRUE(slab.pinned());
#if defined(STEPCORE_WITH_CUDA)
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, slab.view(1)), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost);
  const std::string bus = stepcore::cuda::pci_bus_id(0);
  EXPECT_NE(bus.find(':'), std::string::npos) << bus;
  EXPECT_NE(bus.find('.'), std::string::npos) << bus;
#endif
}

}  // namespace
