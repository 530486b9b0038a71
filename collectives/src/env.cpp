#include "coshard/collectives/env.hpp"

#include <charconv>
#include <string>
#include <string_view>

#include "coshard/collectives/local.hpp"
#include "coshard/collectives/store.hpp"

namespace coshard::collectives {
namespace {

Result<long> parse_int(const char* name, const char* text, long min, long max) {
  const std::string_view v(text);
  long out = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || out < min || out > max) {
    return fail(ErrorCode::invalid_argument, name, "='", v, "': expected an integer in [", min, ", ", max, "]");
  }
  return out;
}

}  // namespace

Result<TorchrunEnv> read_torchrun_env(const std::function<const char*(const char*)>& get) {
  TorchrunEnv env;
  if (const char* v = get("WORLD_SIZE")) {
    COSHARD_TRY_ASSIGN(const long w, parse_int("WORLD_SIZE", v, 1, 1 << 20));
    env.world_size = static_cast<int>(w);
  }
  if (const char* v = get("RANK")) {
    COSHARD_TRY_ASSIGN(const long r, parse_int("RANK", v, 0, env.world_size - 1));
    env.rank = static_cast<int>(r);
  }
  if (const char* v = get("LOCAL_RANK")) {
    COSHARD_TRY_ASSIGN(const long r, parse_int("LOCAL_RANK", v, 0, env.world_size - 1));
    env.local_rank = static_cast<int>(r);
  }
  if (const char* v = get("MASTER_ADDR"); v && *v) env.master_addr = v;
  if (const char* v = get("MASTER_PORT")) {
    COSHARD_TRY_ASSIGN(const long p, parse_int("MASTER_PORT", v, 1, 65535));
    env.master_port = static_cast<std::uint16_t>(p);
  }
  return env;
}

std::string_view to_string(Launcher launcher) noexcept {
  switch (launcher) {
    case Launcher::none: return "none";
    case Launcher::torchrun: return "torchrun";
    case Launcher::mpirun: return "mpirun";
    case Launcher::srun: return "srun";
  }
  return "unknown-launcher";
}

std::string_view to_string(Backend backend) noexcept {
  switch (backend) {
    case Backend::automatic: return "auto";
    case Backend::local: return "local";
    case Backend::nccl: return "nccl";
    case Backend::mpi: return "mpi";
  }
  return "unknown-backend";
}

Result<Backend> parse_backend(std::string_view text) {
  for (const Backend b : {Backend::automatic, Backend::local, Backend::nccl, Backend::mpi}) {
    if (text == to_string(b)) return b;
  }
  return fail(ErrorCode::invalid_argument, "backend '", text, "': expected auto, local, nccl or mpi");
}

std::string LaunchEnv::describe() const {
  std::string s(to_string(launcher));
  if (launcher == Launcher::none) return "one process";
  return s + " (rank " + std::to_string(rank) + " of " + std::to_string(world_size) + ", local rank " +
         std::to_string(local_rank) + ")";
}

namespace {

// Rank, size and local rank from one launcher's three variables (the size first: it bounds the others).
Result<LaunchEnv> read_launcher(Launcher launcher, const char* rank_var, const char* size_var, const char* local_var,
                                const char* local_size_var, const std::function<const char*(const char*)>& get) {
  LaunchEnv env;
  env.launcher = launcher;
  COSHARD_TRY_ASSIGN(const long w, parse_int(size_var, get(size_var), 1, 1 << 20));
  env.world_size = static_cast<int>(w);
  const char* rank = get(rank_var);
  if (rank == nullptr) {
    return fail(ErrorCode::invalid_argument, size_var, " is set but ", rank_var, " is not: ", to_string(launcher),
                " sets both");
  }
  COSHARD_TRY_ASSIGN(const long r, parse_int(rank_var, rank, 0, env.world_size - 1));
  env.rank = static_cast<int>(r);
  if (const char* local = local_var != nullptr ? get(local_var) : nullptr) {
    COSHARD_TRY_ASSIGN(const long l, parse_int(local_var, local, 0, env.world_size - 1));
    env.local_rank = static_cast<int>(l);
  }
  if (const char* local = get(local_size_var)) {
    // Slurm writes "2(x3)" for uneven nodes: the leading count is this node's.
    std::string_view v(local);
    v = v.substr(0, v.find('('));
    COSHARD_TRY_ASSIGN(const long n, parse_int(local_size_var, std::string(v).c_str(), 1, env.world_size));
    env.local_size = static_cast<int>(n);
  }
  return env;
}

}  // namespace

