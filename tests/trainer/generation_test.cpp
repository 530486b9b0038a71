// Trainer::generate (#35 item 2): greedy samples are the same unsharded, at stage 3 on 2 ranks
// and after a checkpoint resume; sampling is seeded; choose_token's rules; misuse named.
#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>
#include <random>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/trainer/trainer.hpp"
#include "../support/on_ranks.hpp"

namespace coshard::trainer {
namespace {

namespace fs = std::filesystem;

constexpr modules::GptConfig kGpt{.vocab = 32, .max_seq = 16, .dim = 16, .layers = 2, .heads = 2, .mlp_ratio = 2};
constexpr std::int64_t kBatch = 12, kSeq = 8;

const SyntheticTask& task() {
  static const SyntheticTask t(kGpt.vocab, 11);
  return t;
}

TrainerConfig config(int stage) {
  TrainerConfig c;
  c.zero_stage = stage;
  c.lr = 1e-2f;
  c.max_live_bytes = 64 << 20;
  c.seed = 5;
  return c;
}

struct Plan {
  int world = 1;
  int stage = 0;
  bool llama = false;
  int steps = 3;
  std::string save_to, load_from;
  SampleOptions sample{.tokens = 6, .temperature = 0.0f};
};

// `steps` steps (after loading `load_from`), then a sample of the prompt {1, 2, 3}: rank 0's tokens
// (every rank's must agree).
Result<std::vector<std::int32_t>> sample(const Plan& p) {
  std::vector<std::int32_t> out;
  std::mutex mutex;
  std::vector<std::vector<std::int32_t>> every(static_cast<std::size_t>(p.world));
  const auto errors = ::coshard::testing::on_ranks(p.world, [&](int rank, collectives::Communicator& comm)
                                                                -> async::Task<Result<void>> {
    std::unique_ptr<modules::Sequential> model;
    if (p.llama) {
      modules::LlamaConfig c;
      c.vocab = 32;
      c.max_seq = 16;
      c.dim = 16;
      c.heads = 4;
      c.kv_heads = 2;
      c.intermediate = 32;
      COSHARD_CO_TRY_ASSIGN(model, modules::make_llama(c));
    } else {
      COSHARD_CO_TRY_ASSIGN(model, modules::make_gpt(kGpt));
    }
    TrainerBuilder builder(config(p.stage));
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    if (!p.load_from.empty()) COSHARD_CO_TRY(co_await t.load_checkpoint(p.load_from));
    for (int i = 0; i < p.steps; ++i) {
      const auto global = task().batch(static_cast<std::uint64_t>(t.steps_done()), kBatch, kSeq);
      COSHARD_CO_TRY(co_await t.step(global.rank_rows(rank, comm.size())));
    }
    if (!p.save_to.empty()) {
      COSHARD_CO_TRY(co_await t.save_checkpoint(p.save_to));
      COSHARD_CO_TRY(co_await t.finish_checkpoint());
    }
    const std::vector<std::int32_t> prompt{1, 2, 3};
    COSHARD_CO_TRY_ASSIGN(auto tokens, co_await t.generate(prompt, p.sample));
    // Training goes on as before after a sample.
    const auto global = task().batch(static_cast<std::uint64_t>(t.steps_done()), kBatch, kSeq);
    COSHARD_CO_TRY(co_await t.step(global.rank_rows(rank, comm.size())));
    std::lock_guard lock(mutex);
    every[static_cast<std::size_t>(rank)] = tokens;
    co_return Result<void>{};
  });
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  for (const auto& tokens : every)
    if (tokens != every.front()) return fail(ErrorCode::internal, "ranks sampled different tokens");
  return every.front();
}

TEST(Generation, GreedyIsTheSameUnshardedAtStageThreeAndAfterAResume) {
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt");
    auto unsharded = sample({.world = 1, .stage = 0, .llama = llama});
    ASSERT_TRUE(unsharded) << unsharded.error().message();
    ASSERT_EQ(unsharded->size(), 6u);
    for (const auto id : *unsharded) EXPECT_TRUE(id >= 0 && id < 32) << id;
    auto stage3 = sample({.world = 2, .stage = 3, .llama = llama});
    ASSERT_TRUE(stage3) << stage3.error().message();
    EXPECT_EQ(*stage3, *unsharded);
    const fs::path dir = fs::current_path() / "generation_test_scratch" / (llama ? "llama" : "gpt");
    fs::remove_all(dir);
    auto saved = sample({.world = 2, .stage = 2, .llama = llama, .steps = 2, .save_to = dir.string()});
    ASSERT_TRUE(saved) << saved.error().message();
    auto resumed = sample({.world = 3, .stage = 1, .llama = llama, .steps = 1, .load_from = dir.string()});
    ASSERT_TRUE(resumed) << resumed.error().message();
    EXPECT_EQ(*resumed, *unsharded);
    fs::remove_all(dir);
  }
}

TEST(Generation, SamplingIsSeeded) {
  Plan p{.world = 2, .stage = 3, .sample = {.tokens = 8, .temperature = 1.5f, .top_k = 10, .seed = 9}};
  auto a = sample(p), b = sample(p);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a, *b);
  p.sample.seed = 10;
  auto c = sample(p);
  ASSERT_TRUE(c);
  EXPECT_NE(*a, *c) << "another seed, another draw (8 tokens at temperature 1.5)";
}

