# install_and_find_package: proves that `cmake --install` plus
# find_package(ctxpool) works for a user. The test installs this build tree
# into a scratch prefix, checks the files a user needs are there, then
# configures, builds and runs examples/hello_ctxpool against the installed
# package only (no build tree, no package registry).
#
# This file has two roles: included by tests/CMakeLists.txt it registers the
# test; run with `cmake -P` (by ctest) it is the test.

if(NOT CMAKE_SCRIPT_MODE_FILE)
  # Sanitizer builds make an instrumented libctxpool that a plain user build
  # cannot link; the plain build covers installation.
  if(CTXPOOL_SANITIZE)
    return()
  endif()
  set(_ctxpool_install_args
    -DCTXPOOL_BUILD_DIR=${PROJECT_BINARY_DIR}
    -DCTXPOOL_WORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/install_and_find_package
    -DCTXPOOL_EXAMPLE_DIR=${PROJECT_SOURCE_DIR}/examples/hello_ctxpool
    -DCTXPOOL_GENERATOR=${CMAKE_GENERATOR}
    -DCTXPOOL_CXX_COMPILER=${CMAKE_CXX_COMPILER}
    -DCTXPOOL_CXX_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}
    -DCTXPOOL_CONFIG=$<CONFIG>
    -DCTXPOOL_EXPECT_TOOL=$<TARGET_EXISTS:ctxpool_tool>)
  add_test(NAME install_and_find_package
    COMMAND ${CMAKE_COMMAND} ${_ctxpool_install_args}
            -P ${CMAKE_CURRENT_LIST_FILE})
  set_tests_properties(install_and_find_package PROPERTIES
    LABELS "unit" TIMEOUT 600 RUN_SERIAL ON)
  return()
endif()

# ---- script mode: the test itself -------------------------------------------
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install_and_find_package: ${what} failed (${rc}):\n"
                        "${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix "${CTXPOOL_WORK_DIR}/prefix")
set(app_build "${CTXPOOL_WORK_DIR}/hello_build")
file(REMOVE_RECURSE "${CTXPOOL_WORK_DIR}")
file(MAKE_DIRECTORY "${CTXPOOL_WORK_DIR}")

set(config_args "")
if(CTXPOOL_CONFIG)
  set(config_args --config "${CTXPOOL_CONFIG}")
endif()
run_step("cmake --install"
  "${CMAKE_COMMAND}" --install "${CTXPOOL_BUILD_DIR}" --prefix "${prefix}"
  ${config_args})

# What a user needs.
set(missing "")
foreach(pattern
    "include/ctxpool/status.h"
    "include/ctxpool/driver/driver.h"
    "include/ctxpool/driver/sim_driver.h"
    "lib*/libctxpool.*"
    "lib*/cmake/ctxpool/ctxpoolConfig.cmake"
    "lib*/cmake/ctxpool/ctxpoolConfigVersion.cmake"
    "lib*/cmake/ctxpool/ctxpoolTargets.cmake")
  file(GLOB_RECURSE found "${prefix}/${pattern}")
  if(NOT found)
    list(APPEND missing "${pattern}")
  endif()
endforeach()
if(CTXPOOL_EXPECT_TOOL AND NOT EXISTS "${prefix}/bin/ctxpool")
  list(APPEND missing "bin/ctxpool")
endif()
if(missing)
  message(FATAL_ERROR "install_and_find_package: not installed: ${missing}")
endif()

# A user's project, configured against the prefix only.
set(configure_args
  -S "${CTXPOOL_EXAMPLE_DIR}" -B "${app_build}" -G "${CTXPOOL_GENERATOR}"
  "-DCMAKE_PREFIX_PATH=${prefix}"
  "-DCMAKE_CXX_COMPILER=${CTXPOOL_CXX_COMPILER}"
  -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(CTXPOOL_CXX_LAUNCHER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CTXPOOL_CXX_LAUNCHER}")
endif()
run_step("configuring examples/hello_ctxpool" "${CMAKE_COMMAND}" ${configure_args})

file(STRINGS "${app_build}/CMakeCache.txt" ctxpool_dir REGEX "^ctxpool_DIR:")
string(FIND "${ctxpool_dir}" "${prefix}/" at)
if(NOT at GREATER -1)
  message(FATAL_ERROR "install_and_find_package: find_package(ctxpool) did "
                      "not use the installed package: ${ctxpool_dir}")
endif()

run_step("building examples/hello_ctxpool" "${CMAKE_COMMAND}" --build "${app_build}")
run_step("running hello_ctxpool" "${app_build}/hello_ctxpool")
if(NOT step_output MATCHES "^hello_ctxpool: ")
  message(FATAL_ERROR "install_and_find_package: unexpected output: ${step_output}")
endif()
message(STATUS "install_and_find_package: ${step_output}")
