// Running a loop of your own on every rank, without the harness each program wrote by hand:
// threads and runtimes (or this process under a launcher), and each rank's stream, allocator and
// context made, kept in place and torn down in the right order.
//
//   auto ok = coshard::zero::run_on_ranks({.world = 2}, [&](coshard::zero::Rank& r)
//                                             -> coshard::async::Task<coshard::Result<void>> {
//     auto engine = co_await ... zero::Engine::create(r.ctx, r.comm, model, *optimizer, options);
//     ...                                        // your loop: begin_step / forward / backward
//     co_return coshard::Result<void>{};        // (drop the engine before returning)
//   });
//
// What must outlive what (the same when you write the harness yourself):
//   - a Context keeps pointers to its Stream and CachingAllocator: they must not move or be
//     destroyed while the Context (or anything made from it) is in use;
//   - an Engine keeps references to the context, the communicator, the model and the optimizer:
//     destroy it first;
//   - work is enqueued, not done: before buffers, the engine or the context go, the stream must
//     have passed every use (Stream::synchronize, or an awaited event), and before the process
//     exits every stream must be drained. run_on_ranks drains each rank's stream after your
//     function returns, whatever it returned, before it destroys the context, the allocator and
//     the stream (in that order).
#pragma once

#include <functional>

#include "coshard/async/device.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/task.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/modules/module.hpp"

namespace coshard::zero {

// One rank's place and its pieces, made before your function runs and kept in place (never
// moved) until after it returns.
struct Rank {
  int rank = 0;
  int world = 1;
  collectives::Communicator& comm;
  async::Stream& stream;                // the compute stream, on comm's device
  async::CachingAllocator& allocator;  // the device memory parameters and activations come from
  modules::Context& ctx;                // made from the two above
};

struct RunOnRanksOptions {
  // Ranks as threads of this process on the Local backend, when no launcher started it. Under
  // mpirun, srun or torchrun the launcher's world is used instead and this is ignored.
  int world = 1;
  // The threads' device (CUDA: they share GPU 0 through the Local backend's device path).
  async::Device device = async::Device::cpu();
  // Under a launcher: the backend and its options (communicator_from_env).
  collectives::FromEnvOptions from_env;
  modules::ContextOptions context;
  // OpenBLAS threads for the CPU's products: 0 = the cores divided by the ranks in this process
  // (ranks as threads on the same cores otherwise each start one per core: 2.1x slower on 2).
  int cpu_math_threads = 0;
};

using RankFunction = std::function<async::Task<Result<void>>(Rank&)>;

// Runs `fn` once per rank: as `options.world` threads (each with its own Runtime) or, under a
// launcher, once in this process as the launcher's rank. Returns when every rank has returned;
// the error names each rank that failed ("rank 1: ..."), its setup included.
Result<void> run_on_ranks(const RunOnRanksOptions& options, const RankFunction& fn);

}  // namespace coshard::zero