TEST(Generation, ChooseTokenFollowsItsRules) {
  std::mt19937_64 rng(1);
  const std::vector<double> logits{0.5, 2.0, 2.0, -1.0, 1.9};
  SampleOptions greedy{.temperature = 0.0f};
  EXPECT_EQ(*choose_token(logits, greedy, rng), 1) << "the most likely, the lowest id among equals";
  SampleOptions top2{.temperature = 1.0f, .top_k = 2};
  for (int i = 0; i < 200; ++i) {
    const auto id = *choose_token(logits, top2, rng);
    EXPECT_TRUE(id == 1 || id == 2) << id;
  }
  SampleOptions all{.temperature = 100.0f};
  std::vector<int> seen(logits.size());
  for (int i = 0; i < 2000; ++i) ++seen[static_cast<std::size_t>(*choose_token(logits, all, rng))];
  for (const int n : seen) EXPECT_GT(n, 200) << "a high temperature draws every token";
  const std::vector<double> none{NAN, -INFINITY};
  EXPECT_FALSE(choose_token(none, all, rng));
  EXPECT_FALSE(choose_token({}, all, rng));
  EXPECT_FALSE((SampleOptions{.tokens = 0}.validate()));
  EXPECT_FALSE((SampleOptions{.temperature = -1.0f}.validate()));
  EXPECT_FALSE((SampleOptions{.top_k = -2}.validate()));
}

TEST(Generation, MisuseIsNamed) {
  const auto errors = ::coshard::testing::on_ranks(1, [&](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kGpt));
    TrainerBuilder builder(config(3));
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    const std::vector<std::int32_t> bad{1, 40};
    auto out_of_range = co_await t.generate(bad, {.tokens = 2, .vocab = 32});
    if (out_of_range || out_of_range.error().message().find("prompt token 1 is id 40, not below the model's vocabulary of 32") ==
                            std::string::npos)
      co_return fail(ErrorCode::internal, "id 40: ", out_of_range ? "accepted" : out_of_range.error().message());
    auto empty = co_await t.generate({}, {.tokens = 2});
    if (empty || empty.error().message().find("an empty prompt") == std::string::npos)
      co_return fail(ErrorCode::internal, "empty prompt: ", empty ? "accepted" : empty.error().message());
    const std::vector<std::int32_t> long_prompt(12, 1);
    auto too_long = co_await t.generate(long_prompt, {.tokens = 8});  // 20 > the GPT's 16 positions
    if (too_long || too_long.error().message().find("exceeds max_positions 16") == std::string::npos)
      co_return fail(ErrorCode::internal, "20 positions: ", too_long ? "accepted" : too_long.error().message());
    // The trainer still trains and samples after those.
    const auto global = task().batch(0, kBatch, kSeq);
    COSHARD_CO_TRY(co_await t.step(global));
    const std::vector<std::int32_t> ok{1};
    COSHARD_CO_TRY(co_await t.generate(ok, {.tokens = 3, .temperature = 0.0f}));
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

}  // namespace
}  // namespace coshard::trainer
