# Warnings, sanitizers and clang's thread-safety analysis for ctxpool targets.
#
# ctxpool_warnings is an INTERFACE target that every ctxpool target links
# (privately, build tree only): -Wall -Wextra, and with clang -Wthread-safety,
# so every ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED contract is checked.
# CTXPOOL_WERROR=ON turns all of them into errors (the CI's clang build).
#
# CTXPOOL_SANITIZE=address,undefined or =thread instruments everything built
# in this tree. Abseil from the distribution is not instrumented; for TSan
# cmake/sanitizers/tsan_absl_annotations.cc annotates absl::Mutex & co so
# TSan sees their happens-before edges (see that file).
add_library(ctxpool_warnings INTERFACE)
target_compile_options(ctxpool_warnings INTERFACE
  -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  target_compile_options(ctxpool_warnings INTERFACE
    -Wthread-safety -Wthread-safety-beta -Wno-thread-safety-negative)
endif()
if(CTXPOOL_WERROR)
  target_compile_options(ctxpool_warnings INTERFACE -Werror)
endif()

if(CTXPOOL_SANITIZE)
  if(NOT CTXPOOL_SANITIZE MATCHES "^(address|undefined|thread|leak)(,(address|undefined|thread|leak))*$")
    message(FATAL_ERROR "CTXPOOL_SANITIZE='${CTXPOOL_SANITIZE}': expected "
                        "'address,undefined' or 'thread'")
  endif()
  add_compile_options(-fsanitize=${CTXPOOL_SANITIZE} -fno-omit-frame-pointer
                      -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${CTXPOOL_SANITIZE})
endif()

# CTXPOOL_FUZZ=ON: coverage for libFuzzer in everything built (the fuzz
# targets themselves link -fsanitize=fuzzer, see fuzz/CMakeLists.txt).
if(CTXPOOL_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "CTXPOOL_FUZZ=ON needs clang (libFuzzer)")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()

option(CTXPOOL_TSAN_ANNOTATE_ABSL
  "With CTXPOOL_SANITIZE=thread, annotate an uninstrumented Abseil's Mutex"
  ON)
if(CTXPOOL_SANITIZE MATCHES "thread" AND CTXPOOL_TSAN_ANNOTATE_ABSL)
  # The mangled names carry Abseil's inline namespace (Debian: "debian3").
  find_path(CTXPOOL_ABSL_OPTIONS_DIR absl/base/options.h)
  set(_ctxpool_absl_ns "")
  if(CTXPOOL_ABSL_OPTIONS_DIR)
    file(STRINGS "${CTXPOOL_ABSL_OPTIONS_DIR}/absl/base/options.h" _ns_line
         REGEX "^#define ABSL_OPTION_INLINE_NAMESPACE_NAME ")
    string(REGEX REPLACE "^#define ABSL_OPTION_INLINE_NAMESPACE_NAME +([A-Za-z0-9_]+).*$"
           "\\1" _ctxpool_absl_ns "${_ns_line}")
  endif()
  if(_ctxpool_absl_ns STREQUAL "")
    message(WARNING "ctxpool: Abseil's inline namespace not found; TSan will "
                    "report false races on absl::Mutex")
  else()
    string(LENGTH "${_ctxpool_absl_ns}" _ns_len)
    set(_ns "${_ns_len}${_ctxpool_absl_ns}")
    # Keep in sync with cmake/sanitizers/tsan_absl_annotations.cc: a symbol
    # wrapped here but not defined there is a link error.
    set(_ctxpool_absl_wrapped
      "N|5Mutex4LockEv"
      "N|5Mutex10ReaderLockEv"
      "N|5Mutex7TryLockEv"
      "N|5Mutex13ReaderTryLockEv"
      "N|5Mutex6UnlockEv"
      "N|5Mutex12ReaderUnlockEv"
      "N|5Mutex8LockWhenERKNS0_9ConditionE"
      "N|5Mutex14ReaderLockWhenERKNS0_9ConditionE"
      "N|5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"
      "N|5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"
      "N|5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"
      "N|5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"
      "N|5Mutex5AwaitERKNS0_9ConditionE"
      "N|5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE"
      "N|5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE"
      "N|5MutexD1Ev"
      "N|5MutexD2Ev"
      "N|19ReleasableMutexLock7ReleaseEv"
      "N|7CondVar4WaitEPNS0_5MutexE"
      "N|7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE"
      "N|7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE"
      "N|12Notification6NotifyEv"
      "NK|12Notification19WaitForNotificationEv"
      "NK|12Notification30WaitForNotificationWithTimeoutENS0_8DurationE"
      "NK|12Notification31WaitForNotificationWithDeadlineENS0_4TimeE"
      "N|15BlockingCounter14DecrementCountEv"
      "N|15BlockingCounter4WaitEv"
      "N|7Barrier5BlockEv")
    foreach(entry ${_ctxpool_absl_wrapped})
      string(REPLACE "|" ";" parts "${entry}")
      list(GET parts 0 _n)
      list(GET parts 1 _rest)
      add_link_options("LINKER:--wrap=_Z${_n}4absl${_ns}${_rest}")
    endforeach()
    # The wrappers live in libctxpool (every ctxpool program links it).
    # --undefined pulls them in even when a program itself never locks: ld
    # also applies --wrap to the undefined symbols of libabsl's own .so files
    # (e.g. libabsl_cordz_info calls Mutex::Unlock) and wants them defined.
    # Deferred because src/ defines the target after this file is included.
    add_link_options("$<$<STREQUAL:$<TARGET_PROPERTY:TYPE>,EXECUTABLE>:-Wl,--undefined=ctxpool_tsan_absl_annotations_linked>")
    set(CTXPOOL_TSAN_ABSL_SOURCE
        "${CMAKE_CURRENT_LIST_DIR}/sanitizers/tsan_absl_annotations.cc")
    set(CTXPOOL_TSAN_ABSL_NS_MANGLED "${_ns}")
    function(_ctxpool_add_tsan_absl_annotations)
      target_sources(ctxpool PRIVATE "${CTXPOOL_TSAN_ABSL_SOURCE}")
      set_source_files_properties("${CTXPOOL_TSAN_ABSL_SOURCE}"
        TARGET_DIRECTORY ctxpool PROPERTIES COMPILE_DEFINITIONS
        "CTXPOOL_ABSL_NS_MANGLED=\"${CTXPOOL_TSAN_ABSL_NS_MANGLED}\"")
    endfunction()
    cmake_language(DEFER DIRECTORY "${PROJECT_SOURCE_DIR}"
      CALL _ctxpool_add_tsan_absl_annotations)
  endif()
endif()
