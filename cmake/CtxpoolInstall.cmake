# `cmake --install` gives headers, libctxpool and a package config, so a
# user's CMake does find_package(ctxpool) and links ctxpool::ctxpool.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS ctxpool ctxpool_warnings EXPORT ctxpoolTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ctxpool
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT ctxpoolTargets NAMESPACE ctxpool::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ctxpool)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ctxpoolConfig.cmake.in
  ${PROJECT_BINARY_DIR}/ctxpoolConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ctxpool)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ctxpoolConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ctxpoolConfig.cmake
              ${PROJECT_BINARY_DIR}/ctxpoolConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ctxpool)
