// The mixture-of-experts tests' harness (moe_test.cpp, moe_expert_parallel_test.cpp): a small
// Mixtral- or Qwen3-MoE-style Llama trained under the engine on ranks as threads, its losses and
// every weight gathered, and the unsharded single-rank run of the same micro-batches to compare
// against. Header-only, private to those tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coshard/collectives/mesh.hpp"
#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/moe.hpp"
#include "coshard/zero/engine.hpp"
#include "../support/on_ranks.hpp"
#include "../support/token_batch.hpp"
#include "../support/value_differences.hpp"

namespace coshard::zero::moe_testing {
// (each test file its own copy: the reference runs are cached per file)
namespace {

namespace fs = std::filesystem;
using Values = std::map<std::string, std::vector<double>>;

constexpr std::int64_t kSequences = 24;  // the global batch: divides among 1-4 ranks x 1-2 micro-batches
constexpr std::int64_t kSeq = 8;
constexpr std::int64_t kVocab = 64;
constexpr float kLr = 1e-3f;

enum class Variant {
  mixtral,  // every layer sparse, top 2 renormalised, experts of the MLP's width
  qwen,     // Qwen3-MoE: a dense layer between sparse ones, top 2 not renormalised, narrower
            // experts, the query and key head norms
};

modules::LlamaConfig moe_llama(Variant v) {
  modules::LlamaConfig c;
  c.vocab = kVocab;
  c.max_seq = kSeq;
  c.dim = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.intermediate = 32;
  c.init_std = 0.1;
  c.moe.experts = 6;
  c.moe.top_k = 2;
  c.moe.aux_loss_coef = 0.05;  // the load-balancing loss on: its gradient reaches the routers
  if (v == Variant::mixtral) {
    c.layers = 2;
    c.family = modules::HfFamily::mixtral;
  } else {
    c.layers = 3;
    c.family = modules::HfFamily::qwen3_moe;
    c.qk_norm = true;
    c.moe.dense_layers = {1};
    c.moe.intermediate = 16;
    c.moe.renormalize = false;
  }
  return c;
}

struct Layout {
  int world = 1;
  int stage = 0;
  int micro_batches = 1;
  Variant variant = Variant::mixtral;
  bool coalesced = false;  // module_granularity_bytes: each expert one unit
  bool checkpointed = false;
  OffloadTarget optimizer = OffloadTarget::none;
  OffloadTarget params = OffloadTarget::none;
  bool disjoint = false;  // each rank's tokens routed to experts of its own
  bool every_expert = false;  // SparseMoe's every_expert_runs: every expert gathered each pass
  int expert_parallel = 1;    // the experts partitioned over this many ranks (a Mesh's expert groups)
  std::int64_t experts = 6;
  bool sgd = false;  // SGD with momentum (lr 0.05) instead of AdamW (lr 1e-3)
  int steps = 3;
  fs::path export_to{};  // export_safetensors after training
  fs::path init_from{};  // load_safetensors after initialize
  fs::path checkpoint_dir{};  // save a checkpoint after the last step, or with `resume` load one first
  bool resume = false;
  std::string name() const {
    return "world " + std::to_string(world) + ", stage " + std::to_string(stage) + ", " +
           std::to_string(micro_batches) + " micro-batches, " + (variant == Variant::mixtral ? "mixtral" : "qwen-style") +
           (coalesced ? ", coalesced experts" : "") + (checkpointed ? ", checkpointed" : "") + ", optimizer " +
           std::string(to_string(optimizer)) + ", parameters " + std::string(to_string(params)) +
           (disjoint ? ", disjoint routing" : "") +
           (expert_parallel > 1 ? ", expert-parallel " + std::to_string(expert_parallel) : std::string()) +
           (experts != 6 ? ", " + std::to_string(experts) + " experts" : std::string()) + (sgd ? ", SGD" : "");
  }
};

struct TrainedRun {
  std::vector<double> losses;
  Values whole;
  Values initial;  // after initialize (and the disjoint routing's weights)
  std::int64_t most_experts_used = 0;  // rank 0's, in any layer of any micro-batch
  std::vector<std::size_t> gathered_bytes;  // per step
  std::vector<FetchUnitInfo> units;
};

// Sequence s of step `step`. Disjoint routing: the first half of the sequences (rank 0's at world
// 2) use the lower half of the vocabulary, the others the upper half.
std::vector<std::int32_t> sequence(int step, std::int64_t s, bool disjoint) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(kSeq + 1));
  const std::int64_t span = disjoint ? kVocab / 2 : kVocab, base = disjoint && s >= kSequences / 2 ? kVocab / 2 : 0;
  for (std::int64_t i = 0; i <= kSeq; ++i)
    t[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(base + (s * 7 + i * (3 + s % 4) + step * 5) % span);
  return t;
}

Result<modules::Batch> batch(Context& ctx, int step, std::int64_t first, std::int64_t rows, bool disjoint) {
  return ::coshard::testing::token_batch(ctx, first, rows, kSeq, [&](std::int64_t s) { return sequence(step, s, disjoint); });
}

Values to_values(const std::vector<GatheredParameter>& gathered) {
  Values v;
  for (const auto& g : gathered) {
    auto& out = v[g.name];
    out.resize(g.bytes.size() / sizeof(float));
    for (std::size_t i = 0; i < out.size(); ++i) {
      float f = 0;
      std::memcpy(&f, g.bytes.data() + 4 * i, 4);
      out[i] = f;
    }
  }
  return v;
}

// Disjoint routing: the lower half of the vocabulary has +4 in dimension 0 of its embedding, the
// upper half -4, every token +4 in dimension 1; each router sends dimension 0's sign to experts
// 0-1 (+) or 2-3 (-) and turns experts 4-5 away from dimension 1: nobody routes to 4 or 5.
void steer(std::vector<GatheredParameter>& params) {
  auto add = [](GatheredParameter& p, std::int64_t row, std::int64_t col, float value) {
    const std::size_t at = static_cast<std::size_t>(row * p.shape[1] + col) * 4;
    float f = 0;
    std::memcpy(&f, p.bytes.data() + at, 4);
    f += value;
    std::memcpy(p.bytes.data() + at, &f, 4);
  };
  for (auto& p : params) {
    if (p.name == "embed.weight") {
      for (std::int64_t t = 0; t < kVocab; ++t) {
        add(p, t, 0, t < kVocab / 2 ? 4.0f : -4.0f);
        add(p, t, 1, 4.0f);
      }
    } else if (p.name.ends_with("moe.router.weight")) {
      for (std::int64_t e = 0; e < p.shape[0]; ++e) add(p, e, e < 4 ? 0 : 1, e < 2 ? 3.0f : -3.0f);
    }
  }
}

Result<TrainedRun> train(const Layout& k) {
  const auto swap = fs::current_path() / "moe_scratch" / ::testing::UnitTest::GetInstance()->current_test_info()->name();
  auto config = moe_llama(k.variant);
  config.moe.every_expert_runs = k.every_expert;
  config.moe.experts = k.experts;
  TrainedRun run;
  std::mutex mutex;
  const auto errors = ::coshard::testing::on_ranks(k.world, [&](int r, collectives::Communicator& world)
                                                                -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto mesh, collectives::Mesh::create(world, {.expert = k.expert_parallel}));
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama_expert_parallel(config, mesh.expert()));
    if (k.checkpointed) modules::apply_activation_checkpointing(*model, {.every = 1});
    COSHARD_CO_TRY_ASSIGN(auto opt, k.sgd ? Optimizer::sgd({.momentum = 0.9f}) : Optimizer::adamw({.weight_decay = 0.1f}));
    const float lr = k.sgd ? 0.05f : kLr;
    EngineOptions o;
    o.zero_stage = k.stage;
    o.max_live_bytes = 48 << 10;  // stage 3: fewer units at once than the model has
    o.offload_optimizer = k.optimizer;
    o.offload_params = k.params;
    if (k.coalesced) o.module_granularity_bytes = 16 << 10;  // an expert's three matrices, and more, per unit
    o.offload_optimizer.nvme_path = swap / ("rank" + std::to_string(r));
    COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(ctx, world, *model, *opt, o));
    COSHARD_CO_TRY(co_await engine->initialize(7));
    if (!k.init_from.empty()) COSHARD_CO_TRY(co_await engine->load_safetensors(k.init_from));
    if (k.resume) COSHARD_CO_TRY(co_await engine->load_checkpoint(k.checkpoint_dir));
    if (k.disjoint) {
      COSHARD_CO_TRY_ASSIGN(auto params, co_await engine->gather_parameters());
      steer(params);
      const Engine::ParameterReader read = [params]() -> Result<std::vector<GatheredParameter>> { return params; };
      COSHARD_CO_TRY(co_await engine->load_parameters_from("steering the routers", read));
    }
    {  // (with expert parallelism each run of ranks gathers its own experts: merged by name)
      COSHARD_CO_TRY_ASSIGN(auto initial, co_await engine->gather_parameters());
      std::lock_guard lock(mutex);
      run.initial.merge(to_values(initial));
    }
    auto balance = modules::find_router_balance(*model);
    if (!balance) co_return fail(ErrorCode::internal, "the MoE model has no router balance");
    modules::CrossEntropyLoss cross_entropy;
    modules::RouterAuxLoss loss(cross_entropy, balance);
    const std::int64_t rows = kSequences / k.world / k.micro_batches;
    for (int step = static_cast<int>(engine->steps_done()); step < k.steps; ++step) {
      COSHARD_CO_TRY(co_await engine->begin_step(k.micro_batches, lr));
      for (int m = 0; m < k.micro_batches; ++m) {
        COSHARD_CO_TRY_ASSIGN(auto mb, batch(ctx, step, (r * k.micro_batches + m) * rows, rows, k.disjoint));
        COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(*model, mb.inputs));
        loss.set_targets(mb.targets);
        COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, out));
        for (const auto& layer : balance->layer_loads())
          if (r == 0) run.most_experts_used = std::max(run.most_experts_used, layer.experts_used);
        COSHARD_CO_TRY_ASSIGN(Tensor dout, co_await ctx.backward(loss, engine->backward_seed()));
        COSHARD_CO_TRY(co_await ctx.backward(*model, dout));
        COSHARD_CO_TRY(engine->add_loss(value));
      }
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      if (r == 0) {
        run.losses.push_back(stats.loss);
        run.gathered_bytes.push_back(stats.gathered_bytes);
      }
    }
    if (!k.export_to.empty()) COSHARD_CO_TRY(co_await engine->export_safetensors(k.export_to));
    if (!k.checkpoint_dir.empty() && !k.resume) {
      COSHARD_CO_TRY(co_await engine->save_checkpoint(k.checkpoint_dir));
      COSHARD_CO_TRY(co_await engine->finish_checkpoint());
    }
    COSHARD_CO_TRY_ASSIGN(auto gathered, co_await engine->gather_parameters());
    {
      std::lock_guard lock(mutex);
      run.whole.merge(to_values(gathered));
      if (r == 0) run.units = engine->units();
    }
    engine.reset();
    COSHARD_CO_TRY(stream.synchronize());
    co_return Result<void>{};
  });
  fs::remove_all(swap);
  if (!errors.empty()) {
    std::string all;
    for (const auto& e : errors) all += (all.empty() ? "" : "\n") + e;
    return fail(ErrorCode::internal, all);
  }
  return run;
}

