// The Trainer on the Local backend (ranks are threads, CPU): the builder's checks, resume
// exactness, loading at another world size, refusal of corrupt or mismatched checkpoints with
// nothing changed, crash leftovers, and export/import.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <barrier>
#include <csignal>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/safetensors.hpp"
#include "coshard/trainer/trainer.hpp"
#include "../support/on_ranks.hpp"

namespace coshard::trainer {
namespace {

namespace fs = std::filesystem;

constexpr modules::GptConfig kModel{.vocab = 32, .max_seq = 8, .dim = 16, .layers = 2, .heads = 2, .mlp_ratio = 2};
constexpr std::int64_t kBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr std::int64_t kSeq = 8;

TrainerConfig small_config(int stage = 3) {
  TrainerConfig c;
  c.zero_stage = stage;
  c.lr = 1e-2f;
  c.weight_decay = 0.01f;
  c.prefetch_bucket_bytes = 1 << 20;
  c.max_live_bytes = 64 << 20;
  c.seed = 5;
  return c;
}

const SyntheticTask& task() {
  static const SyntheticTask t(kModel.vocab, 11);
  return t;
}

// A fresh folder under the build tree (not /tmp: some CI /tmp are tmpfs and shared).
fs::path scratch(const std::string& name) {
  const fs::path p = fs::current_path() / "trainer_test_scratch" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

using ::coshard::testing::on_ranks;  // tests/support/on_ranks.hpp
using ::coshard::testing::RankBody;

struct TrainRun {
  std::vector<double> losses;                       // rank 0's, per step
  std::vector<zero::GatheredParameter> params;   // rank 0's view after the run
  std::int64_t steps_done = 0;
};

struct Plan {
  int world = 2;
  TrainerConfig config = small_config();
  std::string load_from;     // checkpoint folder to load first
  int steps = 3;
  std::string save_to;       // save after the steps (and publish)
  bool finish = true;
};

Result<TrainRun> train(const Plan& p) {
  TrainRun run;
  std::mutex mutex;
  auto errors = on_ranks(p.world, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    TrainerBuilder builder(p.config);
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    if (!p.load_from.empty()) COSHARD_CO_TRY(co_await t.load_checkpoint(p.load_from));
    std::vector<double> losses;
    for (int i = 0; i < p.steps; ++i) {
      const auto global = task().batch(static_cast<std::uint64_t>(t.steps_done()), kBatch, kSeq);
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(global.rank_rows(rank, comm.size())));
      losses.push_back(stats.loss);
    }
    if (!p.save_to.empty()) COSHARD_CO_TRY(co_await t.save_checkpoint(p.save_to));
    if (p.finish) COSHARD_CO_TRY(co_await t.finish_checkpoint());
    COSHARD_CO_TRY_ASSIGN(auto params, co_await t.engine().gather_parameters());
    if (rank == 0) {
      std::lock_guard lock(mutex);
      run.losses = losses;
      run.params = std::move(params);
      run.steps_done = t.steps_done();
    }
    co_return Result<void>{};
  });
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return run;
}

void expect_same_parameters(const std::vector<zero::GatheredParameter>& a,
                            const std::vector<zero::GatheredParameter>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_TRUE(a[i].bytes == b[i].bytes) << a[i].name;
  }
}

// `first` (saving to first.save_to at its end), then a run of its config that loads that
// checkpoint and trains as many steps: together they are `reference` bit for bit, and a run
// with everything on the device that loads the same checkpoint goes on exactly as the resumed
// one. Gives the resumed run.
std::optional<TrainRun> expect_resumes_like(const TrainRun& reference, const Plan& first) {
  auto a = train(first);
  if (!a) {
    ADD_FAILURE() << a.error().message();
    return std::nullopt;
  }
  Plan second = first;
  second.save_to.clear();
  second.load_from = first.save_to;
  auto b = train(second);
  if (!b) {
    ADD_FAILURE() << b.error().message();
    return std::nullopt;
  }
  std::vector<double> joined = a->losses;
  joined.insert(joined.end(), b->losses.begin(), b->losses.end());
  EXPECT_EQ(joined, reference.losses);
  expect_same_parameters(b->params, reference.params);
  Plan onto_device;
  onto_device.config.set_compute_dtype(first.config.dtype);
  onto_device.load_from = first.save_to;
  onto_device.steps = first.steps;
  auto c = train(onto_device);
  if (!c) {
    ADD_FAILURE() << c.error().message();
    return std::nullopt;
  }
  EXPECT_EQ(c->losses, b->losses);
  return std::move(*b);
}

