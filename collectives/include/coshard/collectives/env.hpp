// The communicator a process's environment asks for, in the torchrun convention:
// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
//
// - A CUDA device and NCCL present: NCCL on device LOCAL_RANK (mod the visible count), the
//   unique id exchanged through a TcpStore that rank 0 hosts at MASTER_ADDR:MASTER_PORT (at
//   WORLD_SIZE=1, on a free port: there is no peer to find it).
// - Otherwise WORLD_SIZE=1 (or unset): the Local backend with one rank, on CPU.
// - Otherwise: an error. Ranks in separate processes need NCCL; on CPU, run the ranks as threads
//   of one process (make_local_communicators).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/nccl.hpp"

namespace coshard::collectives {

struct TorchrunEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
};

// Parses the variables through `get` (std::getenv by default); unset ones keep the defaults
// above. Bad values fail with the variable, its value and what was expected.
Result<TorchrunEnv> read_torchrun_env(const std::function<const char*(const char*)>& get = std::getenv);

struct FromEnvOptions {
  std::chrono::milliseconds store_timeout{std::chrono::seconds(60)};
  NcclOptions nccl;
  bool force_cpu = false;  // ignore GPUs (then only WORLD_SIZE=1 works)
};

// Awaited on a Runtime.
async::Task<Result<std::unique_ptr<Communicator>>> communicator_from_env(FromEnvOptions options);
// With the default options (a plain function: see make_nccl_communicator on GCC 12).
inline async::Task<Result<std::unique_ptr<Communicator>>> communicator_from_env() {
  const FromEnvOptions defaults;
  return communicator_from_env(defaults);
}
// From plain code: runs communicator_from_env on `rt` and waits.
Result<std::unique_ptr<Communicator>> communicator_from_env(async::Runtime& rt, FromEnvOptions options = {});

}  // namespace coshard::collectives
