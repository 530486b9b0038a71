// Parameter shards and optimizer state placed by a device-memory budget
// (EngineOptions::device_memory_budget). With offload_params=cpu: as many units' shards as fit
// stay on the device, the first and last units first, the rest in pinned memory. Every split gives
// the same bits as every shard offloaded and as none offloaded (the shard's values are the same
// wherever they live; the optimizer steps the same masters), with the optimizer in pinned memory
// or on NVMe, in f32 and bf16; the engine's device memory grows by the kept shards only, within
// the budget; the estimate shows the split; a budget the rest of the plan exceeds, or one with
// another parameter offload, is refused by name. With offload_optimizer=cpu (Twin-Flow): then the
// optimizer state of as many units as fit steps on the device, at stages 1-3, with the bits of the
// optimizer all on the device and all on the host (but for the norm's rounding when clipping).
#include <gtest/gtest.h>

#include <cmath>
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

EngineOptions options(OffloadTarget optimizer, OffloadTarget params, DataType dtype, std::size_t budget, int stage = 3) {
  EngineOptions o;
  o.zero_stage = stage;
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

// Steps [first, first + count) under `o`, from the seed or from `load_from`; with `save_to`, a
// checkpoint after the last step.
Result<Outcome> train(EngineOptions o, const std::string& tag, float max_grad_norm = 0.5f, int first = 0, int count = 4,
                      const fs::path& load_from = {}, const fs::path& save_to = {}) {
  // Under the test's own name: ctest runs this file's tests side by side, and a swap folder is
  // locked by the run that writes it.
  const auto swap = fs::current_path() / "device_budget_scratch" /
                    ::testing::UnitTest::GetInstance()->current_test_info()->name() / tag;
  Outcome out;
  const auto errors = ::coshard::testing::on_ranks(kWorld, [&](int r, collectives::Communicator& comm)
                                                                -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto model, make_model());
    modules::StepControlOptions control;
    control.max_grad_norm = max_grad_norm;
    COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw({.weight_decay = 0.1f}, control));
    EngineOptions mine = o;
    mine.offload_optimizer.nvme_path = swap / ("rank" + std::to_string(r));
    COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(ctx, comm, *model, *opt, mine));
    if (load_from.empty()) {
      COSHARD_CO_TRY(co_await engine->initialize(11));
    } else {
      COSHARD_CO_TRY(co_await engine->load_checkpoint(load_from));
    }
    modules::MeanSquaredErrorLoss loss;
    const std::int64_t rows = kMlpRows / kWorld;
    for (int step = first; step < first + count; ++step) {
      COSHARD_CO_TRY(co_await engine->begin_step(1, 3e-2f));
      COSHARD_CO_TRY_ASSIGN(auto mb, ::coshard::testing::regression_rows(ctx, step, r * rows, rows));
      COSHARD_CO_TRY(co_await ::coshard::testing::add_micro_batch(ctx, *engine, *model, loss, std::move(mb), o.dtype));
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      if (r == 0) out.losses.push_back(stats.loss);
    }
    if (!save_to.empty()) {
      COSHARD_CO_TRY(co_await engine->save_checkpoint(save_to));
      COSHARD_CO_TRY(co_await engine->finish_checkpoint());
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

// The units whose optimizer state the budget kept on the device (trained units only).
std::vector<std::string> kept_state(const std::vector<FetchUnitInfo>& units) {
  std::vector<std::string> kept;
  for (const auto& u : units)
    if (!u.frozen && !u.optimizer_offloaded) kept.push_back(u.name);
  return kept;
}

// Budgets from "nothing kept" (the rest of the plan) to "everything kept", in `parts` steps.
Result<std::vector<std::size_t>> budgets_between(const EngineOptions& o, int parts) {
  EngineOptions none = o, all = o;
  none.device_memory_budget = 0;
  all.device_memory_budget = std::size_t{1} << 40;
  COSHARD_TRY_ASSIGN(auto low, estimate(none));
  COSHARD_TRY_ASSIGN(auto high, estimate(all));
  const std::size_t rest = low.bytes(MemoryPlace::device), full = high.bytes(MemoryPlace::device);
  std::vector<std::size_t> budgets;
  for (int k = 0; k <= parts; ++k) budgets.push_back(rest + (full - rest) * static_cast<std::size_t>(k) / static_cast<std::size_t>(parts));
  return budgets;
}

TEST(DeviceBudget, OptimizerStateSplitsGiveTheBitsOfTheDeviceAndOfTheHost) {
  // Stages 1-3 with the parameters on the device (the budget places optimizer state alone), and
  // stage 3 with the parameters offloaded too (shards first, then state); f32 and bf16.
  struct Case {
    int stage;
    OffloadTarget params;
    DataType dtype;
    bool step_in_backward;
  };
  const Case cases[] = {{1, OffloadTarget::none, DataType::f32, false}, {2, OffloadTarget::none, DataType::bf16, false},
                        {3, OffloadTarget::none, DataType::f32, false}, {3, OffloadTarget::cpu, DataType::bf16, false},
                        {2, OffloadTarget::none, DataType::f32, true},  {3, OffloadTarget::cpu, DataType::f32, true}};
  for (const Case& c : cases) {
    const std::string tag = "stage" + std::to_string(c.stage) + "_" + std::string(to_string(c.params)) + "_" +
                            std::string(collectives::to_string(c.dtype)) + (c.step_in_backward ? "_sib" : "");
    SCOPED_TRACE(tag);
    auto on_device = train(options(OffloadTarget::none, OffloadTarget::none, c.dtype, 0, c.stage), tag + "_device", 0.0f);
    ASSERT_TRUE(on_device) << on_device.error().message();
    EngineOptions host = options(OffloadTarget::cpu, c.params, c.dtype, 0, c.stage);
    host.step_in_backward = c.step_in_backward;
    auto on_host = train(host, tag + "_host", 0.0f);
    ASSERT_TRUE(on_host) << on_host.error().message();
    EXPECT_EQ(on_device->losses, on_host->losses);  // (the two ends agree: the baseline of the rest)
    EXPECT_EQ(on_device->final, on_host->final);
    EXPECT_TRUE(kept_state(on_host->units).empty());

    auto budgets = budgets_between(host, 4);
    ASSERT_TRUE(budgets) << budgets.error().message();
    std::size_t previous = 0;
    bool split_seen = false;
    for (const std::size_t budget : *budgets) {
      EngineOptions o = host;
      o.device_memory_budget = budget;
      auto split = train(o, tag + "_split", 0.0f);
      ASSERT_TRUE(split) << split.error().message();
      EXPECT_EQ(split->losses, on_host->losses) << "budget " << budget;
      EXPECT_EQ(split->final, on_host->final) << "budget " << budget;
      const auto kept = kept_state(split->units);
      EXPECT_GE(kept.size(), previous) << "budget " << budget;  // more budget, never fewer units kept
      previous = kept.size();
      split_seen |= !kept.empty() && kept.size() < split->units.size();
      for (const auto& u : split->units)  // state on the device only beside a shard on the device
        if (!u.optimizer_offloaded) EXPECT_FALSE(u.shard_offloaded) << u.name;
      auto planned = estimate(o);
      ASSERT_TRUE(planned);
      EXPECT_LE(planned->bytes(MemoryPlace::device), budget) << planned->describe();
    }
    EXPECT_EQ(previous, on_host->units.size());  // the largest budget keeps every unit's state
    EXPECT_TRUE(split_seen) << "no budget between the ends split the units";
  }
}

TEST(DeviceBudget, WithClippingASplitDiffersFromTheEndsOnlyByTheNormsRounding) {
  const EngineOptions host = options(OffloadTarget::cpu, OffloadTarget::none, DataType::f32, 0, 3);
  auto on_host = train(host, "clip_host");  // (max_grad_norm 0.5: clipping on every step here)
  ASSERT_TRUE(on_host) << on_host.error().message();
  auto budgets = budgets_between(host, 2);
  ASSERT_TRUE(budgets);
  EngineOptions o = host;
  o.device_memory_budget = (*budgets)[1];
  auto split = train(o, "clip_split");
  ASSERT_TRUE(split) << split.error().message();
  ASSERT_FALSE(kept_state(split->units).empty());
  ASSERT_EQ(split->losses.size(), on_host->losses.size());
  for (std::size_t i = 0; i < split->losses.size(); ++i)
    EXPECT_NEAR(split->losses[i], on_host->losses[i], 1e-6 * std::abs(on_host->losses[i])) << "step " << i;
}

TEST(DeviceBudget, OptimizerStateOnTheDeviceIsInTheEstimateAndTheRunStaysWithinIt) {
  // (one micro-batch a step, said ahead: the estimate counts the offloaded units' gradient shards
  // in flight, as the run holds them, and the kept units' resident)
  EngineOptions host = options(OffloadTarget::cpu, OffloadTarget::none, DataType::bf16, 0, 3);
  host.expected_micro_batches = 1;
  auto budgets = budgets_between(host, 2);
  ASSERT_TRUE(budgets);
  auto rest = estimate(host);
  ASSERT_TRUE(rest);
  auto on_host = train(host, "estimate_host", 0.0f);
  ASSERT_TRUE(on_host) << on_host.error().message();
  for (const std::size_t budget : {(*budgets)[1], (*budgets)[2]}) {
    EngineOptions o = host;
    o.device_memory_budget = budget;
    auto planned = estimate(o);
    ASSERT_TRUE(planned);
    const std::string text = planned->describe();
    auto split = train(o, "estimate_split", 0.0f);
    ASSERT_TRUE(split) << split.error().message();
    const std::size_t kept = kept_state(split->units).size();
    EXPECT_NE(text.find("the optimizer state of " + std::to_string(kept) + " of 6 units on the device"), std::string::npos)
        << text;
    EXPECT_NE(text.find("fp32 masters and 2 state tensors of the units stepped on the device"), std::string::npos) << text;
    // The device grows by at most the estimate's lines of the kept units (their state and resident
    // gradient shards; allocations round to 256 bytes), and the plan within the budget.
    std::size_t more = 0;
    for (const auto& item : planned->items)
      if (item.what.find("of the units stepped on the device") != std::string::npos) more += item.bytes;
    EXPECT_LE(planned->bytes(MemoryPlace::device), budget) << text;
    EXPECT_LE(split->peak_device_bytes, on_host->peak_device_bytes + more + 3 * 256 * split->units.size()) << text;
    EXPECT_GT(split->peak_device_bytes, on_host->peak_device_bytes) << text;
    // Pinned memory shrinks: the kept units have no pinned gradient shard or parameter copy.
    EXPECT_LT(planned->bytes(MemoryPlace::pinned_host), rest->bytes(MemoryPlace::pinned_host)) << text;
  }
}

// A checkpoint carries the device part's masters and state, and a load gives the device part the
// step state it loaded (Adam's step count): a split resumes a run of the optimizer on the host,
// and the host one of a split, with the bits of the run that never stopped.
TEST(DeviceBudget, ACheckpointMovesBetweenASplitAndTheHost) {
  const fs::path dir = fs::current_path() / "device_budget_scratch" / "checkpoints";
  for (const DataType dtype : {DataType::f32, DataType::bf16}) {
    SCOPED_TRACE(std::string(collectives::to_string(dtype)));
    const EngineOptions host = options(OffloadTarget::cpu, OffloadTarget::none, dtype, 0, 3);
    auto budgets = budgets_between(host, 2);
    ASSERT_TRUE(budgets);
    EngineOptions split = host;
    split.device_memory_budget = (*budgets)[1];
    auto straight = train(host, "straight", 0.0f, 0, 6);
    ASSERT_TRUE(straight) << straight.error().message();
    for (const bool split_first : {true, false}) {
      SCOPED_TRACE(split_first ? "saved by a split, loaded on the host" : "saved on the host, loaded by a split");
      fs::remove_all(dir);
      auto before = train(split_first ? split : host, "before", 0.0f, 0, 3, {}, dir);
      ASSERT_TRUE(before) << before.error().message();
      auto after = train(split_first ? host : split, "after", 0.0f, 3, 3, dir);
      ASSERT_TRUE(after) << after.error().message();
      EXPECT_FALSE(kept_state((split_first ? before : after)->units).empty());
      std::vector<double> resumed = before->losses;
      resumed.insert(resumed.end(), after->losses.begin(), after->losses.end());
      EXPECT_EQ(resumed, straight->losses);
      EXPECT_TRUE(after->final == straight->final);
    }
  }
  fs::remove_all(dir);
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
    EXPECT_NE(other.error().message().find("expected offload_params=cpu, or offload_optimizer=cpu"), std::string::npos)
        << other.error().message();
  }
  auto nothing = estimate(options(OffloadTarget::none, OffloadTarget::none, DataType::f32, 1 << 20));
  ASSERT_FALSE(nothing);
  EXPECT_NE(nothing.error().message().find("offload_optimizer=none"), std::string::npos) << nothing.error().message();
}

}  // namespace
}  // namespace coshard::zero
