#include "launch_mode.hpp"

#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/memory.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/modules/module.hpp"

namespace coshard::train_app {

namespace {

const char* mode_name(std::int32_t mode) {
  switch (mode) {
    case 0: return "to train";
    case 1: return "--print-config";
    case 2: return "--estimate";
  }
  return "something unknown";
}

}  // namespace

bool launched_with_others(const Options& o) noexcept {
  return o.launch.launcher != collectives::Launcher::none && o.launch.world_size > 1;
}

collectives::FromEnvOptions process_communicator_options(const Options& o, collectives::Backend backend) {
  collectives::FromEnvOptions env;
  env.force_cpu = o.device == "cpu";
  env.backend = backend;
  const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(o.collective_timeout_s * 1000.0));
  if (timeout.count() > 0) env.nccl.timeout = env.mpi.timeout = timeout;
  return env;
}

async::Task<Result<void>> agree_on_launch_mode(collectives::Communicator& comm, LaunchMode mine) {
  const int world = comm.size();
  const async::Device device = comm.stream().device();
  COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(device, {.name = "launch"}));
  COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(device));
  COSHARD_CO_TRY_ASSIGN(auto ctx, modules::Context::create(stream, *allocator));
  const std::int32_t mode = static_cast<std::int32_t>(mine);
  COSHARD_CO_TRY_ASSIGN(auto send, ctx.upload(std::as_bytes(std::span<const std::int32_t>(&mode, 1)), modules::Shape{1},
                                              modules::DataType::i32));
  COSHARD_CO_TRY_ASSIGN(auto recv, ctx.empty(modules::Shape{world}, modules::DataType::i32));
  COSHARD_CO_TRY_ASSIGN(auto uploaded, ctx.stream().record());
  COSHARD_CO_TRY(comm.stream().wait(uploaded));
  COSHARD_CO_TRY_ASSIGN(auto gathered, comm.all_gather(send.data(), recv.data(), 1, modules::DataType::i32));
  COSHARD_CO_TRY(ctx.stream().wait(gathered));
  COSHARD_CO_TRY_ASSIGN(const auto all, co_await ctx.read(recv));
  std::string differ;
  for (int q = 1; q < world; ++q)
    if (all[static_cast<std::size_t>(q)] != all[0])
      differ += (differ.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) + " " +
                mode_name(static_cast<std::int32_t>(all[static_cast<std::size_t>(q)]));
  (void)stream.synchronize();  // (the read above has passed: nothing is left to wait for)
  if (differ.empty()) co_return Result<void>{};
  co_return fail(ErrorCode::invalid_argument, "the ranks of this launch were asked to do different things: rank 0 ",
                 mode_name(static_cast<std::int32_t>(all[0])), ", ", differ,
                 " (give --print-config or --estimate to every rank, or run them without the launcher)");
}

int finish_early_under_launcher(const Options& o, LaunchMode mode, const std::function<int()>& act) {
  const auto backend = collectives::parse_backend(o.backend);
  if (!backend) {
    std::fprintf(stderr, "coshard-train: --backend: %s\n", backend.error().message().c_str());
    return 2;
  }
  async::Runtime rt;
  auto comm = collectives::communicator_from_env(rt, process_communicator_options(o, *backend));
  if (!comm) {
    std::fprintf(stderr, "coshard-train: rank %d: %s\n", o.launch.rank, comm.error().message().c_str());
    return 2;
  }
  auto agreed = rt.block_on(agree_on_launch_mode(**comm, mode));
  if (!agreed) {
    std::fprintf(stderr, "coshard-train: rank %d: %s\n", o.launch.rank, agreed.error().message().c_str());
    return 2;
  }
  return act();
}

}  // namespace coshard::train_app
