// A Llama (make_llama, tied embeddings) through the Trainer on Local ranks (threads, CPU):
// stages 0-3 at world sizes 1-4, with activation checkpointing on and off, the optimizer and the
// parameters offloaded. The losses are those of the unsharded model on the whole batch (the same
// bits on one rank; within 1e-6 relative otherwise), checkpointing changes no bit, and it lowers
// the activation memory each step reports.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "coshard/trainer/trainer.hpp"
#include "../support/on_ranks.hpp"

namespace coshard::trainer {
namespace {

using modules::ActivationCheckpointing;
using modules::DataType;
using modules::Shape;
using modules::Tensor;

constexpr modules::LlamaConfig kModel{.vocab = 48, .max_seq = 8, .dim = 32, .layers = 3, .heads = 4, .kv_heads = 2,
                                      .head_dim = 8, .intermediate = 48, .rope_theta = 10000.0,
                                      .tie_embeddings = true};
constexpr std::int64_t kBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr std::int64_t kSeq = 8;
constexpr int kSteps = 4;

TrainerConfig base_config() {
  TrainerConfig c;
  c.lr = 1e-2f;
  c.weight_decay = 0.01f;
  c.max_grad_norm = 0;  // no clipping: each element's update is its own
  c.prefetch_bucket_bytes = 1 << 20;
  c.max_live_bytes = 64 << 10;  // stage 3: fewer units at once than the model has
  c.seed = 3;
  return c;
}

const SyntheticTask& task() {
  static const SyntheticTask t(kModel.vocab, 17);
  return t;
}

Result<modules::Batch> upload(modules::Context& ctx, const HostBatch& b) {
  COSHARD_TRY_ASSIGN(Tensor tokens, ctx.upload(std::as_bytes(std::span(b.tokens)), Shape{b.rows, b.seq}, DataType::i32));
  COSHARD_TRY_ASSIGN(Tensor targets, ctx.upload(std::as_bytes(std::span(b.targets)), Shape{b.rows, b.seq}, DataType::i32));
  return modules::Batch{tokens, targets};
}

// The unsharded model on the whole batch: a ParameterStore and one optimizer group.
std::vector<double> reference_losses(const TrainerConfig& c) {
  async::Runtime rt;
  auto stream = async::Stream::create(async::Device::cpu());
  auto allocator = async::CachingAllocator::create(async::Device::cpu());
  auto ctx = modules::Context::create(*stream, **allocator);
  auto out = rt.block_on([&]() -> async::Task<Result<std::vector<double>>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama(kModel));
    COSHARD_CO_TRY_ASSIGN(auto store, modules::ParameterStore::create(*ctx, *model, DataType::f32));
    COSHARD_CO_TRY(co_await store.initialize(*ctx, c.seed));
    modules::AdamWOptions a;
    a.weight_decay = c.weight_decay.value_or(a.weight_decay);
    COSHARD_CO_TRY_ASSIGN(auto opt, modules::Optimizer::adamw(a, c.step_control()));
    COSHARD_CO_TRY(opt->add_group(*ctx, store.values(), store.grads()));
    modules::CrossEntropyLoss loss;
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      COSHARD_CO_TRY_ASSIGN(auto b, upload(*ctx, task().batch(static_cast<std::uint64_t>(step), kBatch, kSeq)));
      COSHARD_CO_TRY(store.zero_grad(*ctx));
      COSHARD_CO_TRY_ASSIGN(Tensor value, co_await modules::forward_backward(*ctx, *model, loss, b.inputs, b.targets,
                                                                            opt->loss_scale()));
      COSHARD_CO_TRY(opt->step(*ctx, c.lr_at(step)));
      COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx->read(value));
      losses.push_back(host[0]);
    }
    co_return losses;
  }());
  (void)(*stream).synchronize();
  EXPECT_TRUE(out) << out.error().message();
  return out ? *out : std::vector<double>{};
}

struct Run {
  std::vector<StepStats> stats;  // rank 0's
  std::size_t units = 0;
};

Result<Run> train(int world, const TrainerConfig& c) {
  Run run;
  std::mutex mutex;
  auto errors = ::coshard::testing::on_ranks(world, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama(kModel));
    TrainerBuilder builder(c);
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    std::vector<StepStats> stats;
    for (int step = 0; step < kSteps; ++step) {
      const auto global = task().batch(static_cast<std::uint64_t>(step), kBatch, kSeq);
      COSHARD_CO_TRY_ASSIGN(auto s, co_await t.step(global.rank_rows(rank, comm.size())));
      stats.push_back(std::move(s));
    }
    if (rank == 0) {
      std::lock_guard lock(mutex);
      run.stats = std::move(stats);
      run.units = t.engine().units().size();
    }
    co_return Result<void>{};
  });
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return run;
}

std::vector<double> losses_of(const Run& r) {
  std::vector<double> out;
  for (const auto& s : r.stats) out.push_back(s.loss);
  return out;
}

void expect_matches_reference(const std::vector<double>& losses, const std::vector<double>& reference, int world) {
  ASSERT_EQ(losses.size(), reference.size());
  for (std::size_t i = 0; i < losses.size(); ++i) {
    if (world == 1)
      EXPECT_EQ(losses[i], reference[i]) << "step " << i << ": one rank gives the unsharded bits";
    else
      EXPECT_LE(std::abs(losses[i] - reference[i]), 1e-6 * std::abs(reference[i])) << "step " << i;
  }
}

class LlamaStages : public ::testing::TestWithParam<int> {};

