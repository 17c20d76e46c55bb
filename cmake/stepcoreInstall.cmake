# Install rules and the package config: find_package(stepcore CONFIG [COMPONENTS cuda
# mpi nccl]) imports stepcore::stepcore (and, with the mpi component, stepcore::mpi).
set(STEPCORE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/stepcore)

install(TARGETS stepcore EXPORT stepcoreTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT stepcoreTargets NAMESPACE stepcore:: DESTINATION ${STEPCORE_CMAKE_DIR})
if(TARGET stepcore_mpi)
  install(TARGETS stepcore_mpi EXPORT stepcoreMpiTargets
    FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT stepcoreMpiTargets NAMESPACE stepcore:: DESTINATION ${STEPCORE_CMAKE_DIR})
endif()

# What the config records: the parts that were built and the kind of library (a static
# archive's users must link its private dependencies too).
get_target_property(_stepcore_type stepcore TYPE)
if(_stepcore_type STREQUAL "SHARED_LIBRARY")
  set(STEPCORE_PACKAGE_SHARED ON)
else()
  set(STEPCORE_PACKAGE_SHARED OFF)
endif()
set(STEPCORE_PACKAGE_CUDA_VERSION "")
if(STEPCORE_HAVE_CUDA)
  set(STEPCORE_PACKAGE_CUDA_VERSION "${CUDAToolkit_VERSION}")
endif()
set(STEPCORE_PACKAGE_NCCL_HINT "")
if(STEPCORE_HAVE_NCCL AND STEPCORE_NCCL_LIBRARY)
  get_filename_component(STEPCORE_PACKAGE_NCCL_HINT "${STEPCORE_NCCL_LIBRARY}" DIRECTORY)
  get_filename_component(STEPCORE_PACKAGE_NCCL_HINT "${STEPCORE_PACKAGE_NCCL_HINT}" DIRECTORY)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/stepcoreConfig.cmake.in
  ${PROJECT_BINARY_DIR}/stepcoreConfig.cmake
  INSTALL_DESTINATION ${STEPCORE_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/stepcoreConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
set(_stepcore_config_files ${PROJECT_BINARY_DIR}/stepcoreConfig.cmake
  ${PROJECT_BINARY_DIR}/stepcoreConfigVersion.cmake)
if(STEPCORE_HAVE_NCCL)
  list(APPEND _stepcore_config_files ${PROJECT_SOURCE_DIR}/cmake/stepcoreFindNCCL.cmake)
endif()
install(FILES ${_stepcore_config_files} DESTINATION ${STEPCORE_CMAKE_DIR})
unset(_stepcore_type)
unset(_stepcore_config_files)