using ::coshard::testing::relative;

void expect_close(const TrainedRun& got, const TrainedRun& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (std::size_t i = 0; i < got.losses.size(); ++i)
    EXPECT_LE(relative(got.losses[i], want.losses[i]), 1e-6)
        << what << ": step " << i << " loss " << got.losses[i] << ", expected " << want.losses[i];
  const auto [most, where] = ::coshard::testing::largest_difference(got.whole, want.whole, what);
  EXPECT_LE(most, 1e-6) << what << ": the parameters differ by " << most << " at " << where;
  std::printf("%s: losses and parameters within %.2g\n", what.c_str(), most);
}

// The unsharded single-rank run of the same micro-batches: world x micro_batches of them a step.
const TrainedRun& reference(const Layout& k) {
  static std::map<std::string, TrainedRun> runs;
  const int micro = k.world * k.micro_batches;
  const std::string key = std::to_string(micro) + "|" + std::to_string(static_cast<int>(k.variant)) + "|" +
                          std::to_string(k.disjoint) + "|" + std::to_string(k.experts) + "|" + std::to_string(k.sgd);
  auto it = runs.find(key);
  if (it == runs.end()) {
    auto run = train({.world = 1, .stage = 0, .micro_batches = micro, .variant = k.variant, .disjoint = k.disjoint,
                      .experts = k.experts, .sgd = k.sgd});
    EXPECT_TRUE(run) << run.error().message();
    it = runs.emplace(key, run ? std::move(*run) : TrainedRun{}).first;
  }
  return it->second;
}

}  // namespace
}  // namespace coshard::zero::moe_testing