Result<LaunchEnv> read_launch_env(const std::function<const char*(const char*)>& get) {
  if (get("WORLD_SIZE") != nullptr) {
    COSHARD_TRY_ASSIGN(const TorchrunEnv t, read_torchrun_env(get));
    LaunchEnv env{Launcher::torchrun, t.rank, t.world_size, t.local_rank, 1, t.master_addr, t.master_port};
    if (const char* v = get("LOCAL_WORLD_SIZE")) {
      COSHARD_TRY_ASSIGN(const long n, parse_int("LOCAL_WORLD_SIZE", v, 1, env.world_size));
      env.local_size = static_cast<int>(n);
    }
    return env;
  }
  if (get("OMPI_COMM_WORLD_SIZE") != nullptr) {
    return read_launcher(Launcher::mpirun, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                         "OMPI_COMM_WORLD_LOCAL_SIZE", get);
  }
  if (get("PMI_SIZE") != nullptr) {
    return read_launcher(Launcher::mpirun, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", get);
  }
  // srun's tasks; a batch script alone (no job step) is one process.
  if (get("SLURM_NTASKS") != nullptr && get("SLURM_PROCID") != nullptr &&
      (get("SLURM_STEP_ID") != nullptr || get("SLURM_STEPID") != nullptr)) {
    COSHARD_TRY_ASSIGN(LaunchEnv env, read_launcher(Launcher::srun, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                                    "SLURM_NTASKS_PER_NODE", get));
    // NCCL's store, when there is no MPI to pass its id: torchrun's variables where set.
    COSHARD_TRY_ASSIGN(const TorchrunEnv t, read_torchrun_env(get));
    env.master_addr = t.master_addr;
    env.master_port = t.master_port;
    return env;
  }
  return LaunchEnv{};
}

Result<Backend> choose_backend(const LaunchEnv& env, Backend requested, bool gpu) {
  const bool by_mpi = env.launcher == Launcher::mpirun || env.launcher == Launcher::srun;
  switch (requested) {
    case Backend::local:
      if (env.world_size == 1) return Backend::local;
      return fail(ErrorCode::invalid_argument, "backend local runs every rank as a thread of one process, but this process is ",
                  env.describe(), ": use nccl (GPUs) or mpi");
    case Backend::nccl:
      if (!gpu) {
        return fail(ErrorCode::unsupported, "backend nccl needs a CUDA device and a build with NCCL; this process has ",
                    async::cuda_device_count(), " CUDA device(s) and ", nccl_compiled() ? "NCCL compiled in" : "no NCCL",
                    " (or the CPU was asked for)");
      }
      return Backend::nccl;
    case Backend::mpi:
      if (!mpi_compiled()) {
        return fail(ErrorCode::unsupported,
                    "backend mpi: this build has no MPI backend (Debian's libopenmpi-dev, installed by scripts/install-deps.sh)");
      }
      if (env.launcher == Launcher::torchrun) {
        return fail(ErrorCode::invalid_argument, "backend mpi needs processes started by mpirun or srun; this process is ",
                    env.describe(), ", whose ranks share no MPI job");
      }
      return Backend::mpi;
    case Backend::automatic:
      break;
  }
  if (gpu) return Backend::nccl;
  if (by_mpi) {
    if (mpi_compiled()) return Backend::mpi;
    return fail(ErrorCode::unsupported, "this process is ", env.describe(),
                " without a GPU, which needs the MPI backend, and this build has none (Debian's libopenmpi-dev, "
                "installed by scripts/install-deps.sh)");
  }
  if (env.world_size == 1) return Backend::local;
  return fail(ErrorCode::unsupported, "WORLD_SIZE=", env.world_size,
              " with ranks in separate processes on the CPU needs the MPI backend: start them with mpirun -np ",
              env.world_size, " (or srun) instead of torchrun's variables; this process has ", async::cuda_device_count(),
              " CUDA device(s) and ", nccl_compiled() ? "NCCL compiled in" : "no NCCL",
              ". Or run the ranks as threads of one process (make_local_communicators).");
}

async::Task<Result<std::unique_ptr<Communicator>>> communicator_from_env(FromEnvOptions options) {
  COSHARD_CO_TRY_ASSIGN(const LaunchEnv env, read_launch_env());
  const bool gpu = !options.force_cpu && async::cuda_device_count() > 0 && nccl_compiled();
  COSHARD_CO_TRY_ASSIGN(const Backend backend, choose_backend(env, options.backend, gpu));
  const bool by_mpi = env.launcher == Launcher::mpirun || env.launcher == Launcher::srun;
  switch (backend) {
    case Backend::mpi: {
      COSHARD_CO_TRY_ASSIGN(auto comm, make_mpi_communicator(options.mpi));
      if (env.launcher != Launcher::none && (comm->rank() != env.rank || comm->size() != env.world_size)) {
        co_return fail(ErrorCode::invalid_argument, "MPI made this process rank ", comm->rank(), " of ", comm->size(),
                       " but ", env.describe(), " says otherwise: was this program started by another MPI's launcher?");
      }
      co_return comm;
    }
    case Backend::nccl: {
      const async::Device device = async::Device::cuda(env.local_rank % async::cuda_device_count());
      if (by_mpi && mpi_compiled()) {
        // The unique id through MPI: one broadcast, then NCCL alone.
        std::vector<std::byte> id(nccl_unique_id_bytes());
        if (env.rank == 0) {
          COSHARD_CO_TRY_ASSIGN(id, make_nccl_unique_id());
        }
        COSHARD_CO_TRY(mpi_broadcast_bytes(id, 0));
        co_return co_await make_nccl_communicator(std::move(id), env.rank, env.world_size, device, options.nccl);
      }
      StoreOptions store_options;
      store_options.host = env.master_addr;
      // A world of one has no peer to find the store: a free port, so that single-GPU jobs on one
      // machine never contend for MASTER_PORT.
      store_options.port = env.world_size == 1 ? 0 : env.master_port;
      store_options.host_server = env.rank == 0;
      store_options.timeout = options.store_timeout;
      COSHARD_CO_TRY_ASSIGN(auto store, co_await TcpStore::connect(store_options));
      // Every rank fetched the id before the collective init could finish: the store can go.
      co_return co_await make_nccl_communicator(*store, env.rank, env.world_size, device, options.nccl);
    }
    case Backend::local:
    case Backend::automatic:
      break;
  }
  COSHARD_CO_TRY_ASSIGN(auto comms, make_local_communicators(1));
  co_return std::move(comms.front());
}

Result<std::unique_ptr<Communicator>> communicator_from_env(async::Runtime& rt, FromEnvOptions options) {
  return rt.block_on(communicator_from_env(std::move(options)));
}

}  // namespace coshard::collectives
