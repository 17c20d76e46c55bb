// Runs the shared __host__ __device__ conversions on the device, so a GPU test
// can compare them with the host's bits.
#include <cuda_runtime.h>

#include "kernels/check.cuh"
#include "kernels/testing.hpp"
#include "stepcore/convert.hpp"
#include "stepcore/cuda_host.hpp"

namespace stepcore::cuda {
namespace {

// One thread per 16-bit pattern: widen bf16 and f16.
__global__ void widen_all_kernel(float* bf16_widened, float* f16_widened) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 65536u) {
    bf16_widened[i] = bf16_bits_to_f32(static_cast<std::uint16_t>(i));
    f16_widened[i] = f16_bits_to_f32(static_cast<std::uint16_t>(i));
  }
}

// Grid-stride loop over n floats: narrow to bf16 and f16.
__global__ void narrow_kernel(const float* in, std::uint16_t* bf16_out, std::uint16_t* f16_out,
                              std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    bf16_out[i] = f32_to_bf16_bits(in[i]);
    f16_out[i] = f32_to_f16_bits(in[i]);
  }
}

}  // namespace

namespace testing {
void convert_all_on_device(float* d_bf16_widened, float* d_f16_widened, const float* d_f32_in,
                           std::uint16_t* d_bf16_out, std::uint16_t* d_f16_out, std::size_t n,
                           cudaStream_t stream) {
  if (!d_bf16_widened || !d_f16_widened)
    throw Error(Errc::null_pointer, "d_bf16_widened", "output buffers must not be null");
  if (n != 0 && (!d_f32_in || !d_bf16_out || !d_f16_out))
    throw Error(Errc::null_pointer, "d_f32_in", "null buffer with n > 0");
  constexpr int kThreads = 256;
  widen_all_kernel<<<65536 / kThreads, kThreads, 0, stream>>>(d_bf16_widened, d_f16_widened);
  detail::check_launch("widen_all_kernel");
  if (n != 0) {
    const unsigned blocks =
        static_cast<unsigned>(n / kThreads + 1 > 4096 ? 4096 : n / kThreads + 1);
    narrow_kernel<<<blocks, kThreads, 0, stream>>>(d_f32_in, d_bf16_out, d_f16_out, n);
    detail::check_launch("narrow_kernel");
  }
}
}  // namespace testing

}  // namespace stepcore::cuda
