// One rank's regression MLP, AdamW and ZeRO engine on a CPU stream of its own, trained with the
// mean squared error in a loop of the test's own: the shape of the engine tests that need a
// whole run (checkpoints, logging).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "coshard/modules/ops.hpp"
#include "coshard/zero/engine.hpp"
#include "regression_mlp.hpp"

namespace coshard::testing {

using zero::Context;
using zero::Engine;
using zero::EngineOptions;
using zero::OffloadTarget;
using zero::Optimizer;
using zero::Tensor;

constexpr float kLr = 3e-2f;

struct Plan {
  int world = 1;
  int stage = 3;
  OffloadTarget optimizer = OffloadTarget::none;
  OffloadTarget params = OffloadTarget::none;
  std::size_t prefetch_bucket_bytes = 0;  // 0: fetch on demand only
  std::string name() const {
    return "world " + std::to_string(world) + ", stage " + std::to_string(stage) + ", optimizer " +
           std::string(zero::to_string(optimizer)) + ", parameters " + std::string(zero::to_string(params));
  }
};

// One micro-batch of a step under `engine`: forward and backward through `model` and `loss`
// (the batch cast to `dtype` first, as the model computes in the engine's), its loss added.
inline async::Task<Result<void>> add_micro_batch(Context& ctx, Engine& engine, modules::Module& model,
                                                 modules::MeanSquaredErrorLoss& loss, modules::Batch mb,
                                                 modules::DataType dtype = modules::DataType::f32) {
  if (dtype != modules::DataType::f32) {
    COSHARD_CO_TRY_ASSIGN(mb.inputs, modules::ops::cast(ctx, mb.inputs, dtype));
    COSHARD_CO_TRY_ASSIGN(mb.targets, modules::ops::cast(ctx, mb.targets, dtype));
  }
  COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(model, mb.inputs));
  loss.set_targets(mb.targets);
  COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, out));
  COSHARD_CO_TRY_ASSIGN(Tensor dout, co_await ctx.backward(loss, engine.backward_seed()));
  COSHARD_CO_TRY(co_await ctx.backward(model, dout));
  co_return engine.add_loss(value);
}

// One rank's model, optimizer and engine on a CPU stream of its own.
struct RankEngine {
  std::unique_ptr<async::Stream> stream;
  std::unique_ptr<async::CachingAllocator> allocator;
  std::unique_ptr<Context> ctx;
  std::unique_ptr<modules::Sequential> model;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<Engine> engine;

  static Result<RankEngine> make(collectives::Communicator& comm, const Plan& plan, const std::filesystem::path& swap) {
    RankEngine e;
    COSHARD_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    e.stream = std::make_unique<async::Stream>(std::move(stream));
    COSHARD_TRY_ASSIGN(e.allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_TRY_ASSIGN(auto ctx, Context::create(*e.stream, *e.allocator));
    e.ctx = std::make_unique<Context>(std::move(ctx));
    COSHARD_TRY_ASSIGN(e.model, make_regression_mlp());
    COSHARD_TRY_ASSIGN(e.optimizer, Optimizer::adamw({}));
    EngineOptions o;
    o.zero_stage = plan.stage;
    o.max_live_bytes = 4 << 10;  // stage 3: fewer units at once than the model has
    o.offload_optimizer = plan.optimizer;
    o.offload_params = plan.params;
    o.prefetch_bucket_bytes = plan.prefetch_bucket_bytes;
    o.offload_optimizer.nvme_path = swap / ("rank" + std::to_string(comm.rank()));
    COSHARD_TRY_ASSIGN(e.engine, Engine::create(*e.ctx, comm, *e.model, *e.optimizer, o));
    return e;
  }
  ~RankEngine() {
    engine.reset();
    optimizer.reset();
    if (stream) (void)stream->synchronize();
  }
  RankEngine() = default;
  RankEngine(RankEngine&&) noexcept = default;

  // Steps [first, first + count) of the global batch, this rank's rows; the step losses.
  async::Task<Result<std::vector<double>>> train(int first, int count) {
    const int world = engine->world_size();
    const std::int64_t rows = kMlpRows / world;
    modules::MeanSquaredErrorLoss loss;
    std::vector<double> losses;
    for (int step = first; step < first + count; ++step) {
      COSHARD_CO_TRY(co_await engine->begin_step(1, kLr));
      COSHARD_CO_TRY_ASSIGN(auto mb, regression_rows(*ctx, step, engine->rank() * rows, rows));
      COSHARD_CO_TRY(co_await add_micro_batch(*ctx, *engine, *model, loss, std::move(mb)));
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      losses.push_back(stats.loss);
    }
    co_return losses;
  }
};

}  // namespace coshard::testing
