#include "coshard/collectives/env.hpp"

#include <charconv>

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

async::Task<Result<std::unique_ptr<Communicator>>> communicator_from_env(FromEnvOptions options) {
  COSHARD_CO_TRY_ASSIGN(const TorchrunEnv env, read_torchrun_env());
  const int gpus = async::cuda_device_count();
  if (!options.force_cpu && gpus > 0 && nccl_compiled()) {
    StoreOptions store_options;
    store_options.host = env.master_addr;
    // A world of one has no peer to find the store: a free port, so that single-GPU jobs on one
    // machine never contend for MASTER_PORT.
    store_options.port = env.world_size == 1 ? 0 : env.master_port;
    store_options.host_server = env.rank == 0;
    store_options.timeout = options.store_timeout;
    COSHARD_CO_TRY_ASSIGN(auto store, co_await TcpStore::connect(store_options));
    const async::Device device = async::Device::cuda(env.local_rank % gpus);
    auto comm = co_await make_nccl_communicator(*store, env.rank, env.world_size, device, options.nccl);
    // Every rank fetched the id before the collective init could finish: the store can go.
    co_return comm;
  }
  if (env.world_size == 1) {
    COSHARD_CO_TRY_ASSIGN(auto comms, make_local_communicators(1));
    co_return std::move(comms.front());
  }
  co_return fail(ErrorCode::unsupported, "WORLD_SIZE=", env.world_size,
                 " with ranks in separate processes needs the NCCL backend (a CUDA device and NCCL); this process has ",
                 gpus, " CUDA device(s) and ", nccl_compiled() ? "NCCL" : "no NCCL",
                 ". On CPU, run the ranks as threads of one process (make_local_communicators).");
}

Result<std::unique_ptr<Communicator>> communicator_from_env(async::Runtime& rt, FromEnvOptions options) {
  return rt.block_on(communicator_from_env(std::move(options)));
}

}  // namespace coshard::collectives
