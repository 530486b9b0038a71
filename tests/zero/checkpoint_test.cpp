// Checkpoints from the engine alone, in a loop of the test's own (no Trainer): a regression MLP
// with a module of the test's own and the mean squared error, saved at one world size and stage
// and resumed at others (optimizer and parameters offloaded too), continuing as if never stopped;
// the consolidated export read back into another plan; and every misuse named.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "coshard/zero/engine.hpp"
#include "../support/on_ranks.hpp"
#include "../support/rank_engine.hpp"
#include "../support/regression_mlp.hpp"

namespace coshard::zero {
namespace {

namespace fs = std::filesystem;
using ::coshard::testing::kMlpRows;
using ::coshard::testing::Plan;
using ::coshard::testing::RankEngine;
using ::coshard::testing::kLr;

constexpr std::uint64_t kSeed = 11;

// Options made outside the coroutines (GCC 12 miscompiles braced maps inside them).
CheckpointOptions with_run(std::map<std::string, std::string> run, int keep = 0) {
  CheckpointOptions o;
  o.run = std::move(run);
  o.keep = keep;
  return o;
}
const CheckpointOptions kSines = with_run({{"data", "sines"}});
const CheckpointOptions kSinesKeepOne = with_run({{"data", "sines"}}, 1);
const CheckpointOptions kSinesSeeded = with_run({{"data", "sines"}, {"seed", "11"}});
const CheckpointOptions kCosines = with_run({{"data", "cosines"}});
const CheckpointOptions kKeepNegative = with_run({}, -1);
CheckpointOptions replacing(CheckpointOptions o) {
  o.replace_other_run = true;
  return o;
}
const CheckpointOptions kCosinesReplacing = replacing(kCosines);

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::current_path() / "zero_checkpoint_scratch" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

Result<void> on_ranks(int world, const ::coshard::testing::RankBody& body) {
  const auto errors = ::coshard::testing::on_ranks(world, body);
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return {};
}

// A run under `plan`: initialised from the seed, or loaded from `load_from` (it must resume at
// step `first`); steps [first, first + count); with `save_after` >= 0, a checkpoint into `save_to`
// after that many of them, left to be published by the loop (no finish_checkpoint). Rank 0's losses.
Result<std::vector<double>> run(const Plan& plan, const fs::path& swap, int first, int count,
                                const fs::path& load_from = {}, int save_after = -1, const fs::path& save_to = {}) {
  std::vector<double> losses;
  COSHARD_TRY(on_ranks(plan.world, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, plan, swap));
    if (load_from.empty()) {
      COSHARD_CO_TRY(co_await e.engine->initialize(kSeed));
    } else {
      COSHARD_CO_TRY(co_await e.engine->load_checkpoint(load_from, kSines));
      if (e.engine->steps_done() != first)
        co_return fail(ErrorCode::internal, "resumed at step ", e.engine->steps_done(), ", expected ", first);
    }
    std::vector<double> mine;
    int done = 0;
    if (save_after >= 0) {
      COSHARD_CO_TRY_ASSIGN(mine, co_await e.train(first, save_after));
      COSHARD_CO_TRY(co_await e.engine->save_checkpoint(save_to, kSinesKeepOne));
      done = save_after;
    }
    COSHARD_CO_TRY_ASSIGN(auto rest, co_await e.train(first + done, count - done));
    mine.insert(mine.end(), rest.begin(), rest.end());
    if (e.engine->steps_done() != first + count)
      co_return fail(ErrorCode::internal, "steps_done ", e.engine->steps_done(), " after step ", first + count);
    if (r == 0) losses = std::move(mine);
    co_return Result<void>{};
  }));
  return losses;
}

