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

}  // namespace stepcore::cuda
