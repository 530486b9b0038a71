// Parameter shards placed by a device-memory budget (EngineOptions::device_memory_budget, with
// offload_params=cpu): as many units' shards as fit stay on the device, the first and last units
// first, the rest in pinned memory. Every split gives the same bits as every shard offloaded and
// as none offloaded (the shard's values are the same wherever they live; the optimizer steps the
// same masters), with the optimizer in pinned memory or on NVMe, in f32 and bf16; the engine's
// device memory grows by the kept shards only, within the budget; the estimate shows the split;
// a budget the rest of the plan exceeds, or one with another parameter offload, is refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "coshard/zero/engine.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "../support/on_ranks.hpp"
#include "../support/rank_engine.hpp"
#include "../support/regression_mlp.hpp"

namespace coshard::zero {
namespace {

using ::coshard::testing::kMlpFeatures;
using ::coshard::testing::kMlpHidden;
using ::coshard::testing::kMlpOutputs;
using ::coshard::testing::kMlpRows;
using modules::Init;
namespace fs = std::filesystem;

constexpr int kWorld = 2;

// Six units (five Linear layers and a head) so a budget can split them several ways.
Result<std::unique_ptr<modules::Sequential>> make_model() {
  auto net = std::make_unique<modules::Sequential>();
  net->add("fc1", std::make_unique<modules::Linear>(kMlpFeatures, kMlpHidden, true, Init::normal(0.3)));
  net->add("act1", std::make_unique<modules::Gelu>());
  for (int i = 2; i <= 5; ++i) {
    net->add("fc" + std::to_string(i), std::make_unique<modules::Linear>(kMlpHidden, kMlpHidden, true, Init::normal(0.2)));
    net->add("act" + std::to_string(i), std::make_unique<modules::Gelu>());
  }
  net->add("head", std::make_unique<modules::Linear>(kMlpHidden, kMlpOutputs, true, Init::normal(0.3)));
  return net;
}

EngineOptions options(OffloadTarget optimizer, OffloadTarget params, DataType dtype, std::size_t budget) {
  EngineOptions o;
  o.zero_stage = 3;
  o.max_live_bytes = 24 << 10;  // fewer units at once than the model has
  o.dtype = dtype;
  o.offload_optimizer = optimizer;
  o.offload_params = params;
  o.device_memory_budget = budget;
  return o;
}

struct Outcome {
  std::vector<double> losses;
  std::map<std::string, std::vector<std::byte>> final;
  std::vector<FetchUnitInfo> units;
  std::size_t peak_device_bytes = 0;  // rank 0's compute allocator: peak_requested_bytes
};

Result<Outcome> train(EngineOptions o, const std::string& tag) {
  const auto swap = fs::current_path() / "device_budget_scratch" / tag;
  Outcome out;
  const auto errors = ::coshard::testing::on_ranks(kWorld, [&](int r, collectives::Communicator& comm)
                                                                -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto model, make_model());
    modules::StepControlOptions control;
    control.max_grad_norm = 0.5f;
    COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw({.weight_decay = 0.1f}, control));
    EngineOptions mine = o;
    mine.offload_optimizer.nvme_path = swap / ("rank" + std::to_string(r));
    COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(ctx, comm, *model, *opt, mine));
    COSHARD_CO_TRY(co_await engine->initialize(11));
    modules::MeanSquaredErrorLoss loss;
    const std::int64_t rows = kMlpRows / kWorld;
    for (int step = 0; step < 4; ++step) {
      COSHARD_CO_TRY(co_await engine->begin_step(1, 3e-2f));
      COSHARD_CO_TRY_ASSIGN(auto mb, ::coshard::testing::regression_rows(ctx, step, r * rows, rows));
      COSHARD_CO_TRY(co_await ::coshard::testing::add_micro_batch(ctx, *engine, *model, loss, std::move(mb), o.dtype));
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      if (r == 0) out.losses.push_back(stats.loss);
    }
    COSHARD_CO_TRY_ASSIGN(auto gathered, co_await engine->gather_parameters());
    if (r == 0) {
      for (auto& p : gathered) out.final[p.name] = std::move(p.bytes);
      out.units = engine->units();
      out.peak_device_bytes = allocator->stats().peak_requested_bytes;
    }
    engine.reset();
    COSHARD_CO_TRY(stream.synchronize());
    co_return Result<void>{};
  });
  fs::remove_all(swap);
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return out;
}

Result<MemoryEstimate> estimate(const EngineOptions& o) {
  COSHARD_TRY_ASSIGN(auto model, make_model());
  return estimate_engine_memory(*model, kWorld, o, 2);
}

std::size_t shard_bytes(const FetchUnitInfo& u, DataType dtype) {
  return static_cast<std::size_t>(u.shard) * modules::size_of(dtype);
}

