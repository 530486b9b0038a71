# `cmake --install` produces a relocatable package: find_package(coshard CONFIG REQUIRED), then
# target_link_libraries(app PRIVATE coshard::coshard).
include(CMakePackageConfigHelpers)
set(COSHARD_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/coshard)

install(EXPORT coshardTargets NAMESPACE coshard:: DESTINATION ${COSHARD_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/coshardConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/coshardConfig.cmake INSTALL_DESTINATION ${COSHARD_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/coshardConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${CMAKE_CURRENT_BINARY_DIR}/coshardConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/coshardConfigVersion.cmake
  ${CMAKE_CURRENT_LIST_DIR}/coshard-deps.cmake
  DESTINATION ${COSHARD_CMAKE_DIR})
