// The communicator a process's environment asks for. Who started the process says its rank:
//
//   torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   mpirun     OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK/_LOCAL_SIZE (Open MPI); PMI_RANK, PMI_SIZE,
//              MPI_LOCALRANKID, MPI_LOCALNRANKS (MPICH's Hydra)
//   srun       SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE inside a job
//              step (SLURM_STEP_ID)
//   none       one process, rank 0 of 1
//
// The backend, chosen by choose_backend (Backend::automatic) or asked for:
// - A CUDA device and NCCL present: NCCL on device LOCAL_RANK (mod the visible count). Under
//   mpirun or srun its unique id goes through MPI (and MPI does nothing else); under torchrun
//   through a TcpStore that rank 0 hosts at MASTER_ADDR:MASTER_PORT (at a world of 1, on a free
//   port: there is no peer to find it).
// - Otherwise, started by mpirun or srun: the MPI backend, on the CPU.
// - Otherwise a world of 1: the Local backend with one rank, on the CPU.
// - Otherwise (torchrun's variables without a GPU): an error that says to start the processes
//   with mpirun, or to run the ranks as threads of one process (make_local_communicators).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/mpi.hpp"
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

enum class Launcher : std::uint8_t { none, torchrun, mpirun, srun };
std::string_view to_string(Launcher launcher) noexcept;

// How this process was started, and its place in the job.
struct LaunchEnv {
  Launcher launcher = Launcher::none;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;  // processes of the job on this machine (they share its cores and memory)
  std::string master_addr = "127.0.0.1";  // torchrun's store (and NCCL's under srun without MPI)
  std::uint16_t master_port = 29500;
  // "mpirun (OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2)": for messages and header lines.
  std::string describe() const;
};

// The launcher's variables through `get`, checked in the order of the table above (torchrun's
// first: torchrun under srun sets both). Bad values fail naming the variable, its value and
// what was expected.
Result<LaunchEnv> read_launch_env(const std::function<const char*(const char*)>& get = std::getenv);

enum class Backend : std::uint8_t { automatic, local, nccl, mpi };
std::string_view to_string(Backend backend) noexcept;
// "auto", "local", "nccl" or "mpi".
Result<Backend> parse_backend(std::string_view text);

// The backend for `env` (rules above): `requested`, checked against the launch and this build,
// or the automatic choice. `gpu` says a CUDA device and NCCL are there and wanted.
Result<Backend> choose_backend(const LaunchEnv& env, Backend requested, bool gpu);

struct FromEnvOptions {
  std::chrono::milliseconds store_timeout{std::chrono::seconds(60)};
  NcclOptions nccl;
  MpiOptions mpi;
  Backend backend = Backend::automatic;
  bool force_cpu = false;  // ignore GPUs
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
