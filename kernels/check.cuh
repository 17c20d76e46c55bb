// Error idiom of the CUDA layer: every runtime call and launch is checked and
// turned into stepcore::Error(Errc::cuda_error) naming the call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "stepcore/error.hpp"

namespace stepcore::cuda::detail {

/// Throws Errc::cuda_error when `status` is not cudaSuccess.
inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(Errc::cuda_error, what,
                std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
}

/// Checks the launch that was just made (cudaGetLastError after every launch).
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

}  // namespace stepcore::cuda::detail
