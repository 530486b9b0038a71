// The answer of a build without MPI.
#include "coshard/collectives/mpi.hpp"

namespace coshard::collectives {

bool mpi_compiled() noexcept { return false; }

Result<std::unique_ptr<Communicator>> make_mpi_communicator(MpiOptions) {
  return fail(ErrorCode::unsupported,
              "make_mpi_communicator: this build has no MPI backend (configure with MPI present: Debian's "
              "libopenmpi-dev, installed by scripts/install-deps.sh; COSHARD_MPI=ON requires it)");
}

Result<void> mpi_broadcast_bytes(std::span<std::byte>, int) {
  return fail(ErrorCode::unsupported, "mpi_broadcast_bytes: this build has no MPI backend");
}

}  // namespace coshard::collectives
