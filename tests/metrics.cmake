# The Prometheus expositions checked by real text-format parsers
# (tests/prometheus_check.py): examples/multi_model_server's metrics (plain
# and a rich run: two devices, a leak, scheduling flags, a fake cgroup whose
# path needs escaping) and tests/prometheus_exposition_test.cc's dump (open
# sessions, model names that need escaping).
#   prometheus_promtool       `promtool check metrics`: no error, no lint
#   prometheus_python_parser  prometheus_client's parser: every sample, the
#                             declared types, the escaped labels
# Each skips (exit 77) when its parser is not installed; scripts/setup
# --tests installs both (Debian packages prometheus, python3-prometheus-client).
#
# Debian's prometheus_client lives in /usr/bin/python3's dist-packages, which
# another python3 first on PATH (pyenv, a venv) may not see: prefer it.
find_program(CTXPOOL_METRICS_PYTHON3 NAMES python3 PATHS /usr/bin
             NO_DEFAULT_PATH)
if(NOT CTXPOOL_METRICS_PYTHON3)
  find_program(CTXPOOL_METRICS_PYTHON3 NAMES python3)
endif()
if(NOT CTXPOOL_METRICS_PYTHON3 OR NOT TARGET prometheus_exposition_test)
  message(STATUS "ctxpool: prometheus_promtool/prometheus_python_parser off "
                 "(no python3)")
  return()
endif()

set(_ctxpool_metrics_args
  --exposition-test=$<TARGET_FILE:prometheus_exposition_test>)
# examples/ is added after tests/: name the target, do not test for it.
if(CTXPOOL_BUILD_EXAMPLES AND
   EXISTS ${PROJECT_SOURCE_DIR}/examples/multi_model_server/CMakeLists.txt)
  list(APPEND _ctxpool_metrics_args
    --multi-model-server=$<TARGET_FILE:multi_model_server>)
endif()
foreach(_ctxpool_parser promtool python)
  if(_ctxpool_parser STREQUAL "python")
    set(_ctxpool_test prometheus_python_parser)
  else()
    set(_ctxpool_test prometheus_promtool)
  endif()
  add_test(NAME ${_ctxpool_test}
    COMMAND ${CTXPOOL_METRICS_PYTHON3}
            ${CMAKE_CURRENT_SOURCE_DIR}/prometheus_check.py
            --parser=${_ctxpool_parser}
            --work=${CMAKE_CURRENT_BINARY_DIR}/${_ctxpool_test}
            ${_ctxpool_metrics_args})
  set_tests_properties(${_ctxpool_test} PROPERTIES
    LABELS metrics TIMEOUT 120 SKIP_RETURN_CODE 77
    ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endforeach()
