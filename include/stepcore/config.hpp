// Build-wide macros: __host__ __device__ annotations and version numbers.
#pragma once

#include "stepcore/version.hpp"  // STEPCORE_VERSION_* (generated from project(VERSION))

#if defined(__CUDACC__)
#define STEPCORE_HD __host__ __device__
#else
#define STEPCORE_HD
#endif

#define STEPCORE_HD_INLINE STEPCORE_HD inline