TEST(DeviceBudget, EverySplitGivesTheBitsOfFullAndOfNoOffload) {
  for (const OffloadTarget optimizer : {OffloadTarget::cpu, OffloadTarget::nvme}) {
    for (const DataType dtype : {DataType::f32, DataType::bf16}) {
      const std::string what = "optimizer " + std::string(to_string(optimizer)) + ", " +
                                std::string(collectives::to_string(dtype));
      SCOPED_TRACE(what);
      const std::string tag = std::string(to_string(optimizer)) + std::string(collectives::to_string(dtype));
      auto all_off = train(options(optimizer, OffloadTarget::cpu, dtype, 0), tag + "_all");
      ASSERT_TRUE(all_off) << all_off.error().message();
      auto none_off = train(options(optimizer, OffloadTarget::none, dtype, 0), tag + "_none");
      ASSERT_TRUE(none_off) << none_off.error().message();
      EXPECT_EQ(none_off->losses, all_off->losses);  // (the two ends agree: the baseline of the rest)
      EXPECT_EQ(none_off->final, all_off->final);
      for (const auto& u : all_off->units) EXPECT_TRUE(u.shard_offloaded) << u.name;

      // The rest of the plan (every shard offloaded) on the device, then budgets keeping 2, 3 and
      // all 6 units' shards there.
      auto base = estimate(options(optimizer, OffloadTarget::cpu, dtype, 0));
      ASSERT_TRUE(base);
      const std::size_t rest = base->bytes(MemoryPlace::device);
      const auto& units = all_off->units;
      ASSERT_EQ(units.size(), 6u);
      const std::size_t first_last = shard_bytes(units[0], dtype) + shard_bytes(units[5], dtype);
      const std::size_t three = first_last + shard_bytes(units[1], dtype);
      std::size_t every = 0;
      for (const auto& u : units) every += shard_bytes(u, dtype);
      for (const std::size_t kept : {first_last, three, every}) {
        const std::size_t budget = rest + kept;
        auto split = train(options(optimizer, OffloadTarget::cpu, dtype, budget), tag + "_split");
        ASSERT_TRUE(split) << split.error().message();
        EXPECT_EQ(split->losses, all_off->losses) << "budget " << budget;
        EXPECT_EQ(split->final, all_off->final) << "budget " << budget;
        std::size_t on_device = 0;
        for (const auto& u : split->units)
          if (!u.shard_offloaded) on_device += shard_bytes(u, dtype);
        EXPECT_EQ(on_device, kept) << "budget " << budget;
        EXPECT_FALSE(split->units.front().shard_offloaded);  // the first and last units first
        EXPECT_FALSE(split->units.back().shard_offloaded);
        if (kept == first_last) EXPECT_TRUE(split->units[1].shard_offloaded);
        // The device holds the kept shards on top of what full offload held (allocations are
        // rounded to 256 bytes), and the estimate stays within the budget.
        EXPECT_LE(split->peak_device_bytes, all_off->peak_device_bytes + kept + 256 * units.size()) << "budget " << budget;
        EXPECT_GE(split->peak_device_bytes, all_off->peak_device_bytes + kept) << "budget " << budget;
        auto with_budget = estimate(options(optimizer, OffloadTarget::cpu, dtype, budget));
        ASSERT_TRUE(with_budget);
        EXPECT_EQ(with_budget->bytes(MemoryPlace::device), budget);
      }
    }
  }
}

TEST(DeviceBudget, TheEstimateShowsTheSplit) {
  auto base = estimate(options(OffloadTarget::cpu, OffloadTarget::cpu, DataType::f32, 0));
  ASSERT_TRUE(base);
  const std::size_t rest = base->bytes(MemoryPlace::device);
  auto split = estimate(options(OffloadTarget::cpu, OffloadTarget::cpu, DataType::f32, rest + 1));  // room for none
  ASSERT_TRUE(split);
  EXPECT_EQ(split->bytes(MemoryPlace::device), rest);
  EXPECT_NE(split->describe().find("the parameter shards of 0 of 6 units on the device"), std::string::npos)
      << split->describe();
  auto roomy = estimate(options(OffloadTarget::cpu, OffloadTarget::cpu, DataType::f32, rest + (64u << 20)));
  ASSERT_TRUE(roomy);
  EXPECT_NE(roomy->describe().find("the parameter shards of 6 of 6 units on the device"), std::string::npos)
      << roomy->describe();
  EXPECT_NE(roomy->describe().find("parameter shards (f32)"), std::string::npos) << roomy->describe();
}

TEST(DeviceBudget, ABudgetTheRestExceedsOrAnotherOffloadIsRefusedByName) {
  auto base = estimate(options(OffloadTarget::cpu, OffloadTarget::cpu, DataType::f32, 0));
  ASSERT_TRUE(base);
  const std::size_t rest = base->bytes(MemoryPlace::device);
  auto small = train(options(OffloadTarget::cpu, OffloadTarget::cpu, DataType::f32, rest - 1), "small");
  ASSERT_FALSE(small);
  EXPECT_NE(small.error().message().find("device_memory_budget=" + std::to_string(rest - 1)), std::string::npos)
      << small.error().message();
  EXPECT_NE(small.error().message().find("needs " + std::to_string(rest) + " bytes"), std::string::npos)
      << small.error().message();
  for (const OffloadTarget params : {OffloadTarget::none, OffloadTarget::nvme}) {
    auto other = estimate(options(OffloadTarget::nvme, params, DataType::f32, 1 << 20));
    ASSERT_FALSE(other);
    EXPECT_NE(other.error().message().find("expected offload_params=cpu"), std::string::npos) << other.error().message();
  }
}

}  // namespace
}  // namespace coshard::zero
