// A small MLP trained by the engine on 1-8 ranks as threads, with the engine's options a test
// varies (quantized gathers and reductions, the secondary partition, offload, hybrid sharding,
// coalescing, accumulation, activation checkpointing, checkpoints): each rank's first loss of each
// step, the step's losses and counters, and the weights gathered exactly before and after.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/ops.hpp"
#include "coshard/zero/engine.hpp"
#include "on_ranks.hpp"
#include "regression_mlp.hpp"

namespace coshard::testing::engine_mlp {

using ::coshard::testing::kMlpFeatures;
using ::coshard::testing::kMlpOutputs;
using ::coshard::testing::kMlpRows;
using modules::DataType;
using modules::Init;
using modules::Tensor;
using zero::EngineOptions;
using zero::GatheredParameter;
using zero::OffloadTarget;
using zero::Quantization;
namespace fs = std::filesystem;

constexpr std::int64_t kHidden = 96;  // fc2: 9312 values, several blocks of 64 in each rank's shard

inline Result<std::unique_ptr<modules::Sequential>> make_model(bool freeze_first, bool checkpoint_fc2 = false) {
  auto net = std::make_unique<modules::Sequential>();
  net->add("fc1", std::make_unique<modules::Linear>(kMlpFeatures, kHidden, true, Init::normal(0.3)));
  net->add("act1", std::make_unique<modules::Gelu>());
  auto fc2 = std::make_unique<modules::Linear>(kHidden, kHidden, true, Init::normal(0.1));
  if (checkpoint_fc2)
    net->add("fc2", std::make_unique<modules::Checkpointed>(std::move(fc2)));
  else
    net->add("fc2", std::move(fc2));
  net->add("act2", std::make_unique<modules::Gelu>());
  net->add("head", std::make_unique<modules::Linear>(kHidden, kMlpOutputs, true, Init::normal(0.2)));
  if (freeze_first) COSHARD_TRY(net->set_trainable_matching("fc1.*", false));
  return net;
}

struct RunPlan {
  int world = 2;
  Quantization weights = Quantization::none;
  Quantization frozen = Quantization::none;
  std::int64_t block = 64;
  DataType dtype = DataType::f32;
  OffloadTarget optimizer = OffloadTarget::none;
  OffloadTarget params = OffloadTarget::none;
  int shard_group_size = 0;
  std::size_t granularity = 0;  // module_granularity_bytes
  int micro_batches = 1;
  bool freeze_first = false;
  bool same_rows = true;  // every rank the same rows (so the same loss) or its own
  float lr = 3e-2f;
  int steps = 4;
  int stage = 3;
  Quantization grads = Quantization::none;
  int secondary = 1;             // secondary_partition_ranks
  bool checkpoint_fc2 = false;   // fc2 under activation checkpointing (its forward replayed before its backward)
  std::size_t max_live_bytes = 64 << 10;
  fs::path load, save;
  std::string name() const {
    return "world " + std::to_string(world) + ", weights " + std::string(to_string(weights)) + ", frozen " +
           std::string(to_string(frozen)) + ", block " + std::to_string(block) + ", " +
           std::string(collectives::to_string(dtype)) + ", optimizer " + std::string(to_string(optimizer)) +
           ", parameters " + std::string(to_string(params)) + ", shard groups " + std::to_string(shard_group_size) +
           ", granularity " + std::to_string(granularity) + ", micro-batches " + std::to_string(micro_batches) +
           (freeze_first ? ", fc1 frozen" : "") + ", stage " + std::to_string(stage) + ", gradients " +
           std::string(to_string(grads)) + ", secondary " + std::to_string(secondary) +
           (checkpoint_fc2 ? ", fc2 checkpointed" : "") + ", max_live_bytes " + std::to_string(max_live_bytes);
  }
};

struct RunResult {
  std::vector<std::vector<std::vector<std::byte>>> rank_losses;  // [rank][step]: the first micro-batch's loss
  std::vector<double> losses;                                    // the step's mean (rank 0's stats)
  std::uint64_t gathered_bytes = 0;                              // rank 0's, over the steps
  std::uint64_t reduced_bytes = 0;                               // rank 0's reduce_scattered_bytes, over the steps
  std::uint64_t gathers = 0, secondary_gathers = 0, secondary_gathered_bytes = 0;  // rank 0's, over the steps
  std::uint64_t nvme_read_bytes = 0;                             // rank 0's reads from its NVMe store, over the steps
  std::map<std::string, std::vector<std::byte>> first, final;   // gathered exactly, before and after
};

using Gathered = std::vector<GatheredParameter>;
inline std::map<std::string, std::vector<std::byte>> by_name(const Gathered& g) {
  std::map<std::string, std::vector<std::byte>> out;
  for (const auto& p : g) out[p.name] = p.bytes;
  return out;
}

inline Result<RunResult> train(const RunPlan& k) {
  const auto scratch = fs::current_path() / "engine_mlp_scratch" /
                       ::testing::UnitTest::GetInstance()->current_test_info()->name();
  RunResult run;
  run.rank_losses.resize(static_cast<std::size_t>(k.world));
  std::mutex mutex;
  const auto errors = ::coshard::testing::on_ranks(k.world, [&](int r, collectives::Communicator& comm)
                                                                -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, modules::Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto model, make_model(k.freeze_first, k.checkpoint_fc2));
    COSHARD_CO_TRY_ASSIGN(auto opt, modules::Optimizer::adamw({.weight_decay = 0.1f}, {}));
    EngineOptions o;
    o.zero_stage = k.stage;
    o.dtype = k.dtype;
    o.quantize_gradients = k.grads;
    o.quantize_gradients_block = k.block;
    o.max_live_bytes = k.max_live_bytes;
    o.secondary_partition_ranks = k.secondary;
    o.prefetch_bucket_bytes = 48 << 10;
    o.quantize_weights = k.weights;
    o.quantize_frozen_weights = k.frozen;
    o.quantize_weights_block = k.block;
    o.offload_optimizer = k.optimizer;
    o.offload_params = k.params;
    o.offload_optimizer.nvme_path = scratch / ("rank" + std::to_string(r));
    o.shard_group_size = k.shard_group_size;
    o.module_granularity_bytes = k.granularity;
    COSHARD_CO_TRY_ASSIGN(auto engine, zero::Engine::create(ctx, comm, *model, *opt, o));
    COSHARD_CO_TRY(co_await engine->initialize(7));
    if (!k.load.empty()) COSHARD_CO_TRY(co_await engine->load_checkpoint(k.load));
    COSHARD_CO_TRY_ASSIGN(auto first, co_await engine->gather_parameters());
    modules::MeanSquaredErrorLoss loss;
    const std::int64_t rows = kMlpRows / k.world / k.micro_batches;
    for (int step = 0; step < k.steps; ++step) {
      COSHARD_CO_TRY(co_await engine->begin_step(k.micro_batches, k.lr));
      for (int m = 0; m < k.micro_batches; ++m) {
        const std::int64_t at = k.same_rows ? m * rows : (r * k.micro_batches + m) * rows;
        COSHARD_CO_TRY_ASSIGN(auto mb, ::coshard::testing::regression_rows(ctx, step, at, rows));
        if (k.dtype != DataType::f32) {
          COSHARD_CO_TRY_ASSIGN(mb.inputs, modules::ops::cast(ctx, mb.inputs, k.dtype));
          COSHARD_CO_TRY_ASSIGN(mb.targets, modules::ops::cast(ctx, mb.targets, k.dtype));
        }
        COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(*model, mb.inputs));
        loss.set_targets(mb.targets);
        COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, out));
        if (m == 0) {
          COSHARD_CO_TRY_ASSIGN(auto bytes, co_await ctx.read_bytes(value));
          run.rank_losses[static_cast<std::size_t>(r)].push_back(std::move(bytes));
        }
        COSHARD_CO_TRY_ASSIGN(Tensor dout, co_await ctx.backward(loss, engine->backward_seed()));
        COSHARD_CO_TRY(co_await ctx.backward(*model, dout));
        COSHARD_CO_TRY(engine->add_loss(value));
      }
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      if (r == 0) {
        run.losses.push_back(stats.loss);
        run.gathered_bytes += stats.gathered_bytes;
        run.reduced_bytes += stats.reduce_scattered_bytes;
        run.gathers += stats.gathers;
        run.secondary_gathers += stats.secondary_gathers;
        run.secondary_gathered_bytes += stats.secondary_gathered_bytes;
        run.nvme_read_bytes += stats.time_split.nvme_read_bytes;
      }
    }
    if (!k.save.empty()) {
      COSHARD_CO_TRY(co_await engine->save_checkpoint(k.save));
      COSHARD_CO_TRY(co_await engine->finish_checkpoint());
    }
    COSHARD_CO_TRY_ASSIGN(auto final, co_await engine->gather_parameters());
    if (r == 0) {
      std::lock_guard lock(mutex);
      run.first = by_name(first);
      run.final = by_name(final);
    }
    engine.reset();
    COSHARD_CO_TRY(stream.synchronize());
    co_return Result<void>{};
  });
  fs::remove_all(scratch);
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return run;
}

}  // namespace coshard::testing::engine_mlp
