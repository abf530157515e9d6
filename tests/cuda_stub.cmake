# Wiring for tests/cuda_driver_test.cc.
#
# It learns whether the CUDA driver is compiled in (to check CompiledIn()) and,
# when it is, gets a fake libcuda (tests/cuda_stub/cuda_stub.c) that
# CudaDriver::Load() can dlopen, so the loading and error paths are tested
# without a GPU. The stub is built next to the test executable, which finds it
# there, so the build tree may move.
if(TARGET cuda_driver_test)
  if(CTXPOOL_CUDA_ENABLED)
    add_library(ctxpool_cuda_stub SHARED
                ${CMAKE_CURRENT_SOURCE_DIR}/cuda_stub/cuda_stub.c)
    set_target_properties(ctxpool_cuda_stub PROPERTIES
      OUTPUT_NAME ctxpool_cuda_stub C_STANDARD 11 C_VISIBILITY_PRESET default)
    add_dependencies(cuda_driver_test ctxpool_cuda_stub)
    target_compile_definitions(cuda_driver_test PRIVATE
      CTXPOOL_TEST_CUDA_COMPILED_IN=1
      CTXPOOL_CUDA_STUB_NAME="$<TARGET_FILE_NAME:ctxpool_cuda_stub>")
    target_link_libraries(cuda_driver_test PRIVATE ${CMAKE_DL_LIBS})
  else()
    target_compile_definitions(cuda_driver_test PRIVATE
      CTXPOOL_TEST_CUDA_COMPILED_IN=0)
  endif()
endif()