TEST(EngineCheckpoint, ResumesAtAnyWorldSizeStageAndPlacementAsIfNeverStopped) {
  const Plan saved{2, 3};
  const fs::path dir = scratch("resume");
  auto whole = run(saved, dir / "swap", 0, 6);
  ASSERT_TRUE(whole) << whole.error().message();
  ASSERT_EQ(whole->size(), 6u);
  // Saved after step 3; the loop goes on and publishes it by itself (the second begin_step after).
  auto saving = run(saved, dir / "swap", 0, 6, {}, 3, dir / "ck");
  ASSERT_TRUE(saving) << saving.error().message();
  EXPECT_EQ(*saving, *whole) << "a save does not disturb training";
  ASSERT_TRUE(fs::exists(dir / "ck" / "latest")) << "published by the loop, without finish_checkpoint";
  ASSERT_TRUE(fs::exists(dir / "ck" / "step-00000003" / "manifest.json"));

  for (const Plan& plan : {Plan{2, 3}, Plan{1, 1}, Plan{3, 2}, Plan{2, 0}, Plan{3, 0}, Plan{4, 3, OffloadTarget::cpu},
                           Plan{2, 3, OffloadTarget::nvme, OffloadTarget::nvme}, Plan{3, 3, OffloadTarget::cpu, OffloadTarget::cpu}}) {
    SCOPED_TRACE(plan.name());
    fs::remove_all(dir / "swap");
    auto resumed = run(plan, dir / "swap", 3, 3, dir / "ck");
    ASSERT_TRUE(resumed) << resumed.error().message();
    ASSERT_EQ(resumed->size(), 3u);
    for (std::size_t i = 0; i < 3; ++i) {
      const double expect = (*whole)[3 + i];
      if (plan.world == saved.world && plan.stage == saved.stage && plan.optimizer == OffloadTarget::none)
        EXPECT_EQ((*resumed)[i], expect) << "step " << 3 + i << ": the same bits on the same plan";
      EXPECT_NEAR((*resumed)[i], expect, 1e-6 * std::abs(expect)) << "step " << 3 + i;
    }
  }
}

// A stage-0 checkpoint (every rank's file holds whole units) resumes anywhere, sharded or not.
TEST(EngineCheckpoint, AStageZeroCheckpointResumesAtEveryStage) {
  const Plan saved{3, 0};
  const fs::path dir = scratch("stage0");
  auto whole = run(saved, dir / "swap", 0, 6);
  ASSERT_TRUE(whole) << whole.error().message();
  auto saving = run(saved, dir / "swap", 0, 6, {}, 3, dir / "ck");  // published at the second begin_step after
  ASSERT_TRUE(saving) << saving.error().message();
  EXPECT_EQ(*saving, *whole) << "a save does not disturb training";
  for (const Plan& plan : {Plan{3, 0}, Plan{2, 0}, Plan{1, 1}, Plan{4, 3}, Plan{2, 2, OffloadTarget::cpu},
                           Plan{2, 3, OffloadTarget::nvme, OffloadTarget::nvme}}) {
    SCOPED_TRACE(plan.name());
    fs::remove_all(dir / "swap");
    auto resumed = run(plan, dir / "swap", 3, 3, dir / "ck");
    ASSERT_TRUE(resumed) << resumed.error().message();
    for (std::size_t i = 0; i < 3; ++i) {
      const double expect = (*whole)[3 + i];
      if (plan.world == saved.world && plan.stage == saved.stage)
        EXPECT_EQ((*resumed)[i], expect) << "step " << 3 + i << ": the same bits on the same plan";
      EXPECT_NEAR((*resumed)[i], expect, 1e-6 * std::abs(expect)) << "step " << 3 + i;
    }
  }
}

// Every parameter's whole value on every rank (gather_parameters), by name.
using Values = std::map<std::string, std::vector<std::byte>>;

TEST(EngineCheckpoint, ExportedModelLoadsIntoAnotherPlan) {
  const fs::path dir = scratch("export");
  const fs::path file = dir / "model.safetensors";
  Values exported, loaded;
  auto out = on_ranks(2, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, {2, 3}, dir / "swap"));
    COSHARD_CO_TRY(co_await e.engine->initialize(kSeed));
    COSHARD_CO_TRY(co_await e.train(0, 2));
    COSHARD_CO_TRY(co_await e.engine->export_safetensors(file));
    COSHARD_CO_TRY_ASSIGN(auto params, co_await e.engine->gather_parameters());
    if (r == 0)
      for (auto& p : params) exported[p.name] = std::move(p.bytes);
    co_return Result<void>{};
  });
  ASSERT_TRUE(out) << out.error().message();
  auto in = on_ranks(3, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, {3, 1}, dir / "swap"));
    COSHARD_CO_TRY(co_await e.engine->initialize(kSeed + 1));
    COSHARD_CO_TRY(co_await e.engine->load_safetensors(file));
    COSHARD_CO_TRY_ASSIGN(auto params, co_await e.engine->gather_parameters());
    if (r == 0)
      for (auto& p : params) loaded[p.name] = std::move(p.bytes);
    co_return Result<void>{};
  });
  ASSERT_TRUE(in) << in.error().message();
  ASSERT_EQ(exported.size(), 6u);  // fc1 and fc2 weight and bias, the affine's scale and shift
  EXPECT_EQ(loaded, exported);
}

