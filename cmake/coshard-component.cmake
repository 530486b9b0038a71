# coshard_component(NAME SOURCES ... CUDA_SOURCES ... DEPS ...)
#
# One static library target per top-level folder, `coshard_NAME` with the alias `coshard::NAME`,
# public headers in NAME/include/coshard/NAME/ (installed), private code in NAME/src/. With no
# sources yet the target is an INTERFACE library over its dependencies. With tests on, an object
# library compiles every public header on its own (Seastar's check that headers stand alone).
# The project's warnings on a target of its own (a component library or a program): -Wall -Wextra
# -Wpedantic on C++, -Werror with COSHARD_WERROR.
function(coshard_warnings target)
  if(COSHARD_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>)
  # GCC 12's -Wrestrict misfires on std::string concatenation at -O3 (GCC bug 105329): the
  # Release build printed pages of it from libstdc++'s own headers. Fixed in GCC 13.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-restrict>)
  endif()
endfunction()

function(coshard_component name)
  cmake_parse_arguments(C "" "" "SOURCES;CUDA_SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(target coshard_${name})
  set(include_dir ${CMAKE_CURRENT_SOURCE_DIR}/include)

  if(COSHARD_HAS_CUDA)
    list(APPEND C_SOURCES ${C_CUDA_SOURCES})
  endif()
  if(C_SOURCES)
    add_library(${target} STATIC ${C_SOURCES})
    set(scope PUBLIC)
    target_link_libraries(${target} PRIVATE ${C_PRIVATE_DEPS})
    target_include_directories(${target} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
    coshard_warnings(${target})
  else()
    add_library(${target} INTERFACE)
    set(scope INTERFACE)
  endif()
  add_library(coshard::${name} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME coshard_${name})
  target_link_libraries(${target} ${scope} ${C_DEPS})
  target_compile_features(${target} ${scope} cxx_std_20)  # what a consumer needs, carried by the export
  if(EXISTS ${include_dir})
    target_include_directories(${target} ${scope}
      $<BUILD_INTERFACE:${include_dir}>
      $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
    install(DIRECTORY ${include_dir}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  endif()
  install(TARGETS ${target} EXPORT coshardTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})

  if(COSHARD_BUILD_TESTS AND COSHARD_HEADER_CHECKS AND EXISTS ${include_dir})
    file(GLOB_RECURSE headers RELATIVE ${include_dir} CONFIGURE_DEPENDS ${include_dir}/*.hpp)
    set(check_sources "")
    set(all_headers "")
    foreach(header IN LISTS headers)
      string(MAKE_C_IDENTIFIER ${header} id)
      set(check ${CMAKE_CURRENT_BINARY_DIR}/header_check/${id}.cpp)
      file(CONFIGURE OUTPUT ${check} CONTENT "#include <${header}>\n")
      list(APPEND check_sources ${check})
      string(APPEND all_headers "#include <${header}>\n")
    endforeach()
    if(check_sources)
      # Each header alone as C++20 (the library's standard: each stands on its own), and all of
      # them together as C++23 (a newer consumer's): one file, since standing alone is already
      # checked, and one compile instead of one per header (about a minute of CI's build).
      add_library(${target}_header_check OBJECT ${check_sources})
      target_link_libraries(${target}_header_check PRIVATE ${target})
      set(check_cxx23 ${CMAKE_CURRENT_BINARY_DIR}/header_check/all_headers_cxx23.cpp)
      file(CONFIGURE OUTPUT ${check_cxx23} CONTENT "${all_headers}")
      add_library(${target}_header_check_cxx23 OBJECT ${check_cxx23})
      target_link_libraries(${target}_header_check_cxx23 PRIVATE ${target})
      set_target_properties(${target}_header_check_cxx23 PROPERTIES CXX_STANDARD 23)
    endif()
  endif()
endfunction()
