// Any model and loss, through the Trainer and through a loop the test owns: a small regression
// MLP with a module of the test's own (float features in, float targets out) and the mean
// squared error, at every stage, world sizes 1-4, both fetch modes,
// the optimizer and the parameters offloaded, gradient accumulation: its losses are those of the
// unsharded model on the whole batch (within 1e-6 relative; the same bits on one rank).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>
#include <tuple>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "coshard/trainer/trainer.hpp"
#include "../support/on_ranks.hpp"
#include "../support/regression_mlp.hpp"

namespace coshard::trainer {
namespace {

using modules::DataType;
using modules::Shape;
using modules::Tensor;

using ::coshard::testing::kMlpRows;
constexpr std::int64_t kRows = kMlpRows;
constexpr int kSteps = 8;

using ::coshard::testing::OwnModule;
// On the CPU the model's own module is ScaleShift; on CUDA GatedLinear (the public ops).
Result<std::unique_ptr<modules::Sequential>> make_mlp(async::Device device = async::Device::cpu()) {
  return ::coshard::testing::make_regression_mlp(device.is_cpu() ? OwnModule::scale_shift : OwnModule::gated_linear);
}
Result<modules::Batch> rows_of(modules::Context& ctx, int step, std::int64_t first, std::int64_t count) {
  return ::coshard::testing::regression_rows(ctx, step, first, count);
}

TrainerConfig base_config() {
  TrainerConfig c;
  c.lr = 3e-2f;
  c.max_grad_norm = 0;  // no clipping: every element's update is its own
  c.seed = 7;
  return c;
}

// The unsharded model on the whole batch: ParameterStore, one optimizer group.
std::vector<double> reference_losses(const TrainerConfig& c, async::Device device = async::Device::cpu()) {
  async::Runtime rt;
  auto stream = async::Stream::create(device);
  auto allocator = async::CachingAllocator::create(device);
  auto ctx = modules::Context::create(*stream, **allocator);
  auto out = rt.block_on([&]() -> async::Task<Result<std::vector<double>>> {
    COSHARD_CO_TRY_ASSIGN(auto model, make_mlp(device));
    COSHARD_CO_TRY_ASSIGN(auto store, modules::ParameterStore::create(*ctx, *model, DataType::f32));
    COSHARD_CO_TRY(co_await store.initialize(*ctx, c.seed));
    modules::AdamWOptions a;
    a.weight_decay = c.weight_decay.value_or(a.weight_decay);
    COSHARD_CO_TRY_ASSIGN(auto opt, modules::Optimizer::adamw(a, c.step_control()));
    COSHARD_CO_TRY(opt->add_group(*ctx, store.values(), store.grads()));
    modules::MeanSquaredErrorLoss loss;
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      COSHARD_CO_TRY_ASSIGN(auto b, rows_of(*ctx, step, 0, kRows));
      COSHARD_CO_TRY(store.zero_grad(*ctx));
      COSHARD_CO_TRY_ASSIGN(Tensor value, co_await modules::forward_backward(*ctx, *model, loss, b.inputs, b.targets,
                                                                            opt->loss_scale()));
      COSHARD_CO_TRY(opt->step(*ctx, c.lr_at(step)));
      COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx->read(value));
      losses.push_back(host[0]);
    }
    co_return losses;
  }());
  EXPECT_TRUE(out) << out.error().message();
  (void)(*stream).synchronize();
  return out ? *out : std::vector<double>{};
}

// `body(rank, comm)` on `world` Local ranks (tests/support/on_ranks.hpp); the first error.
Result<void> on_ranks(int world, const ::coshard::testing::RankBody& body, async::Device device = async::Device::cpu()) {
  const auto errors = ::coshard::testing::on_ranks(world, body, device);
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return {};
}

// The same through Trainers on `world` Local ranks, each with its own MeanSquaredErrorLoss and
// its rows of every step; rank 0's losses.
Result<std::vector<double>> trainer_losses(const TrainerConfig& c, int world) {
  std::vector<double> losses;
  COSHARD_TRY(on_ranks(world, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, make_mlp());
    modules::MeanSquaredErrorLoss loss;
    TrainerBuilder builder(c);
    builder.communicator(comm).loss(loss);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    const std::int64_t rows = kRows / world;
    for (int step = 0; step < kSteps; ++step) {
      COSHARD_CO_TRY_ASSIGN(auto mine, rows_of(t.context(), step, r * rows, rows));
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(mine));
      if (stats.tokens != kRows) co_return fail(ErrorCode::internal, "counted ", stats.tokens, " samples");
      if (r == 0) losses.push_back(stats.loss);
    }
    co_return Result<void>{};
  }));
  return losses;
}

