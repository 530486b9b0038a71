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

TEST(LaunchEnv, EachLauncherIsReadFromItsOwnVariables) {
  auto none = read_launch_env(getter({}));
  ASSERT_TRUE(none.has_value());
  EXPECT_EQ(none->launcher, Launcher::none);
  EXPECT_EQ(none->world_size, 1);

  auto torchrun = read_launch_env(getter({{"WORLD_SIZE", "8"}, {"RANK", "5"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}}));
  ASSERT_TRUE(torchrun.has_value()) << torchrun.error().message();
  EXPECT_EQ(torchrun->launcher, Launcher::torchrun);
  EXPECT_EQ(torchrun->rank, 5);
  EXPECT_EQ(torchrun->local_size, 4);

  auto ompi = read_launch_env(getter({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "3"},
                                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  ASSERT_TRUE(ompi.has_value()) << ompi.error().message();
  EXPECT_EQ(ompi->launcher, Launcher::mpirun);
  EXPECT_EQ(ompi->rank, 3);
  EXPECT_EQ(ompi->world_size, 4);
  EXPECT_EQ(ompi->local_rank, 1);
  EXPECT_EQ(ompi->local_size, 2);
  EXPECT_EQ(ompi->describe(), "mpirun (rank 3 of 4, local rank 1)");

  auto hydra = read_launch_env(getter({{"PMI_SIZE", "2"}, {"PMI_RANK", "1"}, {"MPI_LOCALRANKID", "1"}}));
  ASSERT_TRUE(hydra.has_value()) << hydra.error().message();
  EXPECT_EQ(hydra->launcher, Launcher::mpirun);
  EXPECT_EQ(hydra->rank, 1);

  auto srun = read_launch_env(getter({{"SLURM_NTASKS", "16"}, {"SLURM_PROCID", "9"}, {"SLURM_LOCALID", "1"},
                                      {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS_PER_NODE", "8(x2)"}}));
  ASSERT_TRUE(srun.has_value()) << srun.error().message();
  EXPECT_EQ(srun->launcher, Launcher::srun);
  EXPECT_EQ(srun->rank, 9);
  EXPECT_EQ(srun->local_size, 8);
  // A batch script outside a job step is one process.
  auto batch = read_launch_env(getter({{"SLURM_NTASKS", "16"}, {"SLURM_PROCID", "0"}}));
  ASSERT_TRUE(batch.has_value());
  EXPECT_EQ(batch->launcher, Launcher::none);
  // torchrun under srun: torchrun's variables are the ranks'.
  auto both = read_launch_env(getter({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"SLURM_NTASKS", "1"}, {"SLURM_PROCID", "0"},
                                      {"SLURM_STEP_ID", "0"}}));
  ASSERT_TRUE(both.has_value());
  EXPECT_EQ(both->launcher, Launcher::torchrun);
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  auto rank = read_launch_env(getter({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "2"}}));
  ASSERT_FALSE(rank.has_value());
  EXPECT_NE(rank.error().message().find("OMPI_COMM_WORLD_RANK='2'"), std::string::npos) << rank.error().message();
  auto missing = read_launch_env(getter({{"PMI_SIZE", "2"}}));
  ASSERT_FALSE(missing.has_value());
  EXPECT_NE(missing.error().message().find("PMI_RANK is not"), std::string::npos) << missing.error().message();
  auto local = read_launch_env(getter({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"},
                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "x"}}));
  ASSERT_FALSE(local.has_value());
  EXPECT_NE(local.error().message().find("OMPI_COMM_WORLD_LOCAL_SIZE='x'"), std::string::npos);
}

TEST(ChooseBackend, EachLaunchGetsItsBackendAndARequestIsChecked) {
  LaunchEnv one;
  LaunchEnv mpirun{.launcher = Launcher::mpirun, .rank = 0, .world_size = 2};
  LaunchEnv torchrun{.launcher = Launcher::torchrun, .rank = 0, .world_size = 2};
  EXPECT_EQ(*choose_backend(one, Backend::automatic, false), Backend::local);
  EXPECT_EQ(*choose_backend(one, Backend::automatic, true), Backend::nccl);
  EXPECT_EQ(*choose_backend(mpirun, Backend::automatic, true), Backend::nccl);
  if (mpi_compiled()) {
    EXPECT_EQ(*choose_backend(mpirun, Backend::automatic, false), Backend::mpi);
    EXPECT_EQ(*choose_backend(mpirun, Backend::mpi, true), Backend::mpi);
  }
  auto cpu_torchrun = choose_backend(torchrun, Backend::automatic, false);
  ASSERT_FALSE(cpu_torchrun.has_value());
  EXPECT_NE(cpu_torchrun.error().message().find("mpirun -np 2"), std::string::npos) << cpu_torchrun.error().message();
  auto local = choose_backend(mpirun, Backend::local, false);
  ASSERT_FALSE(local.has_value());
  EXPECT_NE(local.error().message().find("mpirun (rank 0 of 2"), std::string::npos) << local.error().message();
  EXPECT_FALSE(choose_backend(one, Backend::nccl, false).has_value());
  EXPECT_FALSE(choose_backend(torchrun, Backend::mpi, false).has_value());
  EXPECT_EQ(*parse_backend("mpi"), Backend::mpi);
  EXPECT_EQ(*parse_backend("auto"), Backend::automatic);
  auto bad = parse_backend("gloo");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message().find("'gloo'"), std::string::npos);
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
