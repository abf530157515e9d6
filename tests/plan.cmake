# `ctxpool plan` checked by replaying what it claims (tests/plan_check.py):
#   ctxpool_plan          bad input, generated workloads in both schedules,
#                         the JSON and the SVG (every build, sanitizers too)
#   ctxpool_plan_traces   the real traces in ../shared/traces on h100-80gb
#                         and a10-24gb: each --max-replicas count fits and one
#                         more does not, today's way fits fewer, suggested
#                         budgets fit and are tight (unsanitized builds; skips
#                         without the traces)
find_program(CTXPOOL_PLAN_PYTHON3 NAMES python3)
if(NOT TARGET ctxpool_tool OR NOT CTXPOOL_PLAN_PYTHON3)
  return()
endif()
add_test(NAME ctxpool_plan
  COMMAND ${CTXPOOL_PLAN_PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/plan_check.py
          --tool $<TARGET_FILE:ctxpool_tool> quick)
set_tests_properties(ctxpool_plan PROPERTIES LABELS unit TIMEOUT 300)
if(NOT CTXPOOL_SANITIZE)
  add_test(NAME ctxpool_plan_traces
    COMMAND ${CTXPOOL_PLAN_PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/plan_check.py
            --tool $<TARGET_FILE:ctxpool_tool> traces
            ${PROJECT_SOURCE_DIR}/../shared/traces)
  set_tests_properties(ctxpool_plan_traces PROPERTIES
    LABELS "unit;slow" TIMEOUT 600 SKIP_RETURN_CODE 77)
endif()