// The same with a loop of the test's own over the engine (no Trainer): begin_step, the model's
// forward, the loss, backward through the context, add_loss, finish_step.
Result<std::vector<double>> user_loop_losses(const TrainerConfig& c, int world,
                                             async::Device device = async::Device::cpu()) {
  std::vector<double> losses;
  COSHARD_TRY(on_ranks(world, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(device));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(device));
    COSHARD_CO_TRY_ASSIGN(auto ctx, modules::Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto model, make_mlp(device));
    modules::AdamWOptions a;
    a.weight_decay = c.weight_decay.value_or(a.weight_decay);
    COSHARD_CO_TRY_ASSIGN(auto optimizer, modules::Optimizer::adamw(a, c.step_control()));
    COSHARD_CO_TRY_ASSIGN(auto engine, zero::Engine::create(ctx, comm, *model, *optimizer, c.engine_options()));
    COSHARD_CO_TRY(co_await engine->initialize(c.seed));
    modules::MeanSquaredErrorLoss loss;
    const int k = c.gradient_accumulation_steps;
    const std::int64_t rows = kRows / world / k;
    for (int step = 0; step < kSteps; ++step) {
      COSHARD_CO_TRY(co_await engine->begin_step(k, c.lr_at(step)));
      for (int m = 0; m < k; ++m) {
        COSHARD_CO_TRY_ASSIGN(auto mb, rows_of(ctx, step, (r * k + m) * rows, rows));
        COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(*model, mb.inputs));
        loss.set_targets(mb.targets);
        COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, out));
        COSHARD_CO_TRY_ASSIGN(Tensor dout, co_await ctx.backward(loss, engine->backward_seed()));
        COSHARD_CO_TRY(co_await ctx.backward(*model, dout));
        COSHARD_CO_TRY(engine->add_loss(value));
      }
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      if (r == 0) losses.push_back(stats.loss);
    }
    engine.reset();
    COSHARD_CO_TRY(stream.synchronize());
    co_return Result<void>{};
  }, device));
  return losses;
}

