#include "coshard/collectives/env.hpp"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "coshard/async/device.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/collectives/store.hpp"

namespace coshard::collectives {
namespace {

auto getter(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(TorchrunEnv, UnsetMeansOneProcessOnLoopback) {
  auto env = read_torchrun_env(getter({}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->master_addr, "127.0.0.1");
  EXPECT_EQ(env->master_port, 29500);
}

TEST(TorchrunEnv, ReadsEveryVariable) {
  auto env = read_torchrun_env(getter({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                       {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "4000"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "10.1.2.3");
  EXPECT_EQ(env->master_port, 4000);
}

TEST(TorchrunEnv, BadValuesNameTheVariableAndTheRange) {
  auto rank = read_torchrun_env(getter({{"RANK", "4"}, {"WORLD_SIZE", "4"}}));
  ASSERT_FALSE(rank.has_value());
  EXPECT_EQ(rank.error().message(), "RANK='4': expected an integer in [0, 3]");
  auto port = read_torchrun_env(getter({{"MASTER_PORT", "70000"}}));
  ASSERT_FALSE(port.has_value());
  EXPECT_NE(port.error().message().find("MASTER_PORT='70000'"), std::string::npos);
  auto junk = read_torchrun_env(getter({{"WORLD_SIZE", "2x"}}));
  ASSERT_FALSE(junk.has_value());
  EXPECT_NE(junk.error().message().find("WORLD_SIZE='2x'"), std::string::npos);
}

TEST(FromEnv, OneProcessOnCpuGetsALocalCommunicator) {
  async::Runtime rt;
  FromEnvOptions options;
  options.force_cpu = true;
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  auto comm = communicator_from_env(rt, options);
  ASSERT_TRUE(comm.has_value()) << comm.error().message();
  EXPECT_EQ((*comm)->backend(), "local");
  EXPECT_EQ((*comm)->size(), 1);
}

TEST(FromEnv, SeveralProcessesWithoutAGpuIsAClearError) {
  async::Runtime rt;
  FromEnvOptions options;
  options.force_cpu = true;
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "1", 1);
  auto comm = communicator_from_env(rt, options);
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  ASSERT_FALSE(comm.has_value());
  EXPECT_EQ(comm.error().code(), ErrorCode::unsupported);
  EXPECT_NE(comm.error().message().find("WORLD_SIZE=4"), std::string::npos);
  EXPECT_NE(comm.error().message().find("make_local_communicators"), std::string::npos);
}

// With one GPU: NCCL at world size 1 (an all_reduce and a barrier in one group), through the same API.
TEST(Nccl, WorldSizeOneAllReduceAndBarrierOnTheGpu) {
  if (async::cuda_device_count() == 0 || !nccl_compiled()) GTEST_SKIP() << "no CUDA device or no NCCL";
  async::Runtime rt;
  auto r = rt.block_on([]() -> async::Task<Result<bool>> {
    const StoreOptions store_options{.host = "127.0.0.1", .port = 0, .host_server = true};
    COSHARD_CO_TRY_ASSIGN(auto store, co_await TcpStore::connect(store_options));
    COSHARD_CO_TRY_ASSIGN(auto comm, co_await make_nccl_communicator(*store, 0, 1, async::Device::cuda(0)));
    COSHARD_CO_TRY_ASSIGN(auto alloc, async::CachingAllocator::create(async::Device::cuda(0)));
    constexpr std::size_t n = 1 << 20;
    COSHARD_CO_TRY_ASSIGN(async::Block send, alloc->allocate(n * 4, comm->stream()));
    COSHARD_CO_TRY_ASSIGN(async::Block recv, alloc->allocate(n * 4, comm->stream()));
    std::vector<float> host(n, 1.5f), back(n, 0.0f);
    COSHARD_CO_TRY(comm->stream().copy(send.data(), host.data(), n * 4));
    auto group = Coalesced{}.all_reduce(send.data(), recv.data(), n, DataType::f32, ReduceOp::sum).barrier();
    COSHARD_CO_TRY_ASSIGN(async::Event done, comm->launch(group));
    COSHARD_CO_TRY(comm->stream().copy(back.data(), recv.data(), n * 4));
    COSHARD_CO_TRY_ASSIGN(async::Event copied, comm->stream().record());
    COSHARD_CO_TRY(co_await copied);
    COSHARD_CO_TRY(comm->status());
    co_return back == host;
  }());
  ASSERT_TRUE(r.has_value()) << r.error().message();
  EXPECT_TRUE(*r);
}

}  // namespace
}  // namespace coshard::collectives
