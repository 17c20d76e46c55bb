// Build-wide macros: host/device annotations and version numbers.
#pragma once

#define STEPCORE_VERSION_MAJOR 0
#define STEPCORE_VERSION_MINOR 1
#define STEPCORE_VERSION_PATCH 0

#if defined(__CUDACC__)
#define STEPCORE_HD __host__ __device__
#else
#define STEPCORE_HD
#endif

#define STEPCORE_HD_INLINE STEPCORE_HD inline