TEST(EngineCheckpoint, MisuseIsNamedAndChangesNothing) {
  const fs::path dir = scratch("misuse");
  auto out = on_ranks(1, [&](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, {1, 3}, dir / "swap"));
    Engine& engine = *e.engine;
    COSHARD_CO_TRY(co_await engine.initialize(kSeed));
    auto expect_error = [](const Result<void>& r, const std::string& words) -> Result<void> {
      if (r) return fail(ErrorCode::internal, "expected an error with '", words, "', it succeeded");
      if (r.error().message().find(words) == std::string::npos)
        return fail(ErrorCode::internal, "expected an error with '", words, "', got: ", r.error().message());
      return {};
    };
    // Inside a step or an inference pass.
    COSHARD_CO_TRY(co_await engine.begin_step(1, kLr));
    COSHARD_CO_TRY(expect_error(co_await engine.save_checkpoint(dir / "ck"),
                                "Engine::save_checkpoint: a step is open (finish_step or abandon_step first)"));
    COSHARD_CO_TRY(expect_error(co_await engine.load_checkpoint(dir / "ck"), "Engine::load_checkpoint: a step is open"));
    co_await engine.abandon_step();
    COSHARD_CO_TRY(engine.begin_inference());
    COSHARD_CO_TRY(expect_error(co_await engine.export_safetensors(dir / "m.safetensors"),
                                "Engine::export_safetensors: an inference pass is open (end_inference first)"));
    COSHARD_CO_TRY(co_await engine.end_inference());
    if (fs::exists(dir / "ck") || fs::exists(dir / "m.safetensors"))
      co_return fail(ErrorCode::internal, "a refused save or export wrote files");
    COSHARD_CO_TRY(expect_error(co_await engine.save_checkpoint(dir / "ck", kKeepNegative), "keep=-1: expected >= 0"));

    // A checkpoint of another run: every difference named, nothing loaded.
    COSHARD_CO_TRY(co_await e.train(0, 1));
    COSHARD_CO_TRY(co_await engine.save_checkpoint(dir / "ck", kSinesSeeded));
    COSHARD_CO_TRY(co_await engine.finish_checkpoint());
    COSHARD_CO_TRY_ASSIGN(auto before, co_await engine.gather_parameters());
    COSHARD_CO_TRY(co_await e.train(1, 1));
    COSHARD_CO_TRY_ASSIGN(auto trained, co_await engine.gather_parameters());
    COSHARD_CO_TRY(expect_error(co_await engine.load_checkpoint(dir / "ck", kCosines),
                                "a different run (data: saved sines, this run cosines; seed: saved 11, this run (not set))"));
    COSHARD_CO_TRY_ASSIGN(auto after, co_await engine.gather_parameters());
    if (engine.steps_done() != 2 || after[0].bytes != trained[0].bytes)
      co_return fail(ErrorCode::internal, "a refused load changed the engine");
    COSHARD_CO_TRY(expect_error(co_await engine.load_checkpoint(dir / "nowhere"),
                                "neither a manifest.json nor a 'latest' file there"));
    // The right run loads: back to step 1's values.
    COSHARD_CO_TRY(co_await engine.load_checkpoint(dir / "ck", kSinesSeeded));
    COSHARD_CO_TRY_ASSIGN(auto reloaded, co_await engine.gather_parameters());
    if (engine.steps_done() != 1 || reloaded[0].bytes != before[0].bytes)
      co_return fail(ErrorCode::internal, "the load did not restore step 1");
    // A manifest whose step is not its folder's (edited, or copied from another checkpoint): refused
    // by name, nothing loaded (it would resume at a step the run never reached).
    const fs::path edited = dir / "edited" / "step-00000001";
    fs::create_directories(edited.parent_path());
    fs::copy(dir / "ck" / "step-00000001", edited);
    {
      std::ifstream in(edited / "manifest.json");
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const auto at = text.find("\"step\":");
      if (at == std::string::npos) co_return fail(ErrorCode::internal, "no step in the manifest: ", text.substr(0, 200));
      const auto value = text.find_first_of("0123456789", at);
      text.replace(value, text.find_first_not_of("0123456789", value) - value, "999");
      std::ofstream(edited / "manifest.json", std::ios::trunc) << text;
      std::ofstream(edited.parent_path() / "latest") << "step-00000001\n";
    }
    COSHARD_CO_TRY(co_await e.train(1, 1));
    COSHARD_CO_TRY_ASSIGN(auto stepped, co_await engine.gather_parameters());
    const fs::path edited_dir = edited.parent_path();  // named: GCC 12 destroys temporaries in co_await twice
    COSHARD_CO_TRY(expect_error(co_await engine.load_checkpoint(edited_dir, kSinesSeeded),
                                "its manifest says step 999, the folder's name step 00000001"));
    COSHARD_CO_TRY_ASSIGN(auto kept, co_await engine.gather_parameters());
    if (engine.steps_done() != 2 || kept[0].bytes != stepped[0].bytes)
      co_return fail(ErrorCode::internal, "a refused load changed the engine");
    co_return Result<void>{};
  });
  EXPECT_TRUE(out) << out.error().message();
}