// The same loop on the GPU (ranks as threads sharing it, the Local backend on device memory),
// with GatedLinear as the model's own module: its losses are the unsharded model's on the GPU.
TEST(RegressionMlpOnCuda, UserLoopLossesAreTheUnshardedModels) {
  if (!async::cuda_compiled() || async::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const async::Device gpu = async::Device::cuda(0);
  TrainerConfig c = base_config();
  c.max_live_bytes = 8 << 10;  // stage 3: fewer units at once than the model has (GatedLinear's is 4 KiB)
  const auto reference = reference_losses(c, gpu);
  ASSERT_EQ(reference.size(), static_cast<std::size_t>(kSteps));
  EXPECT_LT(reference.back(), 0.7 * reference.front()) << "the reference learns";
  const auto swap = std::filesystem::current_path() / "custom_model_scratch" / "cuda";
  for (const auto& [stage, world, offload] : {std::tuple{3, 1, OffloadDevice::none}, std::tuple{3, 2, OffloadDevice::none},
                                              std::tuple{2, 2, OffloadDevice::none}, std::tuple{3, 2, OffloadDevice::cpu},
                                              std::tuple{1, 4, OffloadDevice::nvme}}) {
    SCOPED_TRACE("stage " + std::to_string(stage) + ", world " + std::to_string(world) + ", optimizer offload " +
                 std::to_string(static_cast<int>(offload)));
    std::filesystem::remove_all(swap);
    c.zero_stage = stage;
    c.offload_optimizer.device = offload;
    c.offload_optimizer.nvme_path = swap;
    auto losses = user_loop_losses(c, world, gpu);
    ASSERT_TRUE(losses) << losses.error().message();
    ASSERT_EQ(losses->size(), reference.size());
    for (std::size_t i = 0; i < reference.size(); ++i)
      EXPECT_NEAR((*losses)[i], reference[i], 1e-6 * std::abs(reference[i])) << "step " << i;
  }
  std::filesystem::remove_all(swap);
}

struct Case {
  std::string name;
  int world;
  int stage;
  zero::FetchMode fetch = zero::FetchMode::all_gather;
  OffloadDevice offload_optimizer = OffloadDevice::none;
  OffloadDevice offload_params = OffloadDevice::none;
  int accumulation = 1;
};

class RegressionMlp : public ::testing::TestWithParam<Case> {};

TEST_P(RegressionMlp, LossesAreTheUnshardedModels) {
  const Case k = GetParam();
  TrainerConfig c = base_config();
  const auto reference = reference_losses(c);
  ASSERT_EQ(reference.size(), static_cast<std::size_t>(kSteps));
  EXPECT_LT(reference.back(), 0.7 * reference.front()) << "the reference learns";
  c.zero_stage = k.stage;
  c.fetch_mode = k.fetch;
  c.gradient_accumulation_steps = k.accumulation;
  c.max_live_bytes = 4 << 10;  // stage 3: fewer units at once than the model has
  c.offload_optimizer.device = k.offload_optimizer;
  c.offload_params.device = k.offload_params;
  const auto swap = std::filesystem::current_path() / "custom_model_scratch" / k.name;
  std::filesystem::remove_all(swap);
  c.offload_optimizer.nvme_path = swap;
  c.offload_params.nvme_path = swap;
  for (const bool own_loop : {false, true}) {
    SCOPED_TRACE(own_loop ? "a loop of the test's own over the engine" : "the Trainer");
    std::filesystem::remove_all(swap);
    auto losses = own_loop ? user_loop_losses(c, k.world) : trainer_losses(c, k.world);
    ASSERT_TRUE(losses) << losses.error().message();
    ASSERT_EQ(losses->size(), reference.size());
    for (std::size_t i = 0; i < reference.size(); ++i) {
      if (k.world == 1 && k.accumulation == 1) EXPECT_EQ((*losses)[i], reference[i]) << "step " << i;  // the same bits
      EXPECT_NEAR((*losses)[i], reference[i], 1e-6 * std::abs(reference[i])) << "step " << i;
    }
  }
}

using F = zero::FetchMode;
using O = OffloadDevice;
INSTANTIATE_TEST_SUITE_P(
    Plans, RegressionMlp,
    ::testing::Values(Case{"stage1_world1", 1, 1}, Case{"stage2_world1", 1, 2}, Case{"stage3_world1", 1, 3},
                      Case{"stage1_world2", 2, 1}, Case{"stage2_world3", 3, 2}, Case{"stage3_world2", 2, 3},
                      Case{"stage3_world3", 3, 3}, Case{"stage3_world4", 4, 3},
                      Case{"stage3_world4_all_reduce", 4, 3, F::all_reduce},
                      Case{"stage2_world2_accumulating", 2, 2, F::all_gather, O::none, O::none, 2},
                      Case{"stage3_world2_offload_cpu", 2, 3, F::all_gather, O::cpu},
                      Case{"stage2_world2_offload_nvme", 2, 2, F::all_gather, O::nvme},
                      Case{"stage3_world2_params_cpu", 2, 3, F::all_gather, O::cpu, O::cpu},
                      Case{"stage3_world2_params_nvme", 2, 3, F::all_gather, O::nvme, O::nvme, 2}),
    [](const auto& info) { return info.param.name; });

// The wrong targets for a loss, and rows that do not split, are named errors.
TEST(RegressionMlp, MismatchedBatchesAreRefusedByName) {
  auto comms = collectives::make_local_communicators(1);
  ASSERT_TRUE(comms);
  async::Runtime rt;
  auto done = rt.block_on([&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, make_mlp());
    modules::MeanSquaredErrorLoss loss;
    TrainerConfig c = base_config();
    c.gradient_accumulation_steps = 5;
    TrainerBuilder builder(c);
    builder.communicator(*comms->front()).loss(loss);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    COSHARD_CO_TRY_ASSIGN(auto b, rows_of(t.context(), 0, 0, kRows));
    auto uneven = co_await t.step(b);
    EXPECT_FALSE(uneven);
    if (!uneven) co_return Result<void>{};
    EXPECT_NE(uneven.error().message().find("12 rows on this rank do not split into gradient_accumulation_steps=5"),
              std::string::npos)
        << uneven.error().message();
    COSHARD_CO_TRY_ASSIGN(auto five, rows_of(t.context(), 0, 0, 5));
    const modules::Batch wrong{five.inputs, five.inputs};  // targets of the features' width, not the outputs'
    auto refused = co_await t.step(wrong);
    EXPECT_FALSE(refused);
    if (!refused) co_return Result<void>{};
    EXPECT_NE(refused.error().message().find("MeanSquaredErrorLoss: targets f32[1, 6]"), std::string::npos)
        << refused.error().message();
    co_return Result<void>{};
  }());
  ASSERT_TRUE(done) << done.error().message();
}

::testing::AssertionResult names(const Result<void>& r, const std::string& expect) {
  if (r) return ::testing::AssertionFailure() << "no error, expected one naming '" << expect << "'";
  if (r.error().message().find(expect) == std::string::npos)
    return ::testing::AssertionFailure() << "'" << r.error().message() << "' lacks '" << expect << "'";
  return ::testing::AssertionSuccess();
}

