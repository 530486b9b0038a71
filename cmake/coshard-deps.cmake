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

