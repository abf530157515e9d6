# `cmake --install` gives the headers, libctxpool (static by default; shared
# with -DBUILD_SHARED_LIBS=ON), the ctxpool tool (tools/CMakeLists.txt) and a
# package config, so a user's CMake does
#
#   find_package(ctxpool 0.1 REQUIRED)
#   target_link_libraries(app PRIVATE ctxpool::ctxpool)
#
# (examples/hello_ctxpool is such a project; tests/install.cmake installs
# into a scratch prefix and builds it). ctxpool_warnings is build-tree only
# and not exported: users keep their own warning flags.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(CTXPOOL_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/ctxpool"
    CACHE STRING "Where the ctxpool package config goes, under the prefix")

install(TARGETS ctxpool EXPORT ctxpoolTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ctxpool
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h" PATTERN "*.inc")
install(EXPORT ctxpoolTargets NAMESPACE ctxpool::
  DESTINATION ${CTXPOOL_INSTALL_CMAKEDIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ctxpoolConfig.cmake.in
  ${PROJECT_BINARY_DIR}/ctxpoolConfig.cmake
  INSTALL_DESTINATION ${CTXPOOL_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ctxpoolConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ctxpoolConfig.cmake
              ${PROJECT_BINARY_DIR}/ctxpoolConfigVersion.cmake
  DESTINATION ${CTXPOOL_INSTALL_CMAKEDIR})
