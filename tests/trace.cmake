# tools/torch_snapshot_to_trace.py: converts PyTorch memory snapshots (the
# two real ones in $CTXPOOL_TRACES_DIR when present, and a synthetic one) and
# checks that `ctxpool replay` and `ctxpool report` read the output.
find_program(CTXPOOL_PYTHON3 python3)
# Default: ../shared/traces beside the checkout (the project's shared data).
get_filename_component(_ctxpool_default_traces
                       "${PROJECT_SOURCE_DIR}/../shared/traces" ABSOLUTE)
set(CTXPOOL_TRACES_DIR "${_ctxpool_default_traces}" CACHE PATH
    "Directory of real allocation traces and snapshots used by tests")
if(CTXPOOL_PYTHON3)
  set(_ctxpool_tool_arg)
  if(TARGET ctxpool_tool)
    set(_ctxpool_tool_arg --ctxpool $<TARGET_FILE:ctxpool_tool>)
  endif()
  add_test(NAME torch_snapshot_to_trace
           COMMAND ${CTXPOOL_PYTHON3}
                   ${CMAKE_CURRENT_SOURCE_DIR}/torch_snapshot_to_trace_test.py
                   ${_ctxpool_tool_arg} --traces ${CTXPOOL_TRACES_DIR})
  set_tests_properties(torch_snapshot_to_trace PROPERTIES LABELS unit
                       TIMEOUT 300)
endif()
