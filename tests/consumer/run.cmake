# ctest Package.ConsumerAgainstInstallTree (cmake -P): installs the stepcore build at
# STEPCORE_BUILD_DIR into WORK_DIR/prefix, checks the installed header set and that no
# installed header names an internal (check_headers.cmake), then
# configures tests/consumer against that prefix in three ways:
#   plain       find_package(stepcore CONFIG REQUIRED); built, run; and every component
#               that was not built (plus an unknown one) probed: find_package fails
#   components  COMPONENTS <built> OPTIONAL_COMPONENTS <not built>; built, run
#   required    REQUIRED with a component that was not built (or an unknown one): the
#               configure must fail, naming it
# and, configured only, consumer/subproject: stepcore through add_subdirectory sets
# nothing global for its parent.
# Inputs (-D): STEPCORE_SOURCE_DIR STEPCORE_BUILD_DIR WORK_DIR CONSUMER_SOURCE_DIR
# BUILT_COMPONENTS (commas) STEPCORE_CUDA VERSION GENERATOR CXX_COMPILER CXX_FLAGS
# EXE_LINKER_FLAGS BUILD_TYPE.
cmake_minimum_required(VERSION 3.25)

string(REPLACE "," ";" built "${BUILT_COMPONENTS}")
set(not_built "")
foreach(c cuda diff mpi nccl)
  if(NOT c IN_LIST built)
    list(APPEND not_built ${c})
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
set(prefix "${WORK_DIR}/prefix")
file(REMOVE_RECURSE "${WORK_DIR}")

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (${rc}):\n${out}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run("cmake --install" ${CMAKE_COMMAND} --install "${STEPCORE_BUILD_DIR}" --prefix "${prefix}" --config "${BUILD_TYPE}")

# The installed headers: the public list, the optional ones only with their part, no
# internals.
string(REPLACE "," ";" public_headers "${PUBLIC_HEADERS}")
foreach(h ${public_headers} version)
  if(NOT EXISTS "${prefix}/include/stepcore/${h}.hpp")
    message(FATAL_ERROR "consumer test: stepcore/${h}.hpp is not installed")
  endif()
endforeach()
foreach(pair nccl:comm_nccl mpi:comm_mpi diff:diff)
  string(REPLACE ":" ";" pair "${pair}")
  list(GET pair 0 c)
  list(GET pair 1 h)
  set(have FALSE)
  if(EXISTS "${prefix}/include/stepcore/${h}.hpp")
    set(have TRUE)
  endif()
  if(c IN_LIST built AND NOT have)
    message(FATAL_ERROR "consumer test: built with ${c} but stepcore/${h}.hpp is not installed")
  elseif(NOT c IN_LIST built AND have)
    message(FATAL_ERROR "consumer test: built without ${c} but stepcore/${h}.hpp is installed")
  endif()
endforeach()
if(EXISTS "${prefix}/include/stepcore/detail")
  message(FATAL_ERROR "consumer test: stepcore/detail/ (internal) is installed")
endif()
# What the installed headers say: no internal named, only installed headers included
# (check_headers.cmake; its own ctest proves it refuses each kind of leak).
set(INCLUDE_DIR "${prefix}/include")
include("${CMAKE_CURRENT_LIST_DIR}/check_headers.cmake")

# configure_consumer(<case> <expect: ok|fail> [REQUIRED c,..] [OPTIONAL c,..] [PROBE c,..])
function(configure_consumer name expect)
  cmake_parse_arguments(ARG "" "REQUIRED;OPTIONAL;PROBE" "" ${ARGN})
  set(dir "${WORK_DIR}/${name}")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${dir}" -G "${GENERATOR}"
      "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
      "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${EXE_LINKER_FLAGS}"
      "-DCMAKE_PREFIX_PATH=${prefix}" "-DCONSUMER_PREFIX=${prefix}" "-DCONSUMER_VERSION=${VERSION}"
      "-DCONSUMER_REQUIRED=${ARG_REQUIRED}" "-DCONSUMER_OPTIONAL=${ARG_OPTIONAL}"
      "-DCONSUMER_EXPECT_FOUND=${BUILT_COMPONENTS}" "-DCONSUMER_PROBE_MISSING=${ARG_PROBE}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(expect STREQUAL "ok")
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "consumer test: configuring case '${name}' failed:\n${out}")
    endif()
    run("building case '${name}'" ${CMAKE_COMMAND} --build "${dir}" --config "${BUILD_TYPE}")
    string(REGEX MATCHALL "consumer: COMPONENTS [^\n]*" probes "${out}")
    foreach(p IN LISTS probes)
      message(STATUS "${name}: ${p}")
    endforeach()
    run("running case '${name}'" "${dir}/consumer")
    string(STRIP "${last_output}" last_output)
    message(STATUS "${name}: ${last_output}")
  else()
    if(rc EQUAL 0)
      message(FATAL_ERROR "consumer test: case '${name}' configured, but must fail:\n${out}")
    endif()
    string(REGEX REPLACE "[ \n]+" " " flat "${out}")  # CMake wraps the message
    string(REGEX MATCH "(built without|has no component) '?[a-z]+'?" why "${flat}")
    if(NOT why)
      message(FATAL_ERROR "consumer test: case '${name}' failed for another reason:\n${out}")
    endif()
    message(STATUS "${name}: fails as it must: ${why}")
  endif()
endfunction()

set(probe ${not_built} nosuch)
string(REPLACE ";" "," probe "${probe}")
configure_consumer(plain ok PROBE "${probe}")
string(REPLACE ";" "," optional "${not_built}")
configure_consumer(components ok REQUIRED "${BUILT_COMPONENTS}" OPTIONAL "${optional}")
set(missing nosuch)  # everything was built: an unknown component must fail the same way
if(not_built)
  list(GET not_built 0 missing)
endif()
configure_consumer(required-${missing} fail REQUIRED "${missing}")

run("configuring stepcore as a subproject" ${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}/subproject"
  -B "${WORK_DIR}/subproject" -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
  "-DSTEPCORE_SOURCE_DIR=${STEPCORE_SOURCE_DIR}" "-DSTEPCORE_CUDA=${STEPCORE_CUDA}")
string(REGEX MATCH "parent: [^\n]*" said "${last_output}")
message(STATUS "subproject: ${said}")
