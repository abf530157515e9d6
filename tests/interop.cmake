# tests/interop/interop_cuda_mr_test.cc needs CCCL's headers (cuda/memory_resource)
# and cuda_runtime_api.h, found with the CUDA toolkit; it links nothing of
# CUDA's and runs on SimDriver. buffer.h and cub.h need no CUDA header: their
# tests are ordinary unit tests (tests/interop_*_test.cc).
if(CTXPOOL_CUDA_ENABLED AND CTXPOOL_CCCL_INCLUDE_DIR)
  ctxpool_add_test(${CMAKE_CURRENT_SOURCE_DIR}/interop/interop_cuda_mr_test.cc "unit")
  # CCCL before the toolkit root: CUDA 13 keeps cuda/ under include/cccl.
  target_include_directories(interop_cuda_mr_test SYSTEM PRIVATE
    ${CTXPOOL_CCCL_INCLUDE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
else()
  message(STATUS "ctxpool: interop_cuda_mr_test off (no CUDA toolkit with CCCL)")
endif()
