# COSHARD_MPI=AUTO|ON|OFF: the MPI backend of coshard::collectives (ranks as processes without a
# GPU, launched by mpirun or srun), on the C API of the system's MPI (Debian: Open MPI,
# libopenmpi-dev, installed by scripts/install-deps.sh). Found as FindMPI's CXX component (the
# project compiles C++ only) without MPI's deprecated C++ bindings.
set(COSHARD_HAS_MPI OFF)
set(MPI_CXX_SKIP_MPICXX ON)
if(NOT COSHARD_MPI MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "COSHARD_MPI=${COSHARD_MPI}: expected AUTO, ON or OFF")
endif()
if(NOT COSHARD_MPI STREQUAL "OFF")
  if(COSHARD_MPI STREQUAL "ON")
    find_package(MPI REQUIRED COMPONENTS CXX)
  else()
    find_package(MPI QUIET COMPONENTS CXX)
  endif()
  if(MPI_CXX_FOUND)
    set(COSHARD_HAS_MPI ON)
  endif()
endif()
message(STATUS "coshard: MPI backend ${COSHARD_HAS_MPI}")

# How the tests start processes: mpirun on this machine, more processes than cores allowed and
# none bound to a core (each rank runs several threads), as root too (CI runs as root), shared
# memory between the processes of this machine. Open MPI's leaks at exit are its own:
# LeakSanitizer is off for the processes it starts.
if(COSHARD_HAS_MPI)
  set(COSHARD_MPIRUN ${MPIEXEC_EXECUTABLE} --oversubscribe --bind-to none)
  set(COSHARD_MPIRUN_ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_btl=self,vader")
  if(COSHARD_SANITIZE STREQUAL "address")
    list(APPEND COSHARD_MPIRUN_ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0:abort_on_error=1")
  endif()
endif()
