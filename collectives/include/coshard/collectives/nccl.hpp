// The NCCL backend: one rank per process (or per GPU), collectives as NCCL group launches on a
// dedicated CUDA communication stream.
//
// Creation: rank 0 makes the NCCL unique id and publishes it in the rendezvous store; every rank
// first meets the others at a store barrier (so a peer that is gone fails with the store's
// timeout, naming it), then joins ncclCommInitRank on the runtime's blocking pool, leaving the
// reactor (which may host the store) free.
// Launch: ncclGroupStart, one NCCL call per op, ncclGroupEnd, then an event on the stream: no
// host wait (the communicator is in blocking mode, which only means ncclGroupEnd returns once
// the kernels are enqueued).
// Watchdog: a thread per communicator polls ncclCommGetAsyncError and the oldest outstanding
// launch; an NCCL error, or a launch older than `timeout`, aborts the communicator
// (ncclCommAbort): its kernels exit, status() reports why, and later launches fail at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "coshard/async/device.hpp"
#include "coshard/async/task.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/store.hpp"

namespace coshard::collectives {

struct NcclOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // per launch, by the watchdog
  std::string key = "coshard/nccl";                            // store key prefix for this communicator
};

// True when this build has NCCL (COSHARD_CUDA and NCCL found). Its library is opened at run time,
// by the first communicator or unique id: whether it can be is nccl_library()'s to say.
bool nccl_compiled() noexcept;

// The NCCL library this process uses, "NCCL 2.28.9 (/usr/lib/libnccl.so.2)", opened now if it was
// not yet (libnccl.so.2 from COSHARD_NCCL_LIBRARY, the file or its folder; the loader's search
// path; the folder where the build found it). The error says why not: a build without NCCL, or
// each place looked and what was wrong there.
Result<std::string> nccl_library();

// Rank `rank` of `world` on CUDA device `device`; every rank calls it with the same store
// (rank 0's hosting it, or any reachable one). Awaited on a coshard Runtime.
async::Task<Result<std::unique_ptr<Communicator>>> make_nccl_communicator(TcpStore& store, int rank, int world,
                                                                          async::Device device, NcclOptions options);
// The same with the default options. Not a default argument: GCC 12 miscompiles a coroutine
// whose class-type parameter comes from one (its copy in the frame kept pointers into the
// argument, and destroying it freed memory it did not own).
inline async::Task<Result<std::unique_ptr<Communicator>>> make_nccl_communicator(TcpStore& store, int rank, int world,
                                                                                 async::Device device) {
  const NcclOptions defaults;
  return make_nccl_communicator(store, rank, world, device, defaults);
}

// The same from an NCCL unique id that rank 0 made (make_nccl_unique_id) and the others received
// by other means (MPI under mpirun: mpi_broadcast_bytes). No store.
async::Task<Result<std::unique_ptr<Communicator>>> make_nccl_communicator(std::vector<std::byte> unique_id, int rank,
                                                                          int world, async::Device device,
                                                                          NcclOptions options);
// A fresh NCCL unique id (ncclGetUniqueId), as bytes; nccl_unique_id_bytes() of them.
Result<std::vector<std::byte>> make_nccl_unique_id();
std::size_t nccl_unique_id_bytes() noexcept;

}  // namespace coshard::collectives
