# `ctxpool costs` on SimDriver writes a cost table that CTXPOOL_SIM_COSTS
# loads into a replay (the path scripts/gpu-check takes on a GPU); a table
# that cannot be read fails the replay with the reason.
if(TARGET ctxpool_tool)
  set(_ctxpool_costs_check ${CMAKE_CURRENT_BINARY_DIR}/ctxpool_costs_check.cmake)
  file(WRITE ${_ctxpool_costs_check} [=[
set(table ${OUT}/ctxpool_costs_selftest.json)
file(REMOVE ${table})
execute_process(COMMAND ${TOOL} costs --reps 3 --out ${table}
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc STREQUAL "0" OR NOT EXISTS ${table})
  message(FATAL_ERROR "ctxpool costs: exit '${rc}':\n${err}")
endif()
file(READ ${table} text)
if(NOT text MATCHES "\"cuMemMap\": {\"ns\": [0-9]+")
  message(FATAL_ERROR "ctxpool costs wrote no cuMemMap row:\n${text}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env CTXPOOL_SIM_COSTS=${table}
                ${TOOL} replay workload:mixed:ops=500 --json
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "0" OR NOT out MATCHES "\"simulated_driver_ns\": [1-9]")
  message(FATAL_ERROR "replay with the table: exit '${rc}':\n${out}\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env
                CTXPOOL_SIM_COSTS=${OUT}/no-such-table.json
                ${TOOL} replay workload:mixed:ops=500
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc STREQUAL "1" OR NOT err MATCHES "cannot open")
  message(FATAL_ERROR "replay with a missing table: exit '${rc}':\n${err}")
endif()
]=])
  add_test(NAME ctxpool_costs_selftest
    COMMAND ${CMAKE_COMMAND} -DTOOL=$<TARGET_FILE:ctxpool_tool>
            -DOUT=${CMAKE_CURRENT_BINARY_DIR} -P ${_ctxpool_costs_check})
  set_tests_properties(ctxpool_costs_selftest PROPERTIES LABELS unit TIMEOUT 120)
endif()
