// run_on_ranks: the per-rank harness (threads, or the launcher's process) with each rank's
// stream, allocator and context kept in place and torn down after the stream is drained.
#include "coshard/zero/ranks.hpp"

#include <algorithm>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/cpu_threads.hpp"

namespace coshard::zero {

namespace {

// One rank, on the calling thread's runtime: its pieces, `fn`, then the drain and teardown.
async::Task<Result<void>> run_rank(int rank, int world, collectives::Communicator& comm, const RunOnRanksOptions& o,
                                   const RankFunction& fn) {
  COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(comm.stream().device()));
  COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(comm.stream().device()));
  COSHARD_CO_TRY_ASSIGN(auto ctx, modules::Context::create(stream, *allocator, o.context));
  Rank r{rank, world, comm, stream, *allocator, ctx};
  auto done = co_await fn(r);
  // Nothing the function enqueued may still run when its buffers' owners go.
  auto drained = stream.synchronize();
  auto comm_drained = comm.stream().synchronize();
  if (!done) co_return done;
  if (!drained) co_return fail(std::move(drained).error().with_context("draining the compute stream"));
  if (!comm_drained) co_return fail(std::move(comm_drained).error().with_context("draining the communication stream"));
  co_return Result<void>{};
}

}  // namespace

Result<void> run_on_ranks(const RunOnRanksOptions& o, const RankFunction& fn) {
  COSHARD_TRY_ASSIGN(const auto env, collectives::read_launch_env());
  const bool launched = env.launcher != collectives::Launcher::none;
  if (!launched && (o.world < 1 || o.world > 1024))
    return fail(ErrorCode::invalid_argument, "run_on_ranks: world=", o.world, ": expected 1 to 1024 ranks as threads");
  const int in_process = launched ? 1 : o.world;
  if (o.cpu_math_threads < 0)
    return fail(ErrorCode::invalid_argument, "run_on_ranks: cpu_math_threads=", o.cpu_math_threads, ": expected >= 0");
  modules::set_cpu_math_threads(o.cpu_math_threads > 0 ? o.cpu_math_threads
                                                       : modules::default_cpu_math_threads(in_process * env.local_size));
  if (launched) {
    async::Runtime rt;
    COSHARD_TRY_ASSIGN(auto comm, collectives::communicator_from_env(rt, o.from_env));
    auto done = rt.block_on(run_rank(comm->rank(), comm->size(), *comm, o, fn));
    if (!done) return fail(std::move(done).error().with_context("rank " + std::to_string(env.rank)));
    return {};
  }
  COSHARD_TRY_ASSIGN(auto comms, collectives::make_local_communicators(o.world, {.device = o.device}));
  std::mutex mutex;
  std::vector<std::pair<int, Error>> errors;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(o.world));
  for (int r = 0; r < o.world; ++r)
    threads.emplace_back([&, r] {
      async::Runtime rt;
      auto done = rt.block_on(run_rank(r, o.world, *comms[static_cast<std::size_t>(r)], o, fn));
      if (!done) {
        // The others would wait for this rank at their next collective until the timeout.
        comms[static_cast<std::size_t>(r)]->abort(done.error().message());
        std::lock_guard lock(mutex);
        errors.emplace_back(r, std::move(done).error());
      }
    });
  for (auto& t : threads) t.join();
  if (errors.empty()) return {};
  std::sort(errors.begin(), errors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string message;
  for (const auto& [rank, error] : errors)
    message += (message.empty() ? "" : "; ") + ("rank " + std::to_string(rank) + ": " + error.message());
  return fail(errors.front().second.code(), message);
}

}  // namespace coshard::zero
