# `ctxpool info` names the process's cgroup, its limits and the pinned-host
# budget derived from them (a fake /proc + /sys/fs/cgroup tree through
# CTXPOOL_SYSFS_ROOT), in text and in JSON.
if(TARGET ctxpool_tool)
  set(_ctxpool_info_check ${CMAKE_CURRENT_BINARY_DIR}/ctxpool_info_check.cmake)
  file(WRITE ${_ctxpool_info_check} [=[
set(root ${OUT}/ctxpool_info_fake_root)
file(REMOVE_RECURSE ${root})
file(WRITE ${root}/proc/self/cgroup "0::/kubepods/pod1/ctr\n")
file(WRITE ${root}/sys/fs/cgroup/kubepods/pod1/memory.max "2147483648\n")
file(WRITE ${root}/sys/fs/cgroup/kubepods/pod1/ctr/memory.max "max\n")
file(WRITE ${root}/sys/fs/cgroup/kubepods/pod1/ctr/memory.high "max\n")
file(WRITE ${root}/sys/fs/cgroup/kubepods/pod1/ctr/memory.current "1048576\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E env CTXPOOL_SYSFS_ROOT=${root}
                CTXPOOL_DRIVER=sim:h100-80gb ${TOOL} info
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "0"
   OR NOT out MATCHES "cgroup v2 /kubepods/pod1/ctr: memory.max 2048 MiB \\(from /kubepods/pod1\\)"
   OR NOT out MATCHES "pinned host budget: 1024 MiB per device \\(half of cgroup /kubepods/pod1 memory.max")
  message(FATAL_ERROR "ctxpool info: exit '${rc}':\n${out}\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env CTXPOOL_SYSFS_ROOT=${root}
                CTXPOOL_DRIVER=sim:h100-80gb ${TOOL} info --json
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "0" OR NOT out MATCHES "\"memory_max\": 2147483648"
   OR NOT out MATCHES "\"bytes_per_device\": 1073741824")
  message(FATAL_ERROR "ctxpool info --json: exit '${rc}':\n${out}\n${err}")
endif()
file(REMOVE_RECURSE ${root})
]=])
  add_test(NAME ctxpool_info_cgroup
    COMMAND ${CMAKE_COMMAND} -DTOOL=$<TARGET_FILE:ctxpool_tool>
            -DOUT=${CMAKE_CURRENT_BINARY_DIR} -P ${_ctxpool_info_check})
  set_tests_properties(ctxpool_info_cgroup PROPERTIES LABELS unit TIMEOUT 60)
endif()