// A file only one rank can read: every rank refuses, none waits for the other, nothing changes.
TEST(EngineCheckpoint, AWeightsFileOneRankCannotReadIsRefusedOnEveryRank) {
  const fs::path dir = scratch("one_rank");
  std::vector<std::string> errors(2);
  auto out = on_ranks(2, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, {2, 2}, dir / "swap"));
    COSHARD_CO_TRY(co_await e.engine->initialize(kSeed));
    COSHARD_CO_TRY(co_await e.engine->export_safetensors(dir / "model.safetensors"));
    COSHARD_CO_TRY_ASSIGN(auto before, co_await e.engine->gather_parameters());
    const fs::path file = dir / (r == 0 ? "model.safetensors" : "missing.safetensors");  // named: GCC 12 destroys temporaries in co_await twice
    auto loaded = co_await e.engine->load_safetensors(file);
    if (loaded) co_return fail(ErrorCode::internal, "rank ", r, " loaded a file another rank could not read");
    errors[static_cast<std::size_t>(r)] = loaded.error().message();
    COSHARD_CO_TRY_ASSIGN(auto after, co_await e.engine->gather_parameters());
    if (after[0].bytes != before[0].bytes) co_return fail(ErrorCode::internal, "rank ", r, " changed its parameters");
    co_return Result<void>{};
  });
  ASSERT_TRUE(out) << out.error().message();
  EXPECT_NE(errors[0].find("rank 1 refused it"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("missing.safetensors"), std::string::npos) << errors[1];
}

// Another run's published checkpoint is never replaced in silence: a save of the same step, or
// one that would supersede what `latest` names, by a run of another identity is refused on
// every rank (rank 0 names the difference; the others name rank 0), nothing written; the same
// run saves again freely, and replace_other_run says to replace.
TEST(EngineCheckpoint, AnotherRunsCheckpointIsNotReplacedUnlessAskedTo) {
  const fs::path dir = scratch("other_run");
  const fs::path ck = dir / "ck";
  auto first = on_ranks(2, [&](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, {2, 2}, dir / "swap"));
    COSHARD_CO_TRY(co_await e.engine->initialize(kSeed));
    COSHARD_CO_TRY(co_await e.train(0, 1));
    COSHARD_CO_TRY(co_await e.engine->save_checkpoint(ck, kSines));
    COSHARD_CO_TRY(co_await e.engine->finish_checkpoint());
    // The same run saving its step again is its own business.
    COSHARD_CO_TRY(co_await e.engine->save_checkpoint(ck, kSines));
    co_return co_await e.engine->finish_checkpoint();
  });
  ASSERT_TRUE(first) << first.error().message();
  std::vector<std::string> errors(2);
  auto second = on_ranks(2, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, {2, 3}, dir / "swap2"));
    COSHARD_CO_TRY(co_await e.engine->initialize(kSeed + 1));
    for (int steps = 1; steps <= 2; ++steps) {  // the same step, then a later one (it would supersede `latest`)
      COSHARD_CO_TRY(co_await e.train(steps - 1, 1));
      auto saved = co_await e.engine->save_checkpoint(ck, kCosines);
      if (saved) co_return fail(ErrorCode::internal, "a save over another run's checkpoint was accepted");
      errors[static_cast<std::size_t>(r)] = saved.error().message();
    }
    if (fs::exists(ck / "step-00000002") || fs::exists(ck / "step-00000002.partial"))
      co_return fail(ErrorCode::internal, "the refused save of step 2 wrote");
    // Asked to: it replaces.
    COSHARD_CO_TRY(co_await e.engine->save_checkpoint(ck, kCosinesReplacing));
    co_return co_await e.engine->finish_checkpoint();
  });
  ASSERT_TRUE(second) << second.error().message();
  EXPECT_NE(errors[0].find("step-00000001 was saved by another run (data: saved sines, this run cosines)"),
            std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0 refused it (its error says why); nothing was saved"), std::string::npos) << errors[1];
  std::ifstream latest(ck / "latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-00000002") << "the replacing save is published";
}

