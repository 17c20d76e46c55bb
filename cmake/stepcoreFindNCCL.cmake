# Finds NCCL and defines the imported target NCCL::nccl (headers and library). Used by
# stepcore's build and, for a static stepcore built with NCCL, by its package config.
# Hints, in order: NCCL_ROOT (variable or environment), STEPCORE_NCCL_HINTS, the CUDA
# toolkit's folders (after find_package(CUDAToolkit)). Does nothing when NCCL::nccl
# already exists (a project that found NCCL its own way).
if(NOT TARGET NCCL::nccl)
  set(_stepcore_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${STEPCORE_NCCL_HINTS}
    ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  find_path(STEPCORE_NCCL_INCLUDE nccl.h
    HINTS ${_stepcore_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(STEPCORE_NCCL_LIBRARY nccl
    HINTS ${_stepcore_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib64 lib)
  mark_as_advanced(STEPCORE_NCCL_INCLUDE STEPCORE_NCCL_LIBRARY)
  unset(_stepcore_nccl_hints)
  if(STEPCORE_NCCL_INCLUDE AND STEPCORE_NCCL_LIBRARY)
    add_library(NCCL::nccl UNKNOWN IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES
      IMPORTED_LOCATION "${STEPCORE_NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${STEPCORE_NCCL_INCLUDE}")
  endif()
endif()
