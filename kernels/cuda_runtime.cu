// Device discovery for the CUDA layer.
#include <cuda_runtime.h>

#include "kernels/check.cuh"
#include "stepcore/cuda_host.hpp"

namespace stepcore::cuda {

bool built_with_cuda() noexcept { return true; }

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

std::string pci_bus_id(int device) {
  char buf[32] = {};
  detail::check(cudaDeviceGetPCIBusId(buf, sizeof buf, device), "cudaDeviceGetPCIBusId");
  return buf;
}

void host_register(void* ptr, std::size_t bytes) {
  detail::check(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable), "cudaHostRegister");
}

void host_unregister(void* ptr) noexcept {
  if (cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t s = cudaGetDeviceCount(&n);
  if (s != cudaSuccess) {
    cudaGetLastError();
    return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(s) + " (" +
           cudaGetErrorString(s) + ")";
  }
  return n > 0 ? std::string() : std::string("no CUDA device is present");
}

}  // namespace stepcore::cuda
