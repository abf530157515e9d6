# The ctxpool tool on bad input: a directory or a missing file as the trace,
# an empty --device, a bad size. Each must exit with 1 (bad data) or 2 (bad
# usage) and one line on stderr naming the problem; never abort (exit 134)
# or print a C++ exception.
if(TARGET ctxpool_tool)
  set(_ctxpool_bad_input_check
      ${CMAKE_CURRENT_BINARY_DIR}/ctxpool_bad_input_check.cmake)
  file(WRITE ${_ctxpool_bad_input_check} [=[
function(expect_fail want_rc want_text)
  execute_process(COMMAND ${TOOL} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "${want_rc}")
    message(FATAL_ERROR "ctxpool ${ARGN}: exit '${rc}', want ${want_rc}:\n${out}\n${err}")
  endif()
  if(NOT err MATCHES "${want_text}")
    message(FATAL_ERROR "ctxpool ${ARGN}: stderr lacks '${want_text}':\n${err}")
  endif()
  if(err MATCHES "terminate called|what\\(\\)|exception")
    message(FATAL_ERROR "ctxpool ${ARGN}: an exception escaped:\n${err}")
  endif()
  message(STATUS "ctxpool ${ARGN}: exit ${rc}: ${err}")
endfunction()
expect_fail(1 "is a directory" replay ${DIR})
expect_fail(1 "is a directory" report ${DIR})
expect_fail(1 "cannot open" replay ${DIR}/no-such-trace.csv)
expect_fail(1 "cannot open" report ${DIR}/no-such-trace.csv)
# An empty argument does not survive ARGN: run that one directly.
execute_process(COMMAND ${TOOL} replay workload:mixed --device ""
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc STREQUAL "2" OR NOT err MATCHES "--device needs a preset name")
  message(FATAL_ERROR "ctxpool replay --device '': exit '${rc}':\n${err}")
endif()
expect_fail(2 "bad --capacity" replay workload:mixed --capacity banana)
expect_fail(2 "--repeat needs a number in \\[1, 100\\]" replay workload:mixed --repeat 0)
expect_fail(2 "--repeat needs a number in \\[1, 100\\]" replay workload:mixed --repeat many)
]=])
  add_test(NAME ctxpool_tool_bad_input
    COMMAND ${CMAKE_COMMAND} -DTOOL=$<TARGET_FILE:ctxpool_tool>
            -DDIR=${CMAKE_CURRENT_SOURCE_DIR}/data
            -P ${_ctxpool_bad_input_check})
  set_tests_properties(ctxpool_tool_bad_input PROPERTIES LABELS unit TIMEOUT 120)
endif()
