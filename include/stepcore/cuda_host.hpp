// The host side of CUDA in the public API (what the build and the machine offer, PCI
// placement, page-locking), free of CUDA headers: streams are passed as the runtime's
// opaque handle type. The kernels' launchers are gpu.hpp. Every function is available in
// every build; without CUDA support they throw Errc::not_supported (device_count returns 0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace stepcore::cuda {

/// Returns true when the library was built with its CUDA kernels.
bool built_with_cuda() noexcept;

/// Returns the number of usable CUDA devices (0 without CUDA, a driver or a GPU).
int device_count() noexcept;

/// Returns the PCI bus id ("dddd:bb:dd.f") of CUDA device `device` (for NUMA placement:
/// numa::Topology::place). Throws Errc::cuda_error / not_supported.
std::string pci_bus_id(int device);

/// Page-locks [ptr, ptr + bytes) for asynchronous copies (cudaHostRegister, portable);
/// throws Errc::cuda_error / not_supported. host_unregister undoes it and never throws.
void host_register(void* ptr, std::size_t bytes);
void host_unregister(void* ptr) noexcept;

/// Returns why no device is usable ("" when device_count() > 0); tests print it
/// when they skip.
std::string unavailable_reason();

/// Makes CUDA device `device` the calling thread's current device while alive, and the
/// previous one current again at its end. The launchers of gpu.hpp launch on the current
/// device and refuse memory of any other (Errc::invalid_argument naming the argument), so
/// a caller whose arrays are on another device makes theirs current around the call.
/// Without a usable device (no CUDA support, driver or GPU) it changes nothing. Throws
/// Errc::invalid_argument naming "device" for a device that is not present,
/// Errc::cuda_error when it cannot be made current.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device);
  ~CurrentDevice();  ///< never throws
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;  ///< the device to make current again (-1: none was changed)
};

}  // namespace stepcore::cuda
