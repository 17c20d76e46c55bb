// Device discovery for the CUDA layer, and the scope of a current device.
#include <cuda_runtime.h>

#include <string>

#include "kernels/check.cuh"
#include "stepcore/cuda_host.hpp"
#include "stepcore/error.hpp"

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

CurrentDevice::CurrentDevice(int device) {
  const int n = device_count();
  if (n == 0) return;
  if (device < 0 || device >= n)
    throw Error(Errc::invalid_argument, "device",
                "CUDA device " + std::to_string(device) + " is not present (" + std::to_string(n) +
                    " devices)");
  int current = -1;
  detail::check(cudaGetDevice(&current), "cudaGetDevice");
  if (current == device) return;
  detail::check(cudaSetDevice(device), "cudaSetDevice");
  previous_ = current;
}

CurrentDevice::~CurrentDevice() {
  if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
}

}  // namespace stepcore::cuda
