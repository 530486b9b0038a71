# COSHARD_CUDA=AUTO|ON|OFF. With the toolkit found (AUTO) or required (ON), the CUDA backend is
# compiled: host code in .cpp files against the CUDA runtime, kernels in .cu files compiled by
# nvcc as C++20 (nvcc has no C++23 mode, so .cu files never include coshard/async/result.hpp).
# NCCL is found beside the toolkit: its header is compiled against, its library opened at run time
# (as are cuBLAS and cuDNN: only the CUDA runtime is linked). These machines compile and link CUDA
# but have no GPU: the CUDA tests skip at run time.
set(COSHARD_HAS_CUDA OFF)
set(COSHARD_HAS_NCCL OFF)
if(NOT COSHARD_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "COSHARD_CUDA=${COSHARD_CUDA}: expected AUTO, ON or OFF")
endif()

if(NOT COSHARD_CUDA STREQUAL "OFF")
  if(COSHARD_CUDA STREQUAL "ON")
    find_package(CUDAToolkit REQUIRED)
  else()
    find_package(CUDAToolkit QUIET)
  endif()
  if(CUDAToolkit_FOUND)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Hopper (H100/H200) natively, plus PTX for anything newer.
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    if(NOT DEFINED CMAKE_CUDA_COMPILER)
      set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
    endif()
    enable_language(CUDA)
    # CMake 3.25 knows no C++20 dialect for nvcc (and would otherwise ask for C++23, the CXX
    # standard): teach it the flag. nvcc 13 has nothing newer than C++20.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(COSHARD_HAS_CUDA ON)

    find_path(COSHARD_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(COSHARD_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(COSHARD_NCCL_INCLUDE_DIR AND COSHARD_NCCL_LIBRARY)
      set(COSHARD_HAS_NCCL ON)
    endif()
  endif()
endif()
message(STATUS "coshard: CUDA backend ${COSHARD_HAS_CUDA}, NCCL ${COSHARD_HAS_NCCL}")
