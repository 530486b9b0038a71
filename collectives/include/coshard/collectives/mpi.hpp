// The MPI backend: ranks as processes (or nodes) without a GPU, on Open MPI, started by
// `mpirun -np N` or `srun`.
//
// Every collective is built from non-blocking point-to-point messages (MPI_Isend/MPI_Irecv) so
// that results equal the Local backend's bit for bit and a missing peer can be named:
//   all_gather      each rank sends its block to every rank;
//   reduce_scatter  rank q receives block q of every rank's input and reduces them in rank
//                   order 0..n-1 (the Local backend's arithmetic, reduce.hpp);
//   all_reduce      the same on slices (rank q reduces elements [count*q/n, count*(q+1)/n)),
//                   then every rank sends its reduced slice to every rank;
//   broadcast       the root sends to every rank; barrier: the group's headers alone.
// Each group starts with a 16-byte header to every peer (its sequence number and a hash of its
// ops' signatures): a rank that launched something else fails with "collective sequence
// mismatch" naming both sides. Bytes sent per rank are those of ring algorithms ((n-1)/n of the
// data for all_gather and reduce_scatter, twice that for all_reduce).
//
// Stream and progress: a launch enqueues one closure on the communicator's CPU communication
// stream and returns the stream's event, as the Local backend does; the host never waits. The
// stream's worker is the device here: it posts the group's messages and drives MPI's progress
// (MPI_Testall, spinning briefly, then sleeping in short steps), reduces what arrived, and
// passes the event. No other thread of the runtime ever waits on MPI.
//
// Failure: a group not complete within `timeout` fails naming the peers whose messages are
// missing and the last group each of them reached here; a peer that called abort() (a rank
// that failed) makes every rank's current and later collectives fail at once, naming it and
// its reason (an abort notice on a reserved tag, checked while waiting and at each launch).
// A process that dies is reported by mpirun, which ends the job.
//
// MPI is initialised (MPI_THREAD_MULTIPLE) on the first call and finalised when the process
// exits, unless the program initialised it itself (then the program finalises it). Every
// communicator works on its own duplicate of MPI_COMM_WORLD, so a program's own MPI messages
// never meet coshard's.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>

#include "coshard/async/result.hpp"
#include "coshard/collectives/communicator.hpp"

namespace coshard::collectives {

struct MpiOptions {
  // How long a group may take before it fails naming the peers it still waits for.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// True when this build has the MPI backend (Open MPI found at configure time).
bool mpi_compiled() noexcept;

// This process's rank of MPI_COMM_WORLD (every process of the job calls it). Setup: MPI's own
// initialisation and the duplicate of the world communicator block the calling thread.
Result<std::unique_ptr<Communicator>> make_mpi_communicator(MpiOptions options = {});

// Rank `root`'s `bytes` to every process of MPI_COMM_WORLD (the NCCL unique id, when mpirun
// starts NCCL ranks: MPI is used for nothing else then). Blocks; setup only.
Result<void> mpi_broadcast_bytes(std::span<std::byte> bytes, int root);

}  // namespace coshard::collectives
