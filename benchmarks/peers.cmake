# The CUB peer: cub::CachingDeviceAllocator compiled with the host compiler,
# its cuda* calls served by a small CUDA-runtime shim over a ctxpool Driver
# (SimDriver on the CPU). It needs headers only (CUB from CCCL and
# cuda_runtime_api.h), not a GPU, libcuda or libcudart, so it is gated on
# finding those headers, not on CTXPOOL_CUDA_ENABLED.
#
# The shim defines cudaMalloc & co. itself: ctxpool_cub_peer is a static
# library linked only into benchmark executables, which never link cudart.
find_path(CTXPOOL_CUDART_INCLUDE_DIR cuda_runtime_api.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{CUDA_HOME}/include
        $ENV{CUDA_PATH}/include /usr/local/cuda/include)
find_path(CTXPOOL_CCCL_INCLUDE_DIR cub/util_allocator.cuh
  HINTS ${CTXPOOL_CUDART_INCLUDE_DIR}/cccl ${CTXPOOL_CUDART_INCLUDE_DIR}
        /usr/local/cuda/include/cccl)

if(CTXPOOL_CUDART_INCLUDE_DIR AND CTXPOOL_CCCL_INCLUDE_DIR)
  set(CTXPOOL_HAVE_CUB_PEER ON)
  message(STATUS "ctxpool: CUB peer on (CUB in ${CTXPOOL_CCCL_INCLUDE_DIR})")
  add_library(ctxpool_cub_peer STATIC
    ${CMAKE_CURRENT_SOURCE_DIR}/peers/cuda_runtime_shim.cc
    ${CMAKE_CURRENT_SOURCE_DIR}/peers/cub_peer.cc)
  # CCCL before the toolkit root: CUDA 13 keeps cub/ and cuda/std under cccl.
  target_include_directories(ctxpool_cub_peer SYSTEM PRIVATE
    ${CTXPOOL_CCCL_INCLUDE_DIR} ${CTXPOOL_CUDART_INCLUDE_DIR})
  target_include_directories(ctxpool_cub_peer PUBLIC
    ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(ctxpool_cub_peer
    PUBLIC ctxpool::ctxpool PRIVATE ctxpool_warnings)
else()
  set(CTXPOOL_HAVE_CUB_PEER OFF)
  message(STATUS "ctxpool: CUB peer off (cub/util_allocator.cuh or "
                 "cuda_runtime_api.h not found); benchmarks run ctxpool only")
endif()

if(TARGET ctxpool_bench_hotpath)
  # The plugin rows dlopen the plugin built here (--plugin=PATH overrides).
  target_link_libraries(ctxpool_bench_hotpath PRIVATE ${CMAKE_DL_LIBS})
  if(TARGET ctxpool_torch)
    add_dependencies(ctxpool_bench_hotpath ctxpool_torch)
    target_compile_definitions(ctxpool_bench_hotpath PRIVATE
      CTXPOOL_TORCH_PLUGIN_PATH="$<TARGET_FILE:ctxpool_torch>")
  endif()
  if(CTXPOOL_HAVE_CUB_PEER)
    target_link_libraries(ctxpool_bench_hotpath PRIVATE ctxpool_cub_peer)
    target_compile_definitions(ctxpool_bench_hotpath PRIVATE
      CTXPOOL_HAVE_CUB_PEER=1)
  endif()
  if(CTXPOOL_BUILD_TESTS)
    # Proves in CI that the benchmark (and the CUB peer, when built) runs:
    # the executable exits non-zero on any error or simulated-driver misuse.
    if(CTXPOOL_HAVE_CUB_PEER)
      set(_ctxpool_smoke_name cub_peer_smoke)
    else()
      set(_ctxpool_smoke_name hotpath_smoke)
    endif()
    add_test(NAME ${_ctxpool_smoke_name}
      COMMAND ctxpool_bench_hotpath --smoke
              "--benchmark_filter=BM_Hotpath/.*/mix:(4KiB|mixed_512B_8MiB)/"
              --benchmark_min_time=0.01 --paired_rounds=2)
    set_tests_properties(${_ctxpool_smoke_name} PROPERTIES
      LABELS unit TIMEOUT 300)
  endif()
endif()

if(TARGET ctxpool_bench_fragmentation AND CTXPOOL_HAVE_CUB_PEER)
  target_link_libraries(ctxpool_bench_fragmentation PRIVATE ctxpool_cub_peer)
  target_compile_definitions(ctxpool_bench_fragmentation PRIVATE
    CTXPOOL_HAVE_CUB_PEER=1)
endif()
if(TARGET ctxpool_bench_fragmentation AND CTXPOOL_BUILD_TESTS)
  # Small generated workloads on every implementation; exits non-zero on a
  # replay error or simulated-driver misuse.
  add_test(NAME fragmentation_smoke
    COMMAND ctxpool_bench_fragmentation --quick
            "--benchmark_filter=BM_Fragmentation/.*/(churn|mixed)/")
  set_tests_properties(fragmentation_smoke PROPERTIES LABELS unit TIMEOUT 300)
endif()
