# The CUDA compiler and toolkit, found the CMake way: CMAKE_CUDA_COMPILER, the CUDACXX
# environment variable, CUDAToolkit_ROOT (variable or environment), else nvcc on PATH
# (the CUDA presets append the toolkit's usual bin folder to PATH as a last resort).
# No path is written here. Sets STEPCORE_HAVE_CUDA, STEPCORE_CUDA_ARCHITECTURES and,
# with CUDA, the CUDA:: imported targets (CUDA::cudart).
set(STEPCORE_HAVE_CUDA OFF)
if(NOT STEPCORE_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND "$ENV{CUDACXX}" STREQUAL "")
    # check_language reads CUDACXX and PATH, not CUDAToolkit_ROOT: take that toolkit's nvcc.
    foreach(root IN ITEMS "${CUDAToolkit_ROOT}" "$ENV{CUDAToolkit_ROOT}")
      if(NOT root STREQUAL "" AND EXISTS "${root}/bin/nvcc")
        set(CMAKE_CUDA_COMPILER "${root}/bin/nvcc" CACHE FILEPATH "CUDA compiler")
        break()
      endif()
    endforeach()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The kernels' architectures: the project's CMAKE_CUDA_ARCHITECTURES when it set one,
    # else sm_80/90/100. Top-level, the tests' own .cu files get the same default.
    if(DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(_stepcore_archs "${CMAKE_CUDA_ARCHITECTURES}")
    else()
      set(_stepcore_archs "80;90;100")
      if(PROJECT_IS_TOP_LEVEL)
        set(CMAKE_CUDA_ARCHITECTURES "${_stepcore_archs}")
      endif()
    endif()
    set(STEPCORE_CUDA_ARCHITECTURES "${_stepcore_archs}" CACHE STRING "CUDA architectures of stepcore's kernels")
    unset(_stepcore_archs)
    enable_language(CUDA)
    # The launch arguments take up to ~13 KB of kernel parameters (kernels/plans.hpp):
    # CUDA 12.1's large parameter space, on sm_70 and later.
    if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.1)
      message(FATAL_ERROR "stepcore's kernels need CUDA 12.1 or later (large kernel "
        "parameters); found ${CMAKE_CUDA_COMPILER_VERSION}")
    endif()
    foreach(_arch IN LISTS STEPCORE_CUDA_ARCHITECTURES)
      string(REGEX MATCH "^[0-9]+" _num "${_arch}")
      if(_num AND _num LESS 70)
        message(FATAL_ERROR "stepcore's kernels need sm_70 or later (large kernel "
          "parameters); STEPCORE_CUDA_ARCHITECTURES has ${_arch}")
      endif()
    endforeach()
    # CMake 3.25 predates nvcc's C++20 support (12.0+): teach it the flag (a variable of
    # this directory scope: stepcore's targets only).
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    if(PROJECT_IS_TOP_LEVEL)
      set(CMAKE_CUDA_STANDARD 20)  # the tests' .cu files (the library sets its own)
      set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    endif()
    # CMake 3.25.0/3.25.1 (Debian 12's stock cmake) fail in FindCUDAToolkit when the
    # toolkit has no libnvToolsExt (CUDA 13): they set a property on CUDA::nvToolsExt
    # without checking that it exists. An empty stand-in target lets them through.
    # (The package config does the same for consumers.)
    if(CMAKE_VERSION VERSION_LESS 3.25.2 AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 13.0
       AND NOT TARGET CUDA::nvToolsExt)
      add_library(CUDA::nvToolsExt INTERFACE IMPORTED)
    endif()
    find_package(CUDAToolkit REQUIRED)
    set(STEPCORE_HAVE_CUDA ON)
  elseif(STEPCORE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "STEPCORE_CUDA=ON but no CUDA compiler was found: set CMAKE_CUDA_COMPILER, "
      "CUDACXX or CUDAToolkit_ROOT, or put nvcc on PATH")
  endif()
endif()
message(STATUS "stepcore: CUDA kernels ${STEPCORE_HAVE_CUDA}")
