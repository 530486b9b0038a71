// zero::run_on_ranks: the per-rank harness a loop of one's own needs (#32 item 8): each rank its
// place, stream, allocator and context; a failed rank named and its peers not left waiting.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "coshard/modules/layers.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/zero/ranks.hpp"
#include "../support/regression_mlp.hpp"

namespace coshard::zero {
namespace {

TEST(RunOnRanks, EachRankGetsItsPlaceAndPiecesAndTrainsAnEngine) {
  std::mutex mutex;
  std::set<int> seen;
  std::vector<std::vector<double>> losses(2);
  auto done = run_on_ranks({.world = 2}, [&](Rank& r) -> async::Task<Result<void>> {
    {
      std::lock_guard lock(mutex);
      seen.insert(r.rank);
    }
    EXPECT_EQ(r.world, 2);
    EXPECT_EQ(r.comm.rank(), r.rank);
    EXPECT_EQ(&r.ctx.stream(), &r.stream);
    modules::Sequential model;
    model.add("fc1", std::make_unique<modules::Linear>(6, ::coshard::testing::kMlpHidden));
    model.add("act", std::make_unique<modules::Gelu>());
    model.add("fc2", std::make_unique<modules::Linear>(::coshard::testing::kMlpHidden, 2));
    COSHARD_CO_TRY_ASSIGN(auto optimizer, modules::Optimizer::adamw({.weight_decay = 0}));
    COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(r.ctx, r.comm, model, *optimizer, {.zero_stage = 3}));
    COSHARD_CO_TRY(co_await engine->initialize(3));
    modules::MeanSquaredErrorLoss loss;
    const std::int64_t rows = ::coshard::testing::kMlpRows / 2;
    for (int step = 0; step < 8; ++step) {
      COSHARD_CO_TRY_ASSIGN(auto b, ::coshard::testing::regression_rows(r.ctx, 0, r.rank * rows, rows));
      COSHARD_CO_TRY(co_await engine->begin_step(1, 2e-2f));
      COSHARD_CO_TRY_ASSIGN(auto out, co_await r.ctx.forward(model, b.inputs));
      loss.set_targets(b.targets);
      COSHARD_CO_TRY_ASSIGN(auto value, co_await r.ctx.forward(loss, out));
      COSHARD_CO_TRY_ASSIGN(auto dout, co_await r.ctx.backward(loss, engine->backward_seed()));
      COSHARD_CO_TRY(co_await r.ctx.backward(model, dout));
      COSHARD_CO_TRY(engine->add_loss(value));
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      losses[static_cast<std::size_t>(r.rank)].push_back(stats.loss);
    }
    co_return Result<void>{};  // the engine goes here, the streams are drained after
  });
  ASSERT_TRUE(done) << done.error().message();
  EXPECT_EQ(seen, (std::set<int>{0, 1}));
  EXPECT_EQ(losses[0], losses[1]) << "the mean over ranks, the same on each";
  EXPECT_LT(losses[0].back(), losses[0].front());
}

// Rank 1 fails before a collective its peer waits in: the peer is released at once (the failed
// rank aborts the group) rather than after the collective's timeout, and the error names rank 1.
TEST(RunOnRanks, AFailedRankIsNamedAndItsPeerIsNotLeftWaiting) {
  auto done = run_on_ranks({.world = 2}, [](Rank& r) -> async::Task<Result<void>> {
    if (r.rank == 1) co_return fail(ErrorCode::invalid_argument, "rank one's own mistake");
    std::vector<float> x(4, 1.0f);
    COSHARD_CO_TRY_ASSIGN(auto e, r.comm.all_reduce(x.data(), x.data(), x.size(), DataType::f32,
                                                     collectives::ReduceOp::sum, "a sum rank 1 never joins"));
    co_return co_await e;
  });
  ASSERT_FALSE(done);
  EXPECT_NE(done.error().message().find("rank 1: rank one's own mistake"), std::string::npos) << done.error().message();
  EXPECT_EQ(done.error().code(), ErrorCode::closed) << "rank 0's error (the abort) comes first: " << done.error().message();
}

TEST(RunOnRanks, BadOptionsAreNamed) {
  auto none = run_on_ranks({.world = 0}, [](Rank&) -> async::Task<Result<void>> { co_return Result<void>{}; });
  ASSERT_FALSE(none);
  EXPECT_NE(none.error().message().find("world=0: expected 1 to 1024 ranks as threads"), std::string::npos)
      << none.error().message();
  auto threads = run_on_ranks({.world = 1, .cpu_math_threads = -1},
                              [](Rank&) -> async::Task<Result<void>> { co_return Result<void>{}; });
  ASSERT_FALSE(threads);
  EXPECT_NE(threads.error().message().find("cpu_math_threads=-1"), std::string::npos) << threads.error().message();
}

}  // namespace
}  // namespace coshard::zero
