# Finds ctxpool's dependencies. Everything but Abseil is optional.
if(CTXPOOL_STATIC_DEPS)
  # Prefer the static archives of Debian's libabsl-dev (self-contained trees).
  set(_ctxpool_saved_suffixes ${CMAKE_FIND_LIBRARY_SUFFIXES})
  set(CMAKE_FIND_LIBRARY_SUFFIXES .a)
endif()
find_package(absl CONFIG REQUIRED)
if(CTXPOOL_STATIC_DEPS)
  set(CMAKE_FIND_LIBRARY_SUFFIXES ${_ctxpool_saved_suffixes})
  # abslConfig's imported targets name the .so files whatever the suffixes
  # say: point each at its static archive (libabsl_x.so.N -> libabsl_x.a).
  get_directory_property(_ctxpool_targets IMPORTED_TARGETS)
  foreach(_t ${_ctxpool_targets})
    if(NOT _t MATCHES "^absl::")
      continue()
    endif()
    foreach(_prop IMPORTED_LOCATION IMPORTED_LOCATION_NONE
                  IMPORTED_LOCATION_RELEASE IMPORTED_LOCATION_RELWITHDEBINFO)
      get_target_property(_loc ${_t} ${_prop})
      if(_loc AND _loc MATCHES "\\.so")
        string(REGEX REPLACE "\\.so.*$" ".a" _static "${_loc}")
        if(EXISTS "${_static}")
          set_target_properties(${_t} PROPERTIES ${_prop} "${_static}")
        endif()
      endif()
    endforeach()
  endforeach()
endif()
find_package(Threads REQUIRED)

set(CTXPOOL_CUDA_ENABLED OFF)
if(NOT CTXPOOL_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(CTXPOOL_CUDA_ENABLED ON)
    # CUDA 13 keeps CCCL (CUB, Thrust, libcu++) under include/cccl.
    find_path(CTXPOOL_CCCL_INCLUDE_DIR cub/util_allocator.cuh
      HINTS ${CUDAToolkit_INCLUDE_DIRS}/cccl ${CUDAToolkit_INCLUDE_DIRS}
            ${CUDAToolkit_LIBRARY_ROOT}/include/cccl)
  elseif(CTXPOOL_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "CTXPOOL_WITH_CUDA=ON but the CUDA toolkit was not found")
  endif()
endif()

if(CTXPOOL_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(CTXPOOL_BUILD_BENCHMARKS)
  find_package(benchmark QUIET)
  if(NOT benchmark_FOUND)
    message(STATUS "ctxpool: Google Benchmark not found, benchmarks off")
    set(CTXPOOL_BUILD_BENCHMARKS OFF)
  endif()
endif()
