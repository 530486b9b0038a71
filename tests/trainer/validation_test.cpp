// The Trainer's validation loss (#35 item 1): the mean over the same held-out batches through the
// engine's inference pass equals a forward-only loss computed directly on those batches by the
// unsharded model with the run's weights, at stages 0-3 and world sizes 1-3; evaluating never
// changes training (losses and weights bit for bit with evaluation on and off); misuse is named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "coshard/trainer/trainer.hpp"
#include "../support/on_ranks.hpp"

namespace coshard::trainer {
namespace {

constexpr modules::GptConfig kModel{.vocab = 32, .max_seq = 8, .dim = 16, .layers = 2, .heads = 2, .mlp_ratio = 2};
constexpr std::int64_t kBatch = 12;  // divisible by 1, 2, 3 ranks and 2 micro-batches
constexpr std::int64_t kSeq = 8;
constexpr int kSteps = 4;

const SyntheticTask& train_task() {
  static const SyntheticTask t(kModel.vocab, 11);
  return t;
}
// Held-out: the same vocabulary, another task's draws (what the trainer evaluates on).
const SyntheticTask& val_task() {
  static const SyntheticTask t(kModel.vocab, 12);
  return t;
}

TrainerConfig config(int stage, std::int64_t eval_every) {
  TrainerConfig c;
  c.zero_stage = stage;
  c.lr = 1e-2f;
  c.max_live_bytes = 64 << 20;
  c.seed = 5;
  c.eval_every = eval_every;
  c.eval_batches = 3;
  return c;
}

struct Run {
  std::vector<double> losses;
  std::vector<std::optional<double>> val_losses;  // per step (eval_every)
  double final_val = 0;                           // validation_loss after the last step
  std::vector<zero::GatheredParameter> params;
};

// kSteps steps of the tiny GPT on `world` ranks (threads), validating on val_task().
Result<Run> train(int world, TrainerConfig c, bool with_validation = true) {
  Run run;
  std::mutex mutex;
  const auto errors = ::coshard::testing::on_ranks(world, [&](int rank, collectives::Communicator& comm)
                                                              -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    TrainerBuilder builder(c);
    builder.communicator(comm);
    if (with_validation) builder.validation(val_task(), c.eval_every, c.eval_batches);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    Run mine;
    for (int i = 0; i < kSteps; ++i) {
      const auto global = train_task().batch(static_cast<std::uint64_t>(i), kBatch, kSeq);
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(global.rank_rows(rank, world)));
      mine.losses.push_back(stats.loss);
      mine.val_losses.push_back(stats.val_loss);
    }
    if (with_validation) {
      COSHARD_CO_TRY_ASSIGN(mine.final_val, co_await t.validation_loss(kBatch, kSeq));
    }
    COSHARD_CO_TRY_ASSIGN(mine.params, co_await t.engine().gather_parameters());
    if (rank == 0) {
      std::lock_guard lock(mutex);
      run = std::move(mine);
    }
    co_return Result<void>{};
  });
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return run;
}

// The unsharded model with `params`, forward only on val_task()'s first `batches` global batches
// (all rows at once): the mean of their losses.
Result<double> direct_validation_loss(const std::vector<zero::GatheredParameter>& params, std::int64_t batches) {
  async::Runtime rt;
  COSHARD_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
  COSHARD_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
  COSHARD_TRY_ASSIGN(auto ctx, modules::Context::create(stream, *allocator));
  auto result = rt.block_on([&]() -> async::Task<Result<double>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    COSHARD_CO_TRY_ASSIGN(auto store, modules::ParameterStore::create(ctx, *model, modules::DataType::f32));
    for (const auto& e : store.entries()) {
      const auto it = std::find_if(params.begin(), params.end(), [&](const auto& p) { return p.name == e.name; });
      if (it == params.end()) co_return fail(ErrorCode::internal, "no gathered ", e.name);
      COSHARD_CO_TRY(ctx.copy_from_host(store.values().slice(e.offset, e.parameter->shape()), it->bytes));
    }
    modules::CrossEntropyLoss loss;
    double sum = 0;
    for (std::int64_t b = 0; b < batches; ++b) {
      const HostBatch batch = val_task().batch(static_cast<std::uint64_t>(b), kBatch, kSeq);
      COSHARD_CO_TRY_ASSIGN(auto tokens, ctx.upload(std::as_bytes(std::span(batch.tokens)), modules::Shape{kBatch, kSeq},
                                                     modules::DataType::i32));
      COSHARD_CO_TRY_ASSIGN(auto targets, ctx.upload(std::as_bytes(std::span(batch.targets)), modules::Shape{kBatch, kSeq},
                                                      modules::DataType::i32));
      COSHARD_CO_TRY_ASSIGN(auto logits, co_await ctx.forward(*model, tokens));
      loss.set_targets(targets);
      COSHARD_CO_TRY_ASSIGN(auto value, co_await ctx.forward(loss, logits));
      COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx.read(value));
      sum += host.at(0);
      loss.clear_saved();
      model->clear_saved_recursive();
    }
    co_return sum / static_cast<double>(batches);
  }());
  (void)stream.synchronize();
  return result;
}

