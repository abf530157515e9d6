# `ctxpool demo --json --out <tmp>.svg` runs end to end (both modes on the
# simulated device): it must exit 0, print one row per mode and write the
# SVG memory map.
if(TARGET ctxpool_tool)
  set(_ctxpool_demo_check ${CMAKE_CURRENT_BINARY_DIR}/ctxpool_demo_check.cmake)
  file(WRITE ${_ctxpool_demo_check} [=[
file(REMOVE ${SVG})
execute_process(COMMAND ${CMAKE_COMMAND} -E env CTXPOOL_DRIVER=sim:h100-80gb
                        ${TOOL} demo --json --out ${SVG}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ctxpool demo exited with ${rc}:\n${out}\n${err}")
endif()
if(NOT out MATCHES "\"modes\":\\[{\"mode\":\"today\".*{\"mode\":\"ctxpool\"")
  message(FATAL_ERROR "ctxpool demo --json printed no today/ctxpool rows:\n${out}")
endif()
file(READ ${SVG} svg LIMIT 200)
if(NOT svg MATCHES "<svg ")
  message(FATAL_ERROR "ctxpool demo wrote no SVG to ${SVG}")
endif()
message(STATUS "${out}")
]=])
  add_test(NAME ctxpool_demo
    COMMAND ${CMAKE_COMMAND} -DTOOL=$<TARGET_FILE:ctxpool_tool>
            -DSVG=${CMAKE_CURRENT_BINARY_DIR}/ctxpool_demo_test.svg
            -P ${_ctxpool_demo_check})
  set_tests_properties(ctxpool_demo PROPERTIES LABELS unit TIMEOUT 300)
endif()
