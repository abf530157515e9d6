# Wiring for the PyTorch plugin's tests (plugins/torch):
#   * torch_plugin_test (tests/torch_plugin_test.cc),
#     torch_plugin_attack_test (the C ABI's fast paths attacked) and
#     record_times_attack_test (CTXPOOL_SESSION_TIMES in the plugin, among
#     its other cases) dlopen the built libctxpool_torch.so, whose path they
#     get as a compile definition;
#   * torch_plugin_python runs the Python wrapper's unittest suite
#     (plugins/torch/tests) on the simulated driver; it needs no torch;
#   * torch_pip_install (label slow) pip-installs plugins/torch/python into
#     a fresh venv and imports it from outside the checkout.
foreach(_t torch_plugin_test torch_plugin_attack_test record_times_attack_test)
  if(NOT TARGET ${_t})
    continue()
  endif()
  target_link_libraries(${_t} PRIVATE ${CMAKE_DL_LIBS})
  if(TARGET ctxpool_torch)
    add_dependencies(${_t} ctxpool_torch)
    target_compile_definitions(${_t} PRIVATE
      CTXPOOL_TORCH_PLUGIN_PATH="$<TARGET_FILE:ctxpool_torch>")
  else()
    # CTXPOOL_BUILD_TORCH_PLUGIN=OFF: the test skips.
    target_compile_definitions(${_t} PRIVATE CTXPOOL_TORCH_PLUGIN_PATH="")
  endif()
  set_property(TEST ${_t} APPEND PROPERTY
    ENVIRONMENT "CTXPOOL_DRIVER=sim:2xa10-24gb")
endforeach()

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

  # torch_pip_install (tests/torch_pip_install_test.py): `pip install
  # --no-build-isolation --no-index plugins/torch/python` into a fresh venv,
  # then `import ctxpool_torch` from outside the checkout finds the library
  # inside the venv. pip's build compiles the library (minutes the first
  # time; its CMake tree under torch_pip_install/build is reused), with this
  # build's compilers and launcher. Skips without python3's venv/ensurepip.
  set(_ctxpool_pip_args
    --source ${PROJECT_SOURCE_DIR}
    --work ${CMAKE_CURRENT_BINARY_DIR}/torch_pip_install
    --version ${PROJECT_VERSION}
    --cmake-arg=-DCMAKE_C_COMPILER=${CMAKE_C_COMPILER}
    --cmake-arg=-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER})
  if(CMAKE_CXX_COMPILER_LAUNCHER)
    list(APPEND _ctxpool_pip_args
      --cmake-arg=-DCMAKE_C_COMPILER_LAUNCHER=${CMAKE_C_COMPILER_LAUNCHER}
      --cmake-arg=-DCMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER})
  endif()
  add_test(NAME torch_pip_install
    COMMAND ${Python3_EXECUTABLE}
            ${CMAKE_CURRENT_SOURCE_DIR}/torch_pip_install_test.py
            ${_ctxpool_pip_args})
  set_tests_properties(torch_pip_install PROPERTIES
    LABELS "slow;python" TIMEOUT 1500 RUN_SERIAL ON SKIP_RETURN_CODE 77)
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

# host_oom_plugin_test compiles the plugin's source in (not the .so), so
# that its simulated driver is the test's and the host-memory countdown of
# tests/heap_counter.h skips the driver's own allocations.
if(TARGET host_oom_plugin_test AND TARGET ctxpool_torch)
  target_sources(host_oom_plugin_test PRIVATE
    ${PROJECT_SOURCE_DIR}/plugins/torch/ctxpool_torch.cc)
  target_include_directories(host_oom_plugin_test PRIVATE
    ${PROJECT_SOURCE_DIR}/plugins/torch)
  target_compile_definitions(host_oom_plugin_test PRIVATE
    CTXPOOL_PLUGIN_LINKED=1)
  set_property(TEST host_oom_plugin_test APPEND PROPERTY
    ENVIRONMENT "CTXPOOL_DRIVER=sim:2xa10-24gb")
endif()