TEST(Validation, EqualsTheUnshardedForwardOnTheSameBatchesAtEveryStageAndWorldSize) {
  for (int stage = 0; stage <= 3; ++stage)
    for (int world = 1; world <= 3; ++world) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", world " + std::to_string(world));
      TrainerConfig c = config(stage, 2);
      if (world == 2) c.gradient_accumulation_steps = 2;  // (evaluated in the step's micro-batches too)
      auto run = train(world, c);
      ASSERT_TRUE(run) << run.error().message();
      // eval_every 2: after steps 2 and 4, nowhere else.
      ASSERT_EQ(run->val_losses.size(), static_cast<std::size_t>(kSteps));
      for (int i = 0; i < kSteps; ++i) EXPECT_EQ(run->val_losses[i].has_value(), (i + 1) % 2 == 0) << "step " << i + 1;
      // The last step's validation is the one asked for after it: the same weights.
      ASSERT_TRUE(run->val_losses.back());
      EXPECT_EQ(*run->val_losses.back(), run->final_val);
      auto direct = direct_validation_loss(run->params, 3);
      ASSERT_TRUE(direct) << direct.error().message();
      EXPECT_NEAR(run->final_val, *direct, 1e-6 * std::abs(*direct));
      EXPECT_LT(run->final_val, std::log(32.0) * 1.5) << "a loss, not garbage";
    }
}

TEST(Validation, NeverChangesTraining) {
  for (const int stage : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto with = train(2, config(stage, 1));
    auto without = train(2, config(stage, 0), false);
    ASSERT_TRUE(with && without);
    EXPECT_EQ(with->losses, without->losses);
    ASSERT_EQ(with->params.size(), without->params.size());
    for (std::size_t i = 0; i < with->params.size(); ++i)
      EXPECT_TRUE(with->params[i].bytes == without->params[i].bytes) << with->params[i].name;
    for (const auto& v : with->val_losses) EXPECT_TRUE(v.has_value());
    for (const auto& v : without->val_losses) EXPECT_FALSE(v.has_value());
  }
}

TEST(Validation, MisuseIsNamed) {
  TrainerConfig c = config(3, 0);
  c.eval_batches = 0;
  auto bad = c.validate();
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("eval_batches=0"), std::string::npos) << bad.error().message();
  c = config(3, -1);
  bad = c.validate();
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("eval_every=-1"), std::string::npos) << bad.error().message();

  const auto errors = ::coshard::testing::on_ranks(2, [&](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    TrainerBuilder plain(config(3, 0));
    plain.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await plain.build(*model));
    auto none = co_await t.validation_loss(kBatch, kSeq);
    if (none || none.error().message().find("no validation data") == std::string::npos)
      co_return fail(ErrorCode::internal, "validation without data: ", none ? "accepted" : none.error().message());
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
  const auto uneven = ::coshard::testing::on_ranks(2, [&](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    TrainerBuilder builder(config(3, 0));
    builder.communicator(comm).validation(val_task());
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    auto odd = co_await t.validation_loss(5, kSeq);
    if (odd || odd.error().message().find("5 rows of 8 tokens: expected rows that split evenly over 2 ranks") ==
                   std::string::npos)
      co_return fail(ErrorCode::internal, "5 rows over 2 ranks: ", odd ? "accepted" : odd.error().message());
    co_return Result<void>{};
  });
  EXPECT_TRUE(uneven.empty()) << uneven.front();
}

}  // namespace
}  // namespace coshard::trainer