template <class T>
Result<void> status_of(const Result<T>& r) {
  if (r) return {};
  return fail(r.error());
}

// Every misuse of the loop is a named error, and a misused step changes nothing: the next
// proper steps give the losses of a run without the misuse.
TEST(UserLoop, MisuseIsANamedErrorAndChangesNothing) {
  auto comms = collectives::make_local_communicators(1);
  ASSERT_TRUE(comms);
  async::Runtime rt;
  auto stream = async::Stream::create(async::Device::cpu());
  auto allocator = async::CachingAllocator::create(async::Device::cpu());
  const TrainerConfig c = base_config();
  auto done = rt.block_on([&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto ctx, modules::Context::create(*stream, **allocator));
    COSHARD_CO_TRY_ASSIGN(auto model, make_mlp());
    COSHARD_CO_TRY_ASSIGN(auto optimizer, modules::Optimizer::adamw({}, c.step_control()));
    COSHARD_CO_TRY_ASSIGN(auto engine, zero::Engine::create(ctx, *comms->front(), *model, *optimizer, c.engine_options()));
    COSHARD_CO_TRY(co_await engine->initialize(c.seed));
    modules::MeanSquaredErrorLoss loss;
    COSHARD_CO_TRY_ASSIGN(auto b, rows_of(ctx, 0, 0, kRows));
    auto forward = [&]() -> async::Task<Result<Tensor>> {
      COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(*model, b.inputs));
      loss.set_targets(b.targets);
      co_return co_await ctx.forward(loss, out);
    };
    auto backward = [&]() -> async::Task<Result<void>> {
      COSHARD_CO_TRY_ASSIGN(Tensor dout, co_await ctx.backward(loss, engine->backward_seed()));
      COSHARD_CO_TRY(co_await ctx.backward(*model, dout));
      co_return Result<void>{};
    };

    EXPECT_TRUE(names(status_of(co_await forward()), "Engine: forward of Sequential outside a step or an inference pass"));
    EXPECT_TRUE(names(status_of(co_await engine->finish_step()), "Engine::finish_step without begin_step"));
    // A step with no backward: abandoned, nothing updated.
    COSHARD_CO_TRY(co_await engine->begin_step(1, c.lr));
    EXPECT_TRUE(names(co_await engine->begin_step(1, c.lr), "Engine::begin_step: a step is open"));
    COSHARD_CO_TRY(status_of(co_await forward()));
    EXPECT_TRUE(names(status_of(co_await engine->finish_step()),
                      "no backward in this step: 1 forward and 0 backward passes of the model in a step begun with 1"));
    // A second micro-batch not declared as accumulation.
    COSHARD_CO_TRY(co_await engine->begin_step(1, c.lr));
    COSHARD_CO_TRY(status_of(co_await forward()));
    COSHARD_CO_TRY(co_await backward());
    EXPECT_TRUE(names(status_of(co_await forward()), "forward of micro-batch 2 in a step begun with 1"));
    co_await engine->abandon_step();
    // A backward in an inference pass; a forward there is fine.
    COSHARD_CO_TRY(engine->begin_inference());
    COSHARD_CO_TRY(status_of(co_await forward()));
    EXPECT_TRUE(names(co_await backward(), "outside a step (in an inference pass: forward only)"));
    COSHARD_CO_TRY(co_await engine->end_inference());
    // The hooks of a model the engine never sharded: its parameters have no memory.
    COSHARD_CO_TRY_ASSIGN(auto stranger, make_mlp());
    EXPECT_TRUE(names(status_of(co_await ctx.forward(*stranger, b.inputs)), "is not bound to memory"));

    // Nothing above changed the weights: the proper steps now are a fresh run's.
    std::vector<double> after_misuse;
    for (int step = 0; step < 3; ++step) {
      COSHARD_CO_TRY_ASSIGN(auto mb, rows_of(ctx, step, 0, kRows));
      b = mb;
      COSHARD_CO_TRY(co_await engine->begin_step(1, c.lr_at(step)));
      COSHARD_CO_TRY_ASSIGN(Tensor value, co_await forward());
      COSHARD_CO_TRY(co_await backward());
      COSHARD_CO_TRY(engine->add_loss(value));
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      after_misuse.push_back(stats.loss);
    }
    const auto reference = reference_losses(c);
    for (std::size_t i = 0; i < after_misuse.size(); ++i) EXPECT_EQ(after_misuse[i], reference[i]) << "step " << i;
    co_return Result<void>{};
  }());
  ASSERT_TRUE(done) << done.error().message();
  (void)(*stream).synchronize();
}

}  // namespace
}  // namespace coshard::trainer
