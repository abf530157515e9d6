# Wiring for the PyTorch plugin's tests (plugins/torch):
#   * torch_plugin_test (tests/torch_plugin_test.cc) dlopens the built
#     libctxpool_torch.so, whose path it gets as a compile definition;
#   * torch_plugin_python runs the Python wrapper's unittest suite
#     (plugins/torch/tests) on the simulated driver; it needs no torch.
if(TARGET torch_plugin_test)
  target_link_libraries(torch_plugin_test PRIVATE ${CMAKE_DL_LIBS})
  if(TARGET ctxpool_torch)
    add_dependencies(torch_plugin_test ctxpool_torch)
    target_compile_definitions(torch_plugin_test PRIVATE
      CTXPOOL_TORCH_PLUGIN_PATH="$<TARGET_FILE:ctxpool_torch>")
  else()
    # CTXPOOL_BUILD_TORCH_PLUGIN=OFF: the test skips.
    target_compile_definitions(torch_plugin_test PRIVATE
      CTXPOOL_TORCH_PLUGIN_PATH="")
  endif()
  set_property(TEST torch_plugin_test APPEND PROPERTY
    ENVIRONMENT "CTXPOOL_DRIVER=sim:2xa10-24gb")
endif()

# A sanitizer-instrumented .so cannot be loaded into an uninstrumented
# python3; the C++ test above covers the library in those builds.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(TARGET ctxpool_torch AND Python3_Interpreter_FOUND AND NOT CTXPOOL_SANITIZE)
  add_test(NAME torch_plugin_python
    COMMAND ${Python3_EXECUTABLE} -m unittest discover
            -s ${PROJECT_SOURCE_DIR}/plugins/torch/tests -p "test_*.py" -v)
  set_tests_properties(torch_plugin_python PROPERTIES
    LABELS "unit" TIMEOUT 300
    ENVIRONMENT "CTXPOOL_TORCH_LIB=$<TARGET_FILE:ctxpool_torch>;CTXPOOL_DRIVER=sim:2xa10-24gb;PYTHONPATH=${PROJECT_SOURCE_DIR}/plugins/torch/python;PYTHONDONTWRITEBYTECODE=1")
endif()

# ctxpool_torch_allocator.h (the libtorch header), compiled against the
# stand-in PyTorch API in plugins/torch/tests/fake_torch, once per spelling
# of the allocation hook's device parameter (int, c10::DeviceIndex). The
# real thing is compiled whenever CMake finds Torch (plugins/torch).
if(TARGET ctxpool_torch)
  foreach(variant int device_index)
    set(name torch_allocator_header_${variant}_test)
    add_executable(${name}
      ${PROJECT_SOURCE_DIR}/plugins/torch/tests/torch_allocator_header_test.cc)
    target_include_directories(${name} PRIVATE
      ${PROJECT_SOURCE_DIR}/plugins/torch/tests/fake_torch)
    # ctxpool::ctxpool only for the TSan build: libctxpool_torch.so's Abseil
    # calls are wrapped (cmake/CtxpoolWarnings.cmake) and the wrappers live in
    # libctxpool, which every ctxpool program links.
    target_link_libraries(${name} PRIVATE
      ctxpool_torch ctxpool::ctxpool GTest::gtest GTest::gtest_main
      ctxpool_warnings)
    if(variant STREQUAL "device_index")
      target_compile_definitions(${name} PRIVATE
        CTXPOOL_FAKE_TORCH_DEVICE_INDEX_HOOK)
    endif()
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES LABELS "unit" TIMEOUT 300
      ENVIRONMENT "CTXPOOL_DRIVER=sim:2xa10-24gb")
  endforeach()
endif()