// #48 item 9: ranks given different folders (a folder local to each node) each write their file
// into their own; rank 0 publishes nothing rather than a checkpoint of its file alone, every rank
// fails naming the ranks whose files it cannot see, and no `latest` appears anywhere.
TEST(EngineCheckpoint, RanksSavingIntoDifferentFoldersPublishNothingAndSayWhy) {
  const fs::path dir = scratch("folder_per_rank");
  std::vector<std::string> errors(3);
  auto saved = on_ranks(3, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, {3, 3}, dir / "swap"));
    COSHARD_CO_TRY(co_await e.engine->initialize(kSeed));
    COSHARD_CO_TRY(co_await e.train(0, 1));
    const fs::path mine = dir / ("node" + std::to_string(r == 2 ? 1 : r));  // ranks 1 and 2 share node1's
    COSHARD_CO_TRY(co_await e.engine->save_checkpoint(mine, kSines));
    auto published = co_await e.engine->finish_checkpoint();
    if (published) co_return fail(ErrorCode::internal, "a checkpoint of rank 0's file alone was published");
    errors[static_cast<std::size_t>(r)] = published.error().message();
    co_return Result<void>{};
  });
  ASSERT_TRUE(saved) << saved.error().message();
  EXPECT_NE(errors[0].find("the files of 2 rank(s) (1, 2) are not in"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("every rank must save into one folder that all of them see"), std::string::npos) << errors[0];
  for (int r = 1; r < 3; ++r)
    EXPECT_NE(errors[static_cast<std::size_t>(r)].find("rank 0 could not publish it"), std::string::npos) << errors[r];
  EXPECT_FALSE(fs::exists(dir / "node0" / "latest"));
  EXPECT_FALSE(fs::exists(dir / "node1" / "latest"));
  EXPECT_FALSE(fs::exists(dir / "node0" / "step-00000001"));
}

// #48 item 8: a run identity a load would refuse (a field past 4096 characters) is refused by the
// save, naming the field, before anything is written; one at the bound saves and loads.
TEST(EngineCheckpoint, ARunIdentityTheLoadWouldRefuseIsRefusedBySave) {
  const fs::path dir = scratch("long_identity");
  const CheckpointOptions too_long = with_run({{"data", std::string(4097, 'x')}});
  const CheckpointOptions at_bound = with_run({{"data", std::string(4096, 'x')}});
  std::string error;
  auto saved = on_ranks(2, [&](int r, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, RankEngine::make(comm, {2, 2}, dir / "swap"));
    COSHARD_CO_TRY(co_await e.engine->initialize(kSeed));
    auto refused = co_await e.engine->save_checkpoint(dir / "ck", too_long);
    if (refused) co_return fail(ErrorCode::internal, "a run identity past the bound was saved");
    // (rank 0 alone creates the folder, at a save's claim: looked at before its next save)
    if (r == 0) error = refused.error().message();
    if (r == 0 && fs::exists(dir / "ck")) co_return fail(ErrorCode::internal, "the refused save wrote");
    COSHARD_CO_TRY(co_await e.engine->save_checkpoint(dir / "ck", at_bound));
    COSHARD_CO_TRY(co_await e.engine->finish_checkpoint());
    COSHARD_CO_TRY_ASSIGN(auto again, RankEngine::make(comm, {2, 3}, dir / "swap2"));
    co_return co_await again.engine->load_checkpoint(dir / "ck", at_bound);
  });
  ASSERT_TRUE(saved) << saved.error().message();
  EXPECT_NE(error.find("'run' field 'data' is 4097 characters long: at most 4096"), std::string::npos) << error;
}

}  // namespace
}  // namespace coshard::zero