TEST(TrainerBuilder, RefusesBadSettingsWithTheirNames) {
  auto errors = on_ranks(1, [](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    {
      TrainerBuilder none;
      auto t = co_await none.build(*model);
      EXPECT_FALSE(t);
      if (!t) EXPECT_NE(t.error().message().find("no communicator"), std::string::npos) << t.error().message();
    }
    struct Case {
      std::function<void(TrainerBuilder&)> edit;
      std::string expect;
    };
    const std::vector<Case> cases = {
        {[](TrainerBuilder& b) { b.zero_stage(5); }, "zero_stage=5"},
        {[](TrainerBuilder& b) { b.max_live_bytes(100); }, "max_live_bytes=100: must be at least the largest fetch unit"},
        {[](TrainerBuilder& b) { b.gradient_accumulation_steps(0); }, "gradient_accumulation_steps=0"},
        {[](TrainerBuilder& b) { b.adamw(-1.0f); }, "lr=-1"},
        {[](TrainerBuilder& b) { b.sgd(0.1f, 1.5f); }, "momentum=1.5"},
        {[](TrainerBuilder& b) { b.offload_params(OffloadOptions{.device = OffloadDevice::cpu}); },
         "offload_params=cpu"},
        {[](TrainerBuilder& b) { b.mixed_precision(modules::DataType::i32); }, "dtype=i32"},
    };
    for (const auto& k : cases) {
      TrainerBuilder b(small_config());
      b.communicator(comm);
      k.edit(b);
      auto t = co_await b.build(*model);
      EXPECT_FALSE(t) << k.expect;
      if (!t) EXPECT_NE(t.error().message().find(k.expect), std::string::npos) << t.error().message();
    }
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

TEST(Trainer, LossFallsAndStatsAreFilled) {
  Plan p;
  p.steps = 12;
  auto run = train(p);
  ASSERT_TRUE(run) << run.error().message();
  EXPECT_LT(run->losses.back(), 0.8 * run->losses.front());
  EXPECT_EQ(run->steps_done, 12);
}

// fp32 without loss scaling: gradients that overflow skip the step (weights unchanged), and the
// step's figures say so; training goes on.
TEST(Trainer, NonFiniteGradientsSkipTheStepAndSaySo) {
  auto errors = on_ranks(2, [](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    auto config = small_config();
    config.optimizer = OptimizerKind::sgd;
    config.momentum = 0;
    config.max_grad_norm = 0;
    config.lr = 1e30f;  // the first step throws the weights far enough to overflow the next backward
    TrainerBuilder b(config);
    b.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await b.build(*model));
    int skipped = 0;
    for (int i = 0; i < 4; ++i) {
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(task().batch(static_cast<std::uint64_t>(i), kBatch, kSeq).rank_rows(rank, 2)));
      if (stats.optimizer.last_skipped) {
        ++skipped;
        EXPECT_FALSE(std::isfinite(stats.optimizer.grad_norm)) << stats.optimizer.grad_norm;
      }
    }
    EXPECT_GE(skipped, 1);
    EXPECT_EQ(t.steps_done(), 4);
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

// Ranks built with different settings or models (#33 items 4 and 9: another --seed or --lr
// trained in silence; another shape crashed rank 0 in the engine's first collective) fail when
// the trainer is built, every rank naming each difference, before any collective of training.
TEST(Trainer, RanksThatDisagreeFailAtBuildNamingEachDifference) {
  struct Case {
    std::function<void(int rank, TrainerConfig&, modules::GptConfig&)> change;
    std::vector<std::string> expect;
  };
  const Case cases[] = {
      {[](int rank, TrainerConfig& c, modules::GptConfig&) {
         if (rank == 1) c.lr = 0.123f;
         if (rank == 2) c.seed = 7;
       },
       {"lr (rank 1 unlike rank 0", "seed (rank 2 unlike rank 0"}},
      {[](int rank, TrainerConfig&, modules::GptConfig& m) {
         if (rank == 2) m.dim = 32;
       },
       {"the model's parameters (names and shapes) (rank 2 unlike rank 0"}},
      {[](int rank, TrainerConfig& c, modules::GptConfig&) {
         if (rank == 1) c.ranks_agree_on["--steps"] = "9";
         else c.ranks_agree_on["--steps"] = "4";
       },
       {"--steps (rank 1 unlike rank 0"}},
  };
  for (const auto& k : cases) {
    std::vector<std::string> messages(3);
    auto errors = on_ranks(3, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
      TrainerConfig config = small_config();
      modules::GptConfig shape = kModel;
      k.change(rank, config, shape);
      COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(shape));
      TrainerBuilder b(config);
      b.communicator(comm);
      auto built = co_await b.build(*model);
      if (built) co_return fail(ErrorCode::internal, "rank ", rank, " built a trainer");
      messages[static_cast<std::size_t>(rank)] = built.error().message();
      co_return Result<void>{};
    });
    ASSERT_TRUE(errors.empty()) << errors.front();
    for (int rank = 0; rank < 3; ++rank)
      for (const auto& words : k.expect)
        EXPECT_NE(messages[static_cast<std::size_t>(rank)].find(words), std::string::npos)
            << "rank " << rank << ": " << messages[static_cast<std::size_t>(rank)];
  }
}

TEST(Trainer, StepRefusesRowsThatDoNotSplitIntoMicroBatches) {
  auto errors = on_ranks(1, [](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    auto config = small_config();
    config.gradient_accumulation_steps = 5;
    TrainerBuilder b(config);
    b.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await b.build(*model));
    auto stats = co_await t.step(task().batch(0, kBatch, kSeq));
    EXPECT_FALSE(stats);
    if (!stats) EXPECT_NE(stats.error().message().find("gradient_accumulation_steps=5"), std::string::npos);
    EXPECT_EQ(t.steps_done(), 0);
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

class ResumeTest : public ::testing::TestWithParam<int> {};

// N steps, save, a new process's worth of objects loads it, M more steps: the same losses, bit
// for bit, as N + M uninterrupted.
TEST_P(ResumeTest, ResumeIsExact) {
  const int stage = GetParam();
  const fs::path dir = scratch("resume" + std::to_string(stage));
  Plan whole;
  whole.config = small_config(stage);
  whole.steps = 6;
  auto all = train(whole);
  ASSERT_TRUE(all) << all.error().message();

  Plan first = whole;
  first.steps = 3;
  first.save_to = dir;
  auto a = train(first);
  ASSERT_TRUE(a) << a.error().message();
  ASSERT_TRUE(fs::exists(dir / "latest"));
  ASSERT_TRUE(fs::exists(dir / "step-00000003" / "manifest.json"));

  Plan second = whole;
  second.steps = 3;
  second.load_from = dir;
  auto b = train(second);
  ASSERT_TRUE(b) << b.error().message();
  EXPECT_EQ(b->steps_done, 6);
  std::vector<double> joined = a->losses;
  joined.insert(joined.end(), b->losses.begin(), b->losses.end());
  EXPECT_EQ(joined, all->losses);
  expect_same_parameters(b->params, all->params);
}

INSTANTIATE_TEST_SUITE_P(Stages, ResumeTest, ::testing::Values(1, 2, 3));

// Saved at world size 2, loaded at 1, 3 and 4: the same parameters bit for bit, and training goes
// on as the world-size-2 run does (within the tolerance of a different reduction order).
TEST(Trainer, LoadsAtAnotherWorldSize) {
  const fs::path dir = scratch("reshard");
  Plan save;
  save.world = 2;
  save.steps = 3;
  save.save_to = dir;
  auto saved = train(save);
  ASSERT_TRUE(saved) << saved.error().message();
  Plan cont;
  cont.world = 2;
  cont.steps = 3;
  cont.load_from = dir;
  auto reference = train(cont);
  ASSERT_TRUE(reference) << reference.error().message();

  for (int world : {1, 3, 4}) {
    Plan load;
    load.world = world;
    load.steps = 0;
    load.load_from = dir;
    auto loaded = train(load);
    ASSERT_TRUE(loaded) << world << ": " << loaded.error().message();
    expect_same_parameters(loaded->params, saved->params);

    Plan more = cont;
    more.world = world;
    auto run = train(more);
    ASSERT_TRUE(run) << run.error().message();
    ASSERT_EQ(run->losses.size(), reference->losses.size());
    for (std::size_t i = 0; i < run->losses.size(); ++i)
      EXPECT_NEAR(run->losses[i], reference->losses[i], 1e-4 * std::abs(reference->losses[i]))
          << "world " << world << " step " << i;
  }
}

// The previous checkpoint stays the one `latest` names until the next is confirmed by all ranks.
// The optimizer offloaded to pinned host memory trains exactly as on the device, and its
// checkpoints resume exactly (the masters and moments come from host memory and go back there).
TEST(Trainer, CpuOffloadTrainsAndResumesLikeTheDevice) {
  const fs::path dir = scratch("offload");
  Plan device;
  device.steps = 6;
  auto reference = train(device);
  ASSERT_TRUE(reference) << reference.error().message();
  Plan first;
  first.config.offload_optimizer.device = OffloadDevice::cpu;
  first.steps = 3;
  first.save_to = dir;
  expect_resumes_like(*reference, first);
}

// Optimizer state on NVMe (swapped through pinned buffers each step) trains exactly as on the
// device, and its checkpoints resume exactly: the masters and moments are staged as the swapper
// reads them in, and a load writes them back to the swap files. Checkpoints go across: a device
// run continues from the NVMe run's checkpoint and an NVMe run (at another world size too) from
// a device run's, whose f32 parameters stand for the masters it never kept apart.
TEST(Trainer, NvmeOffloadTrainsAndResumesLikeTheDevice) {
  const fs::path dir = scratch("nvme_offload");
  Plan device;
  device.steps = 6;
  auto reference = train(device);
  ASSERT_TRUE(reference) << reference.error().message();
  Plan first;
  first.steps = 3;
  first.config.offload_optimizer.device = OffloadDevice::nvme;
  first.config.offload_optimizer.nvme_path = dir / "state";
  first.config.offload_optimizer.buffer_count = 2;
  first.save_to = dir / "ck";
  const auto b = expect_resumes_like(*reference, first);
  ASSERT_TRUE(b);
  Plan second = first;
  second.save_to.clear();
  second.load_from = dir / "ck";

  Plan device_half;  // an NVMe run from the device run's checkpoint
  device_half.save_to = dir / "device_ck";
  ASSERT_TRUE(train(device_half));
  Plan from_device = second;
  from_device.load_from = dir / "device_ck";
  auto d = train(from_device);
  ASSERT_TRUE(d) << d.error().message();
  EXPECT_EQ(d->losses, b->losses);
  expect_same_parameters(d->params, reference->params);

  Plan wider = second;  // and at world size 3, within rounding of the reduction order
  wider.world = 3;
  auto e = train(wider);
  ASSERT_TRUE(e) << e.error().message();
  ASSERT_EQ(e->losses.size(), b->losses.size());
  for (std::size_t i = 0; i < b->losses.size(); ++i) EXPECT_NEAR(e->losses[i], b->losses[i], 1e-4 * b->losses[i]);
}

// Parameters offloaded with the optimizer (ZeRO-Infinity): in pinned memory, or on NVMe in the
// optimizer's swap files, in f32 and bf16 (on NVMe, the master rounded as it is read). Training
// matches the device bit for bit, and checkpoints resume exactly and load into a run that keeps
// its shards on the device.
TEST(Trainer, ParameterOffloadTrainsAndResumesLikeTheDevice) {
  const fs::path dir = scratch("param_offload");
  for (const modules::DataType dtype : {modules::DataType::f32, modules::DataType::bf16}) {
    Plan device;
    device.steps = 6;
    device.config.set_compute_dtype(dtype);
    auto reference = train(device);
    ASSERT_TRUE(reference) << reference.error().message();
    for (const OffloadDevice where : {OffloadDevice::cpu, OffloadDevice::nvme}) {
      SCOPED_TRACE(std::string(collectives::to_string(dtype)) + ", " + std::string(to_string(where)));
      Plan first;
      first.steps = 3;
      first.config.set_compute_dtype(dtype);
      first.config.offload_optimizer = {.device = where, .nvme_path = dir / "state", .buffer_count = 3};
      first.config.offload_params = {.device = where, .buffer_count = 2};
      first.save_to = dir / ("ck_" + std::string(collectives::to_string(dtype)) + "_" + std::string(to_string(where)));
      expect_resumes_like(*reference, first);
    }
  }
}

// An I/O fault while optimizer state streams through the swapper in training: the step fails
// with the store's error (file and offset), nothing hangs, and the checkpoint saved before stays
// loadable and resumes exactly. Two faults: a full disk during the write-back (a file-size limit
// makes every write fail with EFBIG) and swap files truncated behind the store's back (the
// read-ahead comes back short).
TEST(Trainer, AnIoFaultDuringASwapFailsTheStepAndTheCheckpointStaysLoadable) {
  const fs::path dir = scratch("swap_fault");
  Plan device;
  device.steps = 5;
  auto reference = train(device);
  ASSERT_TRUE(reference) << reference.error().message();

  TrainerConfig config = small_config();
  config.offload_optimizer.device = OffloadDevice::nvme;
  config.offload_optimizer.nvme_path = dir / "state";
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  enum class Fault { full_disk, truncated };
  for (const Fault fault : {Fault::full_disk, Fault::truncated}) {
    SCOPED_TRACE(fault == Fault::full_disk ? "full disk" : "truncated");
    fs::remove_all(dir / "ck");
    std::vector<std::string> step_errors(2);
    std::barrier both(2);
    auto errors = on_ranks(2, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
      COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
      TrainerBuilder builder(config);
      builder.communicator(comm);
      COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
      for (int i = 0; i < 2; ++i) {
        const auto global = task().batch(static_cast<std::uint64_t>(t.steps_done()), kBatch, kSeq);
        COSHARD_CO_TRY(co_await t.step(global.rank_rows(rank, comm.size())));
      }
      COSHARD_CO_TRY(co_await t.save_checkpoint(dir / "ck"));
      COSHARD_CO_TRY(co_await t.finish_checkpoint());
      both.arrive_and_wait();  // both ranks idle: the fault goes in
      if (rank == 0) {
        if (fault == Fault::full_disk) {
          rlimit limit = old_limit;
          limit.rlim_cur = 512;
          EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
        } else {
          for (const auto& f : fs::recursive_directory_iterator(dir / "state"))
            if (f.is_regular_file()) fs::resize_file(f.path(), 100);
        }
      }
      both.arrive_and_wait();
      const auto global = task().batch(static_cast<std::uint64_t>(t.steps_done()), kBatch, kSeq);
      auto failed = co_await t.step(global.rank_rows(rank, comm.size()));
      both.arrive_and_wait();
      if (rank == 0) EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &old_limit), 0);
      if (failed) co_return fail(ErrorCode::internal, "the step succeeded despite the fault");
      step_errors[static_cast<std::size_t>(rank)] = failed.error().message();
      co_return Result<void>{};
    });
    ::setrlimit(RLIMIT_FSIZE, &old_limit);
    EXPECT_TRUE(errors.empty()) << errors.front();
    for (const auto& e : step_errors) {
      EXPECT_NE(e.find("unit"), std::string::npos) << e;    // the swap file
      EXPECT_NE(e.find("offset"), std::string::npos) << e;
      std::printf("step error: %s\n", e.c_str());
    }
    Plan resume;  // the checkpoint from before the fault, into a fresh NVMe run
    resume.config = config;
    resume.load_from = dir / "ck";
    auto r = train(resume);
    ASSERT_TRUE(r) << r.error().message();
    EXPECT_EQ(r->losses, std::vector<double>(reference->losses.begin() + 2, reference->losses.end()));
    expect_same_parameters(r->params, reference->params);
  }
}

TEST(Trainer, LatestMovesOnlyWhenPublished) {
  const fs::path dir = scratch("publish");
  Plan p;
  p.steps = 2;
  p.save_to = dir;
  ASSERT_TRUE(train(p));
  auto read_latest = [&] {
    std::ifstream in(dir / "latest");
    std::string s;
    in >> s;
    return s;
  };
  EXPECT_EQ(read_latest(), "step-00000002");
  Plan unpublished;
  unpublished.load_from = dir;
  unpublished.steps = 1;
  unpublished.save_to = dir;
  unpublished.finish = false;  // the trainers go away with the save pending
  ASSERT_TRUE(train(unpublished));
  EXPECT_EQ(read_latest(), "step-00000002");
  EXPECT_FALSE(fs::exists(dir / "step-00000003"));
  Plan resumed;
  resumed.load_from = dir;
  resumed.steps = 0;
  auto r = train(resumed);
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(r->steps_done, 2);
}

// What a crash mid-save leaves behind (a half-written partial folder, a stray temporary file)
// does not disturb loading the last good checkpoint.
TEST(Trainer, CrashLeftoversAreIgnored) {
  const fs::path dir = scratch("leftovers");
  Plan p;
  p.steps = 2;
  p.save_to = dir;
  auto saved = train(p);
  ASSERT_TRUE(saved);
  fs::create_directories(dir / "step-00000003.partial");
  std::ofstream(dir / "step-00000003.partial" / "rank-00000.safetensors") << "half a file";
  std::ofstream(dir / "latest.tmp") << "step-00000003";
  Plan load;
  load.load_from = dir;
  load.steps = 0;
  auto loaded = train(load);
  ASSERT_TRUE(loaded) << loaded.error().message();
  EXPECT_EQ(loaded->steps_done, 2);
  expect_same_parameters(loaded->params, saved->params);
}

// Each kind of damage is refused with its reason, on every rank, and the trainer's state is
// what it was.
TEST(Trainer, RefusesDamagedOrMismatchedCheckpointsUnchanged) {
  const fs::path good = scratch("damage_good");
  Plan p;
  p.steps = 2;
  p.save_to = good;
  ASSERT_TRUE(train(p));
  Plan fresh;
  fresh.steps = 0;
  auto untouched = train(fresh);
  ASSERT_TRUE(untouched);

  struct Case {
    std::string name;
    std::function<void(const fs::path& ck)> damage;
    std::string expect;
    TrainerConfig config = small_config();
  };
  const std::string rank1 = "step-00000002/rank-00001.safetensors";
  std::vector<Case> cases = {
      {"flipped byte",
       [&](const fs::path& ck) {
         std::fstream f(ck / rank1, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(200);
         f.put('\x7f');
       },
       "CRC-32"},
      {"truncated", [&](const fs::path& ck) { fs::resize_file(ck / rank1, 100); }, "truncated or replaced"},
      {"missing file", [&](const fs::path& ck) { fs::remove(ck / rank1); }, "cannot open"},
      {"bad manifest",
       [&](const fs::path& ck) { std::ofstream(ck / "step-00000002" / "manifest.json") << "{\"format\": 1"; },
       "not a JSON object"},
      {"latest names nothing", [&](const fs::path& ck) { std::ofstream(ck / "latest") << "../etc"; },
       "not a checkpoint folder name"},
      {"other optimizer", [](const fs::path&) {}, "optimizer adamw, this run uses sgd",
       [] {
         auto c = small_config();
         c.optimizer = OptimizerKind::sgd;
         return c;
       }()},
      {"other model layout", [](const fs::path&) {}, "fetch units",
       [] {
         auto c = small_config();
         c.module_granularity_bytes = 1 << 20;
         return c;
       }()},
  };
  for (const auto& k : cases) {
    const fs::path ck = scratch("damage_case");
    fs::copy(good, ck, fs::copy_options::recursive);
    k.damage(ck);
    Plan load;
    load.config = k.config;
    load.load_from = ck;
    load.steps = 0;
    std::string first_error;
    std::vector<zero::GatheredParameter> after;
    auto errors = on_ranks(2, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
      COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
      TrainerBuilder builder(k.config);
      builder.communicator(comm);
      COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
      auto loaded = co_await t.load_checkpoint(ck);
      EXPECT_FALSE(loaded) << k.name;
      EXPECT_EQ(t.steps_done(), 0);
      COSHARD_CO_TRY_ASSIGN(auto params, co_await t.engine().gather_parameters());
      if (rank == 0) after = std::move(params);
      if (!loaded) co_return fail(std::move(loaded).error());
      co_return Result<void>{};
    });
    ASSERT_EQ(errors.size(), 2u) << k.name;
    bool named = false;
    for (const auto& e : errors) named = named || e.find(k.expect) != std::string::npos;
    EXPECT_TRUE(named) << k.name << ": " << errors[0] << " | " << errors[1];
    if (k.config.optimizer == OptimizerKind::adamw && k.config.module_granularity_bytes == 0)
      expect_same_parameters(after, untouched->params);
  }
}

TEST(Trainer, ExportThenInitGivesTheSameModel) {
  const fs::path dir = scratch("export");
  const fs::path file = dir / "model.safetensors";
  TrainRun exported;
  auto errors = on_ranks(3, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    TrainerBuilder builder(small_config());
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    for (int i = 0; i < 2; ++i)
      COSHARD_CO_TRY(co_await t.step(task().batch(static_cast<std::uint64_t>(i), kBatch, kSeq).rank_rows(rank, 3)));
    COSHARD_CO_TRY(co_await t.export_safetensors(file));
    COSHARD_CO_TRY_ASSIGN(auto params, co_await t.engine().gather_parameters());
    if (rank == 0) exported.params = std::move(params);
    co_return Result<void>{};
  });
  ASSERT_TRUE(errors.empty()) << errors.front();
  ASSERT_TRUE(fs::exists(file));
  auto file_check = modules::SafetensorsFile::load(file);
  ASSERT_TRUE(file_check);
  EXPECT_NE(file_check->find("h0.attn.qkv.weight"), nullptr);

  errors = on_ranks(2, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
    auto config = small_config();
    config.seed = 99;  // other initial weights, replaced by the file
    TrainerBuilder builder(config);
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    COSHARD_CO_TRY(co_await t.load_safetensors(file));
    COSHARD_CO_TRY_ASSIGN(auto params, co_await t.engine().gather_parameters());
    if (rank == 0) expect_same_parameters(params, exported.params);
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

TEST(HostBatch, TheGlobalBatchDoesNotDependOnTheWorldSize) {
  const auto g = task().batch(7, kBatch, kSeq);
  const auto again = task().batch(7, kBatch, kSeq);
  EXPECT_EQ(g.tokens, again.tokens);
  for (int world : {1, 2, 3, 4}) {
    std::vector<std::int32_t> joined;
    for (int r = 0; r < world; ++r) {
      const auto part = g.rank_rows(r, world);
      joined.insert(joined.end(), part.tokens.begin(), part.tokens.end());
    }
    EXPECT_EQ(joined, g.tokens);
  }
  // Targets are the next tokens.
  for (std::int64_t t = 0; t + 1 < kSeq; ++t) EXPECT_EQ(g.targets[static_cast<std::size_t>(t)], g.tokens[static_cast<std::size_t>(t + 1)]);
}

// llm.c's .bin: 256 int32 of header (magic, version, count), then the ids.
std::vector<std::byte> llmc_file(int version, const std::vector<std::uint32_t>& ids, std::int32_t count = -1) {
  std::vector<std::int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = version;
  header[2] = count >= 0 ? count : static_cast<std::int32_t>(ids.size());
  std::vector<std::byte> out(header.size() * 4);
  std::memcpy(out.data(), header.data(), out.size());
  for (const std::uint32_t id : ids) {
    const std::size_t at = out.size();
    if (version == 1) {
      const auto v = static_cast<std::uint16_t>(id);
      out.resize(at + 2);
      std::memcpy(out.data() + at, &v, 2);
    } else {
      out.resize(at + 4);
      std::memcpy(out.data() + at, &id, 4);
    }
  }
  return out;
}

void write_bytes(const fs::path& p, const std::vector<std::byte>& b) {
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Every row's tokens are a window of the file and its targets the tokens after them.
void expect_windows_of(const HostBatch& b, const std::vector<std::uint32_t>& ids) {
  for (std::int64_t r = 0; r < b.rows; ++r) {
    bool found = false;
    for (std::size_t start = 0; !found && start + static_cast<std::size_t>(b.seq) < ids.size(); ++start) {
      bool same = true;
      for (std::int64_t t = 0; same && t < b.seq; ++t) {
        const auto i = static_cast<std::size_t>(r * b.seq + t);
        same = b.tokens[i] == static_cast<std::int32_t>(ids[start + static_cast<std::size_t>(t)]) &&
               b.targets[i] == static_cast<std::int32_t>(ids[start + static_cast<std::size_t>(t) + 1]);
      }
      found = same;
    }
    EXPECT_TRUE(found) << "row " << r << " is not a window of the file";
  }
}

TEST(TokenFile, ReadsLlmcHeadersAndRawIdsAsWindows) {
  const fs::path dir = scratch("tokens");
  std::vector<std::uint32_t> ids;
  for (std::uint32_t i = 0; i < 500; ++i) ids.push_back((i * 37 + 11) % 1000);
  // llm.c, version 1 (uint16) and 2 (uint32), found by its header whatever the name.
  write_bytes(dir / "gpt2.data", llmc_file(1, ids));
  write_bytes(dir / "llama.data", llmc_file(2, ids));
  for (const char* name : {"gpt2.data", "llama.data"}) {
    SCOPED_TRACE(name);
    auto resolved = resolve_token_format(dir / name, TokenFormat::automatic);
    ASSERT_TRUE(resolved.has_value());
    EXPECT_EQ(*resolved, std::string(name) == "gpt2.data" ? TokenFormat::u16 : TokenFormat::u32);
    auto f = open_data(dir / name, TokenFormat::automatic, 1000, 16, 7);
    ASSERT_TRUE(f.has_value()) << f.error().message();
    EXPECT_EQ((*f)->vocab(), 1000);
    EXPECT_NE((*f)->describe().find("500 tokens"), std::string::npos) << (*f)->describe();
    EXPECT_NE((*f)->describe().find("llm.c header"), std::string::npos);
    expect_windows_of((*f)->batch(3, 8, 16), ids);
  }
  // The same tokens give the same data whatever the width or header (identity differs by width only).
  auto a = open_data(dir / "gpt2.data", TokenFormat::automatic, 1000, 16, 7);
  auto b = open_data(dir / "llama.data", TokenFormat::automatic, 1000, 16, 7);
  EXPECT_EQ((*a)->batch(5, 4, 16).tokens, (*b)->batch(5, 4, 16).tokens);
  // nanoGPT's train.bin: raw uint16, by its name; raw uint32 by the format.
  std::vector<std::byte> raw16(ids.size() * 2), raw32(ids.size() * 4);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto v = static_cast<std::uint16_t>(ids[i]);
    std::memcpy(raw16.data() + 2 * i, &v, 2);
    std::memcpy(raw32.data() + 4 * i, &ids[i], 4);
  }
  write_bytes(dir / "train.bin", raw16);
  write_bytes(dir / "ids32", raw32);
  auto nano = open_data(dir / "train.bin", TokenFormat::automatic, 1000, 16, 7);
  ASSERT_TRUE(nano.has_value()) << nano.error().message();
  EXPECT_NE((*nano)->describe().find("uint16, raw"), std::string::npos) << (*nano)->describe();
  EXPECT_EQ((*nano)->batch(5, 4, 16).tokens, (*a)->batch(5, 4, 16).tokens);
  auto wide = open_data(dir / "ids32", TokenFormat::u32, 1000, 16, 7);
  ASSERT_TRUE(wide.has_value()) << wide.error().message();
  EXPECT_EQ((*wide)->batch(5, 4, 16).tokens, (*a)->batch(5, 4, 16).tokens);
  // Text stays bytes.
  std::ofstream(dir / "book.txt") << "some text that is long enough for a window";
  auto text = open_data(dir / "book.txt", TokenFormat::automatic, 1000, 16, 7);
  ASSERT_TRUE(text.has_value());
  EXPECT_EQ((*text)->vocab(), 256);
}

TEST(TokenFile, DamagedFilesAndIdsTheModelCannotEmbedAreRefusedByName) {
  const fs::path dir = scratch("tokens_bad");
  const std::vector<std::uint32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto message = [&](const std::vector<std::byte>& bytes, TokenFormat format, std::int64_t vocab) {
    auto f = TokenFile::from_bytes(bytes, "f.bin", format, vocab, 1);
    return f ? std::string("accepted") : f.error().message();
  };
  EXPECT_NE(message(llmc_file(3, ids), TokenFormat::automatic, 100).find("llm.c header version 3"), std::string::npos);
  EXPECT_NE(message(llmc_file(1, ids, 11), TokenFormat::automatic, 100).find("counts 11 tokens of 2 bytes, but 20 bytes"),
            std::string::npos);
  EXPECT_NE(message(llmc_file(2, ids), TokenFormat::u16, 100).find("--data-format u16 but its llm.c header (version 2)"),
            std::string::npos);
  std::vector<std::byte> odd(7);
  EXPECT_NE(message(odd, TokenFormat::u16, 100).find("7 bytes is not a whole number of uint16"), std::string::npos);
  EXPECT_NE(message(llmc_file(1, ids), TokenFormat::automatic, 8).find("token 7 is id 8, not below the model's vocabulary of 8"),
            std::string::npos);
  EXPECT_NE(message(llmc_file(1, ids), TokenFormat::automatic, 0).find("vocabulary 0"), std::string::npos);
  write_bytes(dir / "short.bin", llmc_file(1, ids));
  auto short_file = open_data(dir / "short.bin", TokenFormat::automatic, 100, 10, 1);
  ASSERT_FALSE(short_file.has_value());
  EXPECT_NE(short_file.error().message().find("10 tokens; a sequence length of 10 needs at least 11"), std::string::npos)
      << short_file.error().message();
  EXPECT_FALSE(open_data(dir / "missing.bin", TokenFormat::automatic, 100, 4, 1).has_value());
  EXPECT_FALSE(parse_token_format("int16").has_value());
}

TEST(ByteCorpus, ReadsWindowsAndRefusesShortFiles) {
  const fs::path dir = scratch("bytes");
  std::ofstream(dir / "text.txt") << "hello, world";
  auto c = ByteCorpus::open(dir / "text.txt", 1);
  ASSERT_TRUE(c);
  EXPECT_TRUE((*c)->check(8));
  auto refused = (*c)->check(12);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("needs at least 13"), std::string::npos) << refused.error().message();
  const auto b = (*c)->batch(0, 4, 8);
  const std::string text = "hello, world";
  for (std::int64_t r = 0; r < 4; ++r) {
    std::string row;
    for (std::int64_t t = 0; t < 8; ++t) row.push_back(static_cast<char>(b.tokens[static_cast<std::size_t>(r * 8 + t)]));
    EXPECT_NE(text.find(row), std::string::npos) << row;
  }
  EXPECT_FALSE(ByteCorpus::open(dir / "missing.txt", 1));
}

}  // namespace
}  // namespace coshard::trainer
