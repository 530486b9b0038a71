// Expert parallelism under the engine (modules/moe.hpp's expert_group, collectives::Mesh's expert
// dimension): trained at every stage against the unsharded single-rank run, exported and loaded
// at any size, and checkpointed and resumed at any expert-parallel size, world and stage.
#include <gtest/gtest.h>

#include "moe_harness.hpp"

namespace coshard::zero {
namespace {

using namespace moe_testing;

// Expert parallelism: each rank holds 1/P of every MoE layer's experts, the routed rows go to their
// experts' ranks and back (all_to_allv), the ranks holding the same experts shard them: the same
// losses and weights as the unsharded single-rank run, at every stage, worlds 2 and 4, P 2 and 4,
// with accumulation, activation checkpointing (the exchanges replayed), coalesced experts and
// offload. With SGD: AdamW divides each element by its own magnitude, which would hide an expert
// gradient's wrong scale (each expert sees P ranks' tokens) and magnify the rounding of elements
// whose gradient nearly cancels (the rows reach an expert in another order than on one rank).
TEST(MixtureOfExperts, ExpertParallelRanksTrainTheUnshardedModel) {
  std::vector<Layout> cases;
  for (int stage = 0; stage <= 3; ++stage) {
    cases.push_back({.world = 2, .stage = stage, .expert_parallel = 2, .sgd = true});
    cases.push_back({.world = 4, .stage = stage, .expert_parallel = 4, .experts = 8, .sgd = true});
  }
  cases.push_back({.world = 4, .stage = 3, .expert_parallel = 2, .sgd = true});
  cases.push_back({.world = 4, .stage = 1, .variant = Variant::qwen, .expert_parallel = 2, .sgd = true});
  cases.push_back({.world = 4, .stage = 3, .micro_batches = 2, .checkpointed = true, .expert_parallel = 2, .sgd = true});
  cases.push_back({.world = 4, .stage = 3, .variant = Variant::qwen, .coalesced = true, .expert_parallel = 4, .experts = 8, .sgd = true});
  cases.push_back({.world = 2, .stage = 3, .optimizer = OffloadTarget::cpu, .params = OffloadTarget::cpu, .expert_parallel = 2, .sgd = true});
  cases.push_back({.world = 2, .stage = 2, .micro_batches = 2, .optimizer = OffloadTarget::nvme, .expert_parallel = 2, .sgd = true});
  for (const auto& k : cases) {
    auto got = train(k);
    ASSERT_TRUE(got) << k.name() << ": " << got.error().message();
    expect_close(*got, reference(k), k.name());
    std::size_t experts = 0;
    for (const auto& u : got->units) experts += u.expert_parallel == k.expert_parallel ? 1 : 0;
    EXPECT_GT(experts, 0u) << k.name() << ": no unit is expert-parallel";
  }
}

// An expert-parallel run's export holds every expert (each run of ranks its own, put together),
// and reads back bit for bit on one rank without experts split and at another expert-parallel
// size.
TEST(MixtureOfExperts, AnExpertParallelExportHoldsEveryExpertAndLoadsAtAnySize) {
  const fs::path file = fs::current_path() / "moe_scratch" / "expert_parallel_export.safetensors";
  fs::create_directories(file.parent_path());
  auto trained = train({.world = 4, .stage = 3, .expert_parallel = 2, .sgd = true, .export_to = file});
  ASSERT_TRUE(trained) << trained.error().message();
  for (const Layout& k : {Layout{.world = 1, .stage = 0, .steps = 0, .init_from = file},
                          Layout{.world = 3, .stage = 3, .expert_parallel = 3, .steps = 0, .init_from = file},
                          Layout{.world = 2, .stage = 1, .expert_parallel = 2, .steps = 0, .init_from = file}}) {
    auto loaded = train(k);
    ASSERT_TRUE(loaded) << k.name() << ": " << loaded.error().message();
    EXPECT_EQ(loaded->whole, trained->whole) << k.name() << ": the export did not read back bit for bit";
  }
  fs::remove(file);
}

// A sharded checkpoint of an expert-parallel run (each run of ranks saving its own experts, the
// manifest listing every expert) resumes at any expert-parallel size, world and stage, and without
// expert parallelism, and one saved without it resumes with it: the resumed steps give the
// uninterrupted run's losses and weights.
TEST(MixtureOfExperts, AnExpertParallelCheckpointResumesAtAnySize) {
  const fs::path dir = fs::current_path() / "moe_scratch" / "expert_parallel_checkpoint";
  fs::remove_all(dir);
  const Layout whole{.world = 4, .stage = 3, .expert_parallel = 2, .experts = 8, .sgd = true, .steps = 4};
  auto uninterrupted = train(whole);
  ASSERT_TRUE(uninterrupted) << uninterrupted.error().message();
  Layout first = whole;
  first.steps = 2;
  first.checkpoint_dir = dir;
  auto saved = train(first);
  ASSERT_TRUE(saved) << saved.error().message();
  std::vector<Layout> resumes = {whole, {.world = 4, .stage = 2, .expert_parallel = 4, .experts = 8, .sgd = true, .steps = 4},
                                 {.world = 2, .stage = 3, .micro_batches = 2, .experts = 8, .sgd = true, .steps = 4},
                                 {.world = 1, .stage = 0, .micro_batches = 4, .experts = 8, .sgd = true, .steps = 4},
                                 {.world = 2, .stage = 1, .micro_batches = 2, .expert_parallel = 2, .experts = 8,
                                  .sgd = true, .steps = 4}};
  for (Layout k : resumes) {
    k.checkpoint_dir = dir;
    k.resume = true;
    auto rest = train(k);
    ASSERT_TRUE(rest) << k.name() << ": " << rest.error().message();
    TrainedRun both = *rest;
    both.losses.insert(both.losses.begin(), saved->losses.begin(), saved->losses.end());
    expect_close(both, *uninterrupted, "resumed at " + k.name());
  }
  // And the other way: saved without expert parallelism, resumed with it.
  fs::remove_all(dir);
  Layout plain{.world = 2, .stage = 3, .micro_batches = 2, .experts = 8, .sgd = true, .steps = 2};
  plain.checkpoint_dir = dir;
  auto saved_plain = train(plain);
  ASSERT_TRUE(saved_plain) << saved_plain.error().message();
  Layout resumed = whole;
  resumed.checkpoint_dir = dir;
  resumed.resume = true;
  auto rest = train(resumed);
  ASSERT_TRUE(rest) << rest.error().message();
  TrainedRun both = *rest;
  both.losses.insert(both.losses.begin(), saved_plain->losses.begin(), saved_plain->losses.end());
  expect_close(both, *uninterrupted, "saved at " + plain.name() + ", resumed at " + whole.name());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace coshard::zero
