# Dependencies that coshard's public targets carry. Included by the build and, installed, by
# coshardConfig.cmake, so a consumer gets the same imported targets with the same settings.
#
#   coshard::asio   Asio (header-only) with io_uring files, liburing, threads.
include_guard(GLOBAL)
include(CMakeFindDependencyMacro)

find_package(Threads REQUIRED)
# JSON (safetensors headers, configs); linked privately, but a static library's consumers link it too.
find_package(nlohmann_json 3 REQUIRED)
# zlib (CRC-32 of checkpoint files in coshard::trainer); linked privately, but a static library's
# consumers link it too.
find_package(ZLIB REQUIRED)
# fmt: the log macros in coshard/async/log.hpp format with it (a public dependency). spdlog:
# the log's logger; linked privately, but a static library's consumers link it too.
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
# protobuf (lite): TensorBoard's event messages in coshard::trainer; linked privately, but a
# static library's consumers link it too.
find_package(Protobuf REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(COSHARD_URING REQUIRED IMPORTED_TARGET GLOBAL liburing)
# OpenBLAS (the CPU matrix products of coshard::modules); linked privately, but a static
# library's consumers link it too.
pkg_check_modules(COSHARD_OPENBLAS REQUIRED IMPORTED_TARGET GLOBAL openblas)
if(NOT TARGET coshard::openblas)
  add_library(coshard::openblas INTERFACE IMPORTED GLOBAL)
  target_link_libraries(coshard::openblas INTERFACE PkgConfig::COSHARD_OPENBLAS)
endif()

# oneDNN: the CPU's native bf16/f16 matrix products (coshard::modules, kernels/cpu/half_products.cpp),
# on the OpenMP runtime Debian's build of it uses (libgomp); linked privately, but a static
# library's consumers link them too. Found by its header and library, not its CMake package, which
# asks for OpenCL's development files for a GPU runtime coshard does not use. The build chooses
# with COSHARD_ONEDNN (AUTO: when found; ON; OFF); the installed package as it was built.
if(NOT DEFINED COSHARD_HAS_ONEDNN)
  set(COSHARD_ONEDNN AUTO CACHE STRING "oneDNN for the CPU's bf16/f16 matrix products: AUTO (when found), ON, OFF")
  set_property(CACHE COSHARD_ONEDNN PROPERTY STRINGS AUTO ON OFF)
  set(COSHARD_HAS_ONEDNN OFF)
  set(coshard_want_onednn ${COSHARD_ONEDNN})
else()
  set(coshard_want_onednn ${COSHARD_HAS_ONEDNN})
endif()
if(coshard_want_onednn AND NOT coshard_want_onednn STREQUAL "OFF")
  find_path(COSHARD_ONEDNN_INCLUDE_DIR dnnl.hpp)
  find_library(COSHARD_ONEDNN_LIBRARY dnnl)
  find_library(COSHARD_GOMP_LIBRARY NAMES gomp libgomp.so.1)
  if(COSHARD_ONEDNN_INCLUDE_DIR AND COSHARD_ONEDNN_LIBRARY AND COSHARD_GOMP_LIBRARY)
    set(COSHARD_HAS_ONEDNN ON)
    if(NOT TARGET coshard::onednn)
      add_library(coshard::onednn INTERFACE IMPORTED GLOBAL)
      target_include_directories(coshard::onednn INTERFACE ${COSHARD_ONEDNN_INCLUDE_DIR})
      target_link_libraries(coshard::onednn INTERFACE ${COSHARD_ONEDNN_LIBRARY} ${COSHARD_GOMP_LIBRARY})
    endif()
  elseif(NOT coshard_want_onednn STREQUAL "AUTO")
    message(FATAL_ERROR "coshard: oneDNN (dnnl.hpp, libdnnl) or libgomp not found: install it (Debian: libdnnl-dev, "
                        "or run scripts/install-deps.sh), or configure with -DCOSHARD_ONEDNN=OFF")
  endif()
endif()

find_path(COSHARD_ASIO_INCLUDE_DIR asio.hpp)
if(NOT COSHARD_ASIO_INCLUDE_DIR)
  message(FATAL_ERROR "coshard: asio.hpp not found: install Asio (Debian: libasio-dev, or run scripts/install-deps.sh)")
endif()

if(NOT TARGET coshard::asio)
  add_library(coshard::asio INTERFACE IMPORTED GLOBAL)
  target_include_directories(coshard::asio INTERFACE ${COSHARD_ASIO_INCLUDE_DIR})
  # ASIO_HAS_IO_URING changes the io_context's services: every translation unit must agree.
  # ASIO_HAS_STD_ALIGNED_ALLOC: Asio 1.22 detects it from _GLIBCXX_HAVE_ALIGNED_ALLOC, which is
  # only defined if a libstdc++ header came before Asio's; translation units that disagree
  # allocate handler memory with operator new and free it with std::free (AddressSanitizer:
  # alloc-dealloc-mismatch). glibc and C++17 always have aligned_alloc: pin it everywhere.
  target_compile_definitions(coshard::asio INTERFACE ASIO_NO_DEPRECATED ASIO_HAS_IO_URING
    ASIO_HAS_STD_ALIGNED_ALLOC=1)
  target_link_libraries(coshard::asio INTERFACE PkgConfig::COSHARD_URING Threads::Threads)
endif()

