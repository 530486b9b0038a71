// The secondary weight partition (EngineOptions::secondary_partition_ranks, ZeRO++'s hpZ; #63 item
// 3): a unit's later gathers of a step (backward, activation checkpointing's replay, the next
// micro-batch's forward) go within groups of N ranks from slices kept at its first gather, and give
// the first gather's values: every loss and final weight is full sharding's bit for bit (and
// quantized gathers' with int8 weights), at worlds 4-8, f32 and bf16, with accumulation,
// checkpointing, offloaded and NVMe shards, hybrid sharding and coalesced units, while the gathers
// over the whole group carry less. A unit sharded over N ranks or fewer gathers as it did. Bad
// sizes are refused by name, by Engine::create and by the memory estimate alike, and the estimate
// counts the slices.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "coshard/zero/memory_estimate.hpp"
#include "../support/engine_mlp_runs.hpp"
#include "../support/on_ranks.hpp"
#include "../support/sanitizers.hpp"

namespace coshard::zero {
namespace {

using namespace ::coshard::testing::engine_mlp;

TEST(SecondaryPartition, GivesFullShardingsBits) {
  const auto int8 = Quantization::int8;
  std::vector<RunPlan> cases = {
      {.world = 4, .same_rows = false, .secondary = 2},
      {.world = 4, .weights = int8, .same_rows = false, .secondary = 2},  // (against int8 gathers alone)
      {.world = 4, .micro_batches = 2, .same_rows = false, .secondary = 2, .checkpoint_fc2 = true},
      {.world = 6, .dtype = DataType::bf16, .same_rows = false, .secondary = 3},
      {.world = 4, .optimizer = OffloadTarget::cpu, .params = OffloadTarget::cpu, .same_rows = false, .secondary = 2},
      {.world = 4, .optimizer = OffloadTarget::nvme, .params = OffloadTarget::nvme, .micro_batches = 2,
       .same_rows = false, .secondary = 2},
      {.world = 8, .shard_group_size = 4, .same_rows = false, .secondary = 2},  // (hybrid: within each group of 4)
      {.world = 4, .weights = int8, .granularity = 64 << 10, .same_rows = false, .grads = int8, .secondary = 2},
  };
  if (coshard::testing::kSanitized) cases.resize(3);
  for (const auto& plan : cases) {
    SCOPED_TRACE(plan.name());
    auto run = train(plan);
    ASSERT_TRUE(run) << run.error().message();
    RunPlan full_plan = plan;
    full_plan.secondary = 1;
    auto full = train(full_plan);
    ASSERT_TRUE(full) << full.error().message();
    EXPECT_EQ(run->losses, full->losses);
    EXPECT_EQ(run->rank_losses, full->rank_losses);
    EXPECT_EQ(run->final, full->final);
    // The later gathers went within the secondary groups, the same count of gathers in all.
    EXPECT_EQ(run->gathers, full->gathers);
    EXPECT_GT(run->secondary_gathers, 0u);
    EXPECT_EQ(full->secondary_gathers, 0u);
    EXPECT_LT(run->gathered_bytes, full->gathered_bytes);
    EXPECT_GT(run->secondary_gathered_bytes, 0u);
    // NVMe parameters: a gather from the slices reads no shard from the disk.
    if (plan.params == OffloadTarget::nvme) EXPECT_LT(run->nvme_read_bytes, full->nvme_read_bytes);
  }
}

// The slices hold one step's values: kept by its first gather, dropped when the next step begins
// (the weights have changed: a stale slice would show in the second step's loss, which the test
// above compares); an evaluation-free run of one micro-batch has one primary gather a unit a step.
TEST(SecondaryPartition, OnePrimaryGatherAUnitAStep) {
  RunPlan plan{.world = 4, .same_rows = false, .steps = 3, .secondary = 2, .checkpoint_fc2 = true};
  auto run = train(plan);
  ASSERT_TRUE(run) << run.error().message();
  // Three units (fc1, fc2, head), none kept after a use (max_reuse_distance 0): each gathered once
  // over the world in forward and again within its pair in backward, fc2 once more for its replay.
  EXPECT_EQ(run->gathers - run->secondary_gathers, 3u * 3u);
  EXPECT_EQ(run->secondary_gathers, 3u * 4u);
}

// N no smaller than a unit's group: nothing to save; it gathers as it did.
TEST(SecondaryPartition, AGroupOfNOrFewerGathersAsItDid) {
  for (const auto& plan : {RunPlan{.world = 2, .same_rows = false, .secondary = 2},
                           RunPlan{.world = 4, .shard_group_size = 2, .same_rows = false, .secondary = 4},
                           RunPlan{.world = 4, .shard_group_size = 2, .same_rows = false, .secondary = 2}}) {
    SCOPED_TRACE(plan.name());
    auto run = train(plan);
    ASSERT_TRUE(run) << run.error().message();
    RunPlan full_plan = plan;
    full_plan.secondary = 1;
    auto full = train(full_plan);
    ASSERT_TRUE(full) << full.error().message();
    EXPECT_EQ(run->losses, full->losses);
    EXPECT_EQ(run->final, full->final);
    EXPECT_EQ(run->secondary_gathers, 0u);
    EXPECT_EQ(run->gathered_bytes, full->gathered_bytes);
  }
}

TEST(SecondaryPartition, BadSizesAreRefusedByName) {
  auto with = [](int n, auto change) {
    EngineOptions o;
    o.secondary_partition_ranks = n;
    change(o);
    return o;
  };
  struct Bad {
    EngineOptions o;
    int world;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {with(0, [](EngineOptions&) {}), 4, "secondary_partition_ranks=0: expected 1 (none) or a whole number that divides the world size"},
      {with(-2, [](EngineOptions&) {}), 4, "secondary_partition_ranks=-2"},
      {with(2, [](EngineOptions& o) { o.zero_stage = 2; }), 4, "secondary_partition_ranks=2 with zero_stage=2"},
      {with(3, [](EngineOptions&) {}), 4, "secondary_partition_ranks=3: expected a divisor of the world size 4"},
      {with(3, [](EngineOptions& o) { o.shard_group_size = 4; }), 0,
       "secondary_partition_ranks=3 with shard_group_size=4: expected a divisor of the shard group size"},
  };
  for (const auto& bad : cases) {
    auto checked = check_secondary_partition(bad.o, bad.world);
    ASSERT_FALSE(checked) << bad.message;
    EXPECT_NE(checked.error().message().find(bad.message), std::string::npos) << checked.error().message();
  }
  EXPECT_TRUE(check_secondary_partition(with(3, [](EngineOptions&) {}), 0));  // (the world not known yet)
  EXPECT_TRUE(check_secondary_partition(with(1, [](EngineOptions& o) { o.zero_stage = 0; }), 3));
  // Through Engine::create (before anything is allocated) and the estimate; a shard_group_size_of
  // group that N does not divide is named with its unit.
  const auto errors = ::coshard::testing::on_ranks(4, [&](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, modules::Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto model, make_model(false));
    COSHARD_CO_TRY_ASSIGN(auto opt, modules::Optimizer::adamw({}, {}));
    auto engine = Engine::create(ctx, comm, *model, *opt, cases[3].o);
    if (engine) co_return fail(ErrorCode::internal, "created with secondary_partition_ranks=3 at world 4");
    if (engine.error().message().find(cases[3].message) == std::string::npos) co_return fail(std::move(engine).error());
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
  auto model = make_model(false);
  ASSERT_TRUE(model);
  auto estimate = estimate_engine_memory(**model, 4, cases[3].o, 2);
  ASSERT_FALSE(estimate);
  EXPECT_NE(estimate.error().message().find(cases[3].message), std::string::npos) << estimate.error().message();
  auto odd_group = with(2, [](EngineOptions& o) {
    o.shard_group_size_of = [](std::string_view path) { return path == "fc2" ? 3 : 0; };
  });
  auto refused = estimate_engine_memory(**model, 6, odd_group, 2);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("unit fc2 is sharded over 3 ranks (shard_group_size_of), which 2 does not divide"),
            std::string::npos)
      << refused.error().message();
}

// The estimate counts the slices: each unit's padded bytes over N, on the device.
TEST(SecondaryPartition, TheEstimateCountsTheSlices) {
  auto model = make_model(false);
  ASSERT_TRUE(model);
  EngineOptions o;
  auto full = estimate_engine_memory(**model, 8, o, 2);
  ASSERT_TRUE(full) << full.error().message();
  o.secondary_partition_ranks = 2;
  auto secondary = estimate_engine_memory(**model, 8, o, 2);
  ASSERT_TRUE(secondary) << secondary.error().message();
  auto units = plan_units(**model, 8, o);
  ASSERT_TRUE(units);
  std::size_t slices = 0;
  for (const auto& u : *units) slices += u.padded_bytes / 2;
  EXPECT_EQ(secondary->bytes(MemoryPlace::device) - full->bytes(MemoryPlace::device), slices);
  EXPECT_NE(secondary->describe().find("secondary partition (1/2 of its units)"), std::string::npos)
      << secondary->describe();
  // A frozen unit stays gathered through the step (keep_frozen_gathered): no slice of it; gathered
  // again after each use, it has one.
  auto frozen = make_model(true);
  ASSERT_TRUE(frozen);
  auto frozen_units = plan_units(**frozen, 8, o);
  ASSERT_TRUE(frozen_units);
  std::size_t kept = 0;
  for (const auto& u : *frozen_units) {
    EXPECT_EQ(u.secondary_ranks, u.frozen ? 0 : 2) << u.name;
    kept += u.frozen ? 0 : u.padded_bytes / 2;
  }
  auto without_frozen = estimate_engine_memory(**frozen, 8, o, 2);
  ASSERT_TRUE(without_frozen);
  o.secondary_partition_ranks = 1;
  auto frozen_full = estimate_engine_memory(**frozen, 8, o, 2);
  ASSERT_TRUE(frozen_full);
  EXPECT_EQ(without_frozen->bytes(MemoryPlace::device) - frozen_full->bytes(MemoryPlace::device), kept);
  o.secondary_partition_ranks = 2;
  o.keep_frozen_gathered = false;
  auto regathered = plan_units(**frozen, 8, o);
  ASSERT_TRUE(regathered);
  for (const auto& u : *regathered) EXPECT_EQ(u.secondary_ranks, 2) << u.name;
}

}  // namespace
}  // namespace coshard::zero