TEST_P(LlamaStages, MatchTheUnshardedModelWithAndWithoutCheckpointing) {
  const int stage = GetParam();
  const auto reference = reference_losses(base_config());
  ASSERT_EQ(reference.size(), static_cast<std::size_t>(kSteps));
  EXPECT_LT(reference.back(), reference.front()) << "the loss falls";
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE("world size " + std::to_string(world));
    TrainerConfig c = base_config();
    c.zero_stage = stage;
    auto plain = train(world, c);
    ASSERT_TRUE(plain) << plain.error().message();
    expect_matches_reference(losses_of(*plain), reference, world);
    for (int every : {1, 2}) {
      SCOPED_TRACE("checkpointing every " + std::to_string(every));
      c.activation_checkpointing = ActivationCheckpointing{every};
      auto checkpointed = train(world, c);
      ASSERT_TRUE(checkpointed) << checkpointed.error().message();
      EXPECT_EQ(losses_of(*checkpointed), losses_of(*plain)) << "recomputing changes no bit";
      EXPECT_EQ(checkpointed->units, plain->units);
      for (int step = 0; step < kSteps; ++step) {
        const auto& with = checkpointed->stats[static_cast<std::size_t>(step)];
        const auto& without = plain->stats[static_cast<std::size_t>(step)];
        EXPECT_GT(with.peak_activation_bytes, 0u);
        EXPECT_LT(with.peak_activation_bytes, without.peak_activation_bytes) << "step " << step;
        // The recompute's gathers are in the recorded trace: after the first step it holds.
        if (step > 0) EXPECT_FALSE(with.trace_changed) << "step " << step;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, LlamaStages, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return "Stage" + std::to_string(info.param); });

// Stage 3 with the optimizer and the parameters in host memory, checkpointing every block.
TEST(LlamaTraining, OffloadWithCheckpointingGivesTheSameLosses) {
  const auto reference = reference_losses(base_config());
  TrainerConfig c = base_config();
  c.zero_stage = 3;
  c.offload_optimizer.device = OffloadDevice::cpu;
  c.offload_params.device = OffloadDevice::cpu;
  c.activation_checkpointing = ActivationCheckpointing{1};
  for (int world : {1, 2}) {
    SCOPED_TRACE("world size " + std::to_string(world));
    auto run = train(world, c);
    ASSERT_TRUE(run) << run.error().message();
    expect_matches_reference(losses_of(*run), reference, world);
  }
  // Each unit stepped on the host as its last gradient comes out: a recompute is not a use, so
  // the tied table waits for its two gradients and every block for its one.
  c.step_in_backward = true;
  auto stepped = train(2, c);
  ASSERT_TRUE(stepped) << stepped.error().message();
  expect_matches_reference(losses_of(*stepped), reference, 2);
}

// Two micro-batches a step, each recomputed in its own backward: the whole batch's losses.
TEST(LlamaTraining, GradientAccumulationWithCheckpointingGivesTheSameLosses) {
  const auto reference = reference_losses(base_config());
  TrainerConfig c = base_config();
  c.zero_stage = 3;
  c.gradient_accumulation_steps = 2;
  c.activation_checkpointing = ActivationCheckpointing{1};
  auto run = train(2, c);
  ASSERT_TRUE(run) << run.error().message();
  expect_matches_reference(losses_of(*run), reference, 2);
}

// Three fewer blocks' activations at full checkpointing: the measured peak falls by more than a
// block's worth, and the stage-3 recompute gathers each checkpointed unit once more.
TEST(LlamaTraining, CheckpointingRegathersItsUnitsInsideTheBudgetAtStageThree) {
  TrainerConfig c = base_config();
  c.zero_stage = 3;
  c.max_live_bytes = 16 << 10;  // barely above the largest unit: no unit kept beside another for long
  auto plain = train(2, c);
  ASSERT_TRUE(plain) << plain.error().message();
  c.activation_checkpointing = ActivationCheckpointing{1};
  auto checkpointed = train(2, c);
  ASSERT_TRUE(checkpointed) << checkpointed.error().message();
  EXPECT_EQ(losses_of(*checkpointed), losses_of(*plain));
  const auto& with = checkpointed->stats.back();
  const auto& without = plain->stats.back();
  EXPECT_GT(with.gathered_bytes, without.gathered_bytes) << "the recompute gathers the blocks' units again";
  EXPECT_LE(with.peak_live_bytes, c.max_live_bytes);
}

// Small modules coalesced into units (module granularity): no unit spans a checkpointed block's
// edge, so every recompute meets the first and last module of each unit it runs.
TEST(LlamaTraining, CoalescedUnitsStopAtCheckpointedBlocks) {
  const auto reference = reference_losses(base_config());
  TrainerConfig c = base_config();
  c.zero_stage = 3;
  c.module_granularity_bytes = 16 << 10;  // norms and small projections share units
  for (int every : {1, 2}) {
    SCOPED_TRACE("checkpointing every " + std::to_string(every));
    c.activation_checkpointing = ActivationCheckpointing{every};
    auto run = train(2, c);
    ASSERT_TRUE(run) << run.error().message();
    expect_matches_reference(losses_of(*run), reference, 2);
  }
}

// With a reuse distance the recomputed units stay gathered for their backward (budget allowing).
TEST(LlamaTraining, AReuseDistanceKeepsRecomputedUnitsForTheirBackward) {
  TrainerConfig c = base_config();
  c.zero_stage = 3;
  c.max_live_bytes = 1 << 20;
  c.activation_checkpointing = ActivationCheckpointing{1};
  auto regathered = train(2, c);
  ASSERT_TRUE(regathered) << regathered.error().message();
  c.max_reuse_distance = 16;
  auto kept = train(2, c);
  ASSERT_TRUE(kept) << kept.error().message();
  EXPECT_EQ(losses_of(*kept), losses_of(*regathered));
  EXPECT_LT(kept->stats.back().gathered_bytes, regathered->stats.back().gathered_bytes);
}

}  // namespace
}  // namespace coshard::trainer
