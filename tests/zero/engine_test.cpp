// The ZeRO engine on the Local backend (ranks are threads, CPU streams, fp32): every stage
// against the unsharded reference on the same global batch, the max_live_bytes budget, no
// hidden syncs, one collective per unit per pass, and prefetch along the recorded trace.
#include <gtest/gtest.h>

#include <barrier>
#include <filesystem>
#include <unistd.h>
#include <functional>
#include <set>
#include <cmath>
#include <random>
#include <thread>

#include "coshard/async/runtime.hpp"
#include "coshard/async/sync.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "support/sanitizers.hpp"
#include "zero/delayed_communicator.hpp"

namespace coshard::zero {
namespace {

using namespace modules;

constexpr GptConfig kConfig{.vocab = 32, .max_seq = 8, .dim = 32, .layers = 2, .heads = 2, .mlp_ratio = 2};
constexpr std::int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr std::int64_t kSeq = 8;
constexpr std::uint64_t kSeed = 7;

struct GlobalBatch {
  std::vector<double> tokens, targets;  // [kGlobalBatch, kSeq]
};

GlobalBatch make_batch(int step) {
  std::mt19937 rng(static_cast<unsigned>(1000 + step));
  GlobalBatch b;
  for (std::int64_t i = 0; i < kGlobalBatch * kSeq; ++i) {
    b.tokens.push_back(static_cast<double>(rng() % kConfig.vocab));
    b.targets.push_back(static_cast<double>(rng() % kConfig.vocab));
  }
  return b;
}

// Rows [begin, end) of the global batch, uploaded.
Result<Batch> slice(Context& ctx, const GlobalBatch& g, std::int64_t begin, std::int64_t end) {
  auto part = [&](const std::vector<double>& v) {
    std::vector<double> rows(v.begin() + begin * kSeq, v.begin() + end * kSeq);
    auto bytes = encode_values(rows, DataType::i32);
    return ctx.upload(bytes, Shape{end - begin, kSeq}, DataType::i32);
  };
  COSHARD_TRY_ASSIGN(Tensor tokens, part(g.tokens));
  COSHARD_TRY_ASSIGN(Tensor targets, part(g.targets));
  return Batch{tokens, targets};
}

AdamWOptions adam() {
  AdamWOptions o;
  o.weight_decay = 0.01f;
  return o;
}

struct Rank {
  Rank() {
    stream = std::make_unique<async::Stream>(std::move(*async::Stream::create(async::Device::cpu(), {.name = "compute"})));
    allocator = std::move(*async::CachingAllocator::create(async::Device::cpu()));
    ctx = std::make_unique<Context>(std::move(*Context::create(*stream, *allocator)));
  }
  ~Rank() { (void)stream->synchronize(); }
  async::Runtime rt;
  std::unique_ptr<async::Stream> stream;
  std::unique_ptr<async::CachingAllocator> allocator;
  std::unique_ptr<Context> ctx;
};

// Stage 0: the whole global batch on one ParameterStore.
std::vector<double> reference_losses(int steps, StepControlOptions control) {
  Rank r;
  auto body = [&]() -> async::Task<Result<std::vector<double>>> {
    COSHARD_CO_TRY_ASSIGN(auto model, make_gpt(kConfig));
    COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(*r.ctx, *model, DataType::f32));
    COSHARD_CO_TRY(co_await store.initialize(*r.ctx, kSeed));
    COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw(adam(), control));
    COSHARD_CO_TRY(opt->add_group(*r.ctx, store.values(), store.grads()));
    CrossEntropyLoss loss;
    std::vector<double> losses;
    for (int step = 0; step < steps; ++step) {
      COSHARD_CO_TRY_ASSIGN(Batch b, slice(*r.ctx, make_batch(step), 0, kGlobalBatch));
      COSHARD_CO_TRY(store.zero_grad(*r.ctx));
      COSHARD_CO_TRY_ASSIGN(Tensor value, co_await forward_backward(*r.ctx, *model, loss, b.inputs, b.targets,
                                                                    opt->loss_scale()));
      COSHARD_CO_TRY(opt->step(*r.ctx, 1e-2f));
      COSHARD_CO_TRY_ASSIGN(auto host, co_await r.ctx->read(value));
      losses.push_back(host[0]);
    }
    co_return losses;
  };
  auto out = r.rt.block_on(body());
  EXPECT_TRUE(out) << out.error().message();
  return out ? *out : std::vector<double>{};
}

struct ZeroRun {
  std::vector<std::vector<EngineStepStats>> stats;  // [rank][step]
  std::vector<FetchUnitInfo> units;
  std::uint64_t strict_blocking_waits = 0;
  std::vector<std::vector<double>> eval_losses;  // [rank][step]
  std::size_t device_bytes = 0;  // rank 0's device memory in use once the engine is built and initialised
  std::string error;
  std::vector<std::string> errors;  // [rank]
};

struct ZeroSetup {
  bool evaluate_between_steps = false;
  int world = 1;
  EngineOptions options;
  StepControlOptions control;
  int steps = 20;
  int micro_batches = 1;
  float lr = 1e-2f;
  bool strict_after_first = false;
  std::function<void(int rank, int step)> before_step;  // host-side, on the rank's thread
  std::chrono::microseconds comm_delay{0};             // a slow link: sleep before each launch
  GptConfig model = kConfig;
  // Once the engine is built, before it is initialised (host-side, on the rank's thread).
  std::function<Result<void>(Engine&, Context&, collectives::Communicator&)> after_create;
};

ZeroRun run_zero(const ZeroSetup& setup) {
  auto comms = collectives::make_local_communicators(setup.world);
  if (!comms) return {.error = comms.error().message()};
  ZeroRun run;
  run.stats.resize(static_cast<std::size_t>(setup.world));
  run.eval_losses.resize(static_cast<std::size_t>(setup.world));
  std::vector<std::string> errors(static_cast<std::size_t>(setup.world));
  std::barrier sync(setup.world);
  std::atomic<std::uint64_t> waits_before{0};
  auto rank_main = [&](int rank) {
    Rank r;
    testing::DelayedCommunicator comm(*(*comms)[static_cast<std::size_t>(rank)], setup.comm_delay);
    auto body = [&]() -> async::Task<Result<void>> {
      COSHARD_CO_TRY_ASSIGN(auto model, make_gpt(setup.model));
      COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw(adam(), setup.control));
      COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(*r.ctx, comm, *model, *opt, setup.options));
      if (setup.after_create) COSHARD_CO_TRY(setup.after_create(*engine, *r.ctx, comm));
      COSHARD_CO_TRY(co_await engine->initialize(kSeed));
      if (rank == 0) {
        run.units = engine->units();
        run.device_bytes = r.allocator->stats().in_use_bytes;
      }
      CrossEntropyLoss loss;
      const std::int64_t per_rank = kGlobalBatch / setup.world;
      const std::int64_t per_micro = per_rank / setup.micro_batches;
      for (int step = 0; step < setup.steps; ++step) {
        const auto global = make_batch(step);
        std::vector<Batch> mbs;
        for (int m = 0; m < setup.micro_batches; ++m) {
          const std::int64_t begin = rank * per_rank + m * per_micro;
          COSHARD_CO_TRY_ASSIGN(Batch b, slice(*r.ctx, global, begin, begin + per_micro));
          mbs.push_back(b);
        }
        if (setup.strict_after_first && step == 1) {
          sync.arrive_and_wait();
          if (rank == 0) {
            waits_before = async::blocking_waits();
            async::set_strict_sync(true);
          }
          sync.arrive_and_wait();
        }
        if (setup.before_step) setup.before_step(rank, step);
        COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->step(loss, mbs, setup.lr));
        run.stats[static_cast<std::size_t>(rank)].push_back(stats);
        if (setup.evaluate_between_steps) {
          COSHARD_CO_TRY_ASSIGN(Batch held_out, slice(*r.ctx, make_batch(10'000 + step), rank * per_rank,
                                                      (rank + 1) * per_rank));
          COSHARD_CO_TRY_ASSIGN(double eval_loss, co_await engine->evaluate(loss, held_out));
          if (!(eval_loss > 0)) co_return fail(ErrorCode::internal, "evaluation loss ", eval_loss);
          run.eval_losses[static_cast<std::size_t>(rank)].push_back(eval_loss);
        }
      }
      if (setup.strict_after_first) {
        sync.arrive_and_wait();
        if (rank == 0) {
          async::set_strict_sync(false);
          run.strict_blocking_waits = async::blocking_waits() - waits_before;
        }
        sync.arrive_and_wait();
      }
      co_return Result<void>{};
    };
    auto result = r.rt.block_on(body());
    if (!result) errors[static_cast<std::size_t>(rank)] = result.error().message();
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < setup.world; ++rank) threads.emplace_back(rank_main, rank);
  for (auto& t : threads) t.join();
  async::set_strict_sync(false);
  for (const auto& e : errors)
    if (!e.empty()) run.error = e;
  run.errors = errors;
  return run;
}

std::vector<double> losses_of(const ZeroRun& run, int rank = 0) {
  std::vector<double> out;
  for (const auto& s : run.stats[static_cast<std::size_t>(rank)]) out.push_back(s.loss);
  return out;
}

struct StageCase {
  int stage;
  FetchMode mode;
};

class ZeroStages : public ::testing::TestWithParam<StageCase> {};

TEST_P(ZeroStages, MatchStageZeroOnTheSameGlobalBatch) {
  const auto [stage, mode] = GetParam();
  const auto reference = reference_losses(20, {});
  ASSERT_EQ(reference.size(), 20u);
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE("world size " + std::to_string(world));
    ZeroSetup setup;
    setup.world = world;
    setup.options.zero_stage = stage;
    setup.options.fetch_mode = mode;
    const auto run = run_zero(setup);
    ASSERT_TRUE(run.error.empty()) << run.error;
    const auto losses = losses_of(run);
    ASSERT_EQ(losses.size(), reference.size());
    for (std::size_t i = 0; i < losses.size(); ++i) {
      if (world == 1)
        EXPECT_EQ(losses[i], reference[i]) << "step " << i << ": world size 1 must be bit-identical to stage 0";
      else
        EXPECT_LE(std::abs(losses[i] - reference[i]), 1e-4 * std::abs(reference[i])) << "step " << i;
    }
    // Every rank reports the same (averaged) loss.
    for (int r = 1; r < world; ++r) EXPECT_EQ(losses_of(run, r), losses);
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroStages,
                         ::testing::Values(StageCase{0, FetchMode::all_gather}, StageCase{1, FetchMode::all_gather},
                                           StageCase{2, FetchMode::all_gather},
                                           StageCase{3, FetchMode::all_gather}, StageCase{3, FetchMode::all_reduce}),
                         [](const auto& info) {
                           return "Stage" + std::to_string(info.param.stage) +
                                  (info.param.mode == FetchMode::all_gather ? "AllGather" : "AllReduce");
                         });

TEST(Engine, UnitsArePaddedToTheWorldSizeAndShardedEvenly) {
  ZeroSetup setup;
  setup.world = 3;
  setup.steps = 1;
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  ASSERT_FALSE(run.units.empty());
  std::int64_t total = 0;
  for (const auto& u : run.units) {
    EXPECT_EQ(u.padded % 3, 0) << u.name;
    EXPECT_GE(u.padded, u.numel);
    EXPECT_LT(u.padded - u.numel, 3);
    EXPECT_EQ(u.shard * 3, u.padded);
    total += u.numel;
  }
  EXPECT_EQ(total, kConfig.parameter_count());
  EXPECT_EQ(run.units.front().parameters, (std::vector<std::string>{"embed.wte", "embed.wpe"}));
}

TEST(Engine, SmallLeafModulesAreCoalescedIntoOneUnit) {
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 2;
  setup.options.module_granularity_bytes = 64 * 1024;  // larger than any module of this model
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  // Fewer units than modules with parameters (2 + 2 layers x 6 + 2), and fewer collectives.
  EXPECT_LT(run.units.size(), 16u);
  const auto reference = reference_losses(2, {});
  EXPECT_LE(std::abs(losses_of(run)[1] - reference[1]), 1e-4 * reference[1]);
}

TEST(Engine, ABudgetJustAboveTheLargestUnitCompletesAndIsNeverExceeded) {
  ZeroSetup probe;
  probe.world = 2;
  probe.steps = 1;
  const auto units = run_zero(probe).units;
  std::size_t largest = 0;
  for (const auto& u : units) largest = std::max(largest, u.padded_bytes);
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 4;
  setup.options.max_live_bytes = largest + 64;
  setup.options.prefetch_bucket_bytes = 1 << 20;  // wants more than the budget holds
  setup.options.max_reuse_distance = 4;
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  for (const auto& rank : run.stats)
    for (const auto& s : rank) {
      EXPECT_LE(s.peak_live_bytes, setup.options.max_live_bytes);
      EXPECT_GT(s.peak_live_bytes, 0u);
    }
  const auto reference = reference_losses(4, {});
  EXPECT_LE(std::abs(losses_of(run)[3] - reference[3]), 1e-4 * reference[3]);
}

TEST(Engine, SteadyStepsHaveNoHiddenSyncsAndOneCollectivePerUnitPerPass) {
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 4;
  setup.strict_after_first = true;
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  EXPECT_EQ(run.strict_blocking_waits, 0u);
  const auto U = run.units.size();
  for (std::size_t step = 1; step < 4; ++step) {
    const auto& s = run.stats[0][step];
    // forward gathers + backward gathers + gradient reduce-scatters, plus the gradient-norm and
    // loss all-reduces of the step.
    EXPECT_EQ(s.gathers, 2 * U) << "step " << step;
    EXPECT_EQ(s.collective_launches, 3 * U + 2) << "step " << step;
    EXPECT_FALSE(s.trace_changed);
  }
}

TEST(Engine, PrefetchGathersAheadAlongTheTrace) {
  ZeroSetup on_demand;
  on_demand.world = 2;
  on_demand.steps = 3;
  const auto cold = run_zero(on_demand);
  ZeroSetup ahead = on_demand;
  ahead.options.prefetch_bucket_bytes = 256 * 1024;
  const auto warm = run_zero(ahead);
  ASSERT_TRUE(cold.error.empty() && warm.error.empty()) << cold.error << warm.error;
  // Step 1 records the trace (no hits); later steps find units in flight or gathered.
  EXPECT_EQ(warm.stats[0][0].prefetch_hits, 0u);
  EXPECT_GT(warm.stats[0][2].hit_rate(), 0.9);
  EXPECT_EQ(cold.stats[0][2].prefetch_hits, 0u);
  // Prefetch changes when, not what: the same collectives and the same losses.
  EXPECT_EQ(warm.stats[0][2].gathers, cold.stats[0][2].gathers);
  EXPECT_EQ(losses_of(warm), losses_of(cold));
}

TEST(Engine, TrainAndEvalKeepTheirOwnTracesSoAlternatingDoesNotThrash) {
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 4;
  setup.options.prefetch_bucket_bytes = 256 * 1024;
  setup.evaluate_between_steps = true;
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  ASSERT_EQ(run.eval_losses[0].size(), 4u);
  EXPECT_EQ(run.eval_losses[0], run.eval_losses[1]);  // averaged over ranks
  for (std::size_t step = 1; step < 4; ++step) {
    EXPECT_FALSE(run.stats[0][step].trace_changed) << "step " << step;
    EXPECT_GT(run.stats[0][step].hit_rate(), 0.9) << "step " << step;
  }
  // Evaluation changes nothing: the training losses match a run without it.
  ZeroSetup plain = setup;
  plain.evaluate_between_steps = false;
  EXPECT_EQ(losses_of(run_zero(plain)), losses_of(run));
}

TEST(Engine, PersistentUnitsStayGatheredForTheStep) {
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 2;
  setup.options.persistence_threshold_bytes = 4096;  // LayerNorms and small biases
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  std::size_t persistent = 0;
  for (const auto& u : run.units) persistent += u.persistent ? 1 : 0;
  ASSERT_GT(persistent, 0u);
  // A persistent unit is gathered once per step, not once per pass.
  EXPECT_EQ(run.stats[0][1].gathers, 2 * run.units.size() - persistent);
}

TEST(Engine, GradientAccumulationOverMicroBatchesMatchesOneBatch) {
  ZeroSetup one;
  one.world = 2;
  one.steps = 3;
  ZeroSetup three = one;
  three.micro_batches = 3;
  for (int stage = 1; stage <= 3; ++stage) {
    one.options.zero_stage = three.options.zero_stage = stage;
    const auto a = run_zero(one);
    const auto b = run_zero(three);
    ASSERT_TRUE(a.error.empty() && b.error.empty()) << a.error << b.error;
    const auto la = losses_of(a), lb = losses_of(b);
    for (std::size_t i = 0; i < la.size(); ++i)
      EXPECT_LE(std::abs(la[i] - lb[i]), 1e-4 * la[i]) << "stage " << stage << " step " << i;
  }
}

// Stage 0 too: every rank holds the whole gradient there, so its norm is not summed over ranks.
TEST(Engine, ClippingUsesTheGlobalNormAcrossRanks) {
  StepControlOptions control;
  control.max_grad_norm = 0.5f;
  const auto reference = reference_losses(5, control);
  for (const int stage : {0, 1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    ZeroSetup setup;
    setup.world = 2;
    setup.steps = 5;
    setup.control = control;
    setup.options.zero_stage = stage;
    const auto run = run_zero(setup);
    ASSERT_TRUE(run.error.empty()) << run.error;
    const auto losses = losses_of(run);
    for (std::size_t i = 0; i < losses.size(); ++i) EXPECT_LE(std::abs(losses[i] - reference[i]), 1e-4 * reference[i]);
    // The norm one rank alone computes over the same global batch (summed over ranks: x sqrt(2)).
    ZeroSetup alone = setup;
    alone.world = 1;
    const auto single = run_zero(alone);
    ASSERT_TRUE(single.error.empty()) << single.error;
    const float norm = run.stats[0].back().optimizer.grad_norm;
    EXPECT_NEAR(norm, single.stats[0].back().optimizer.grad_norm, 1e-4 * norm);
  }
}

TEST(Engine, RejectsBadOptionsWithClearErrors) {
  Rank r;
  auto comms = collectives::make_local_communicators(1);
  ASSERT_TRUE(comms);
  auto model = make_gpt(kConfig);
  auto opt = Optimizer::adamw({});
  ASSERT_TRUE(model && opt);
  EngineOptions o;
  o.zero_stage = 4;
  auto e = Engine::create(*r.ctx, *(*comms)[0], **model, **opt, o);
  ASSERT_FALSE(e);
  EXPECT_NE(e.error().message().find("zero_stage=4"), std::string::npos) << e.error().message();
  o.zero_stage = 3;
  o.max_live_bytes = 100;
  e = Engine::create(*r.ctx, *(*comms)[0], **model, **opt, o);
  ASSERT_FALSE(e);
  EXPECT_NE(e.error().message().find("max_live_bytes=100: must be at least the largest fetch unit"),
            std::string::npos)
      << e.error().message();
  struct Case {
    int stage;
    OffloadTarget optimizer, params;
    std::string expect;
  };
  for (const Case& c : {Case{2, OffloadTarget::cpu, OffloadTarget::cpu, "offload_params=cpu with zero_stage=2"},
                        Case{0, OffloadTarget::cpu, OffloadTarget::none, "offload_optimizer=cpu with zero_stage=0"},
                        Case{0, OffloadTarget::nvme, OffloadTarget::none, "offload_optimizer=nvme with zero_stage=0"},
                        Case{-1, OffloadTarget::none, OffloadTarget::none, "zero_stage=-1: expected 0, 1, 2 or 3"},
                        Case{3, OffloadTarget::none, OffloadTarget::cpu, "offload_params=cpu with offload_optimizer=none"},
                        Case{3, OffloadTarget::cpu, OffloadTarget::nvme, "offload_params=nvme with offload_optimizer=cpu"}}) {
    EngineOptions bad;
    bad.zero_stage = c.stage;
    bad.offload_optimizer = c.optimizer;
    bad.offload_params = c.params;
    bad.offload_optimizer.nvme_path = "unused";
    e = Engine::create(*r.ctx, *(*comms)[0], **model, **opt, bad);
    ASSERT_FALSE(e) << c.expect;
    EXPECT_NE(e.error().message().find(c.expect), std::string::npos) << e.error().message();
  }
  // step_in_backward: only where each update can go ahead alone.
  struct EarlyCase {
    int stage;
    OffloadTarget optimizer;
    StepControlOptions control;
    std::string expect;
  };
  for (const EarlyCase& c :
       {EarlyCase{3, OffloadTarget::none, {}, "step_in_backward with offload_optimizer=none"},
        EarlyCase{1, OffloadTarget::nvme, {}, "step_in_backward with zero_stage=1"},
        EarlyCase{1, OffloadTarget::cpu, {}, "step_in_backward with zero_stage=1"},
        EarlyCase{3, OffloadTarget::cpu, {.max_grad_norm = 1.0f}, "step_in_backward with max_grad_norm=1"},
        EarlyCase{3, OffloadTarget::cpu, {.loss_scaling = LossScaling::fixed}, "step_in_backward with loss scaling"}}) {
    auto controlled = Optimizer::adamw({}, c.control);
    ASSERT_TRUE(controlled);
    EngineOptions bad;
    bad.zero_stage = c.stage;
    bad.offload_optimizer = c.optimizer;
    bad.offload_optimizer.nvme_path = "unused";
    bad.step_in_backward = true;
    e = Engine::create(*r.ctx, *(*comms)[0], **model, **controlled, bad);
    ASSERT_FALSE(e) << c.expect;
    EXPECT_NE(e.error().message().find(c.expect), std::string::npos) << e.error().message();
  }
}


// With timing on, a step reports how long the compute stream stood waiting on communication,
// from device timestamps. Rank 1 arrives 60 ms late to each step, so rank 0's first gather cannot
// complete before it: rank 0's compute stream waits at least that long, and its steps say so.
TEST(Engine, ExposedCommunicationIsMeasuredFromDeviceTimestamps) {
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 3;
  setup.options.timing = true;
  setup.before_step = [](int rank, int) {
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(60));
  };
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  for (const auto& stats : run.stats[0]) {
    ASSERT_TRUE(stats.exposed_comm_ms.has_value());
    EXPECT_GE(*stats.exposed_comm_ms, 50.0);
    EXPECT_LT(*stats.exposed_comm_ms, 10'000.0);
  }
  for (const auto& stats : run.stats[1]) {
    ASSERT_TRUE(stats.exposed_comm_ms.has_value());
    EXPECT_GE(*stats.exposed_comm_ms, 0.0);
  }
  // Without timing the figure is absent, never a made-up zero.
  ZeroSetup plain;
  plain.world = 2;
  plain.steps = 1;
  const auto untimed = run_zero(plain);
  ASSERT_TRUE(untimed.error.empty()) << untimed.error;
  EXPECT_FALSE(untimed.stats[0][0].exposed_comm_ms.has_value());
  EXPECT_TRUE(untimed.stats[0][0].timeline.empty());
}

// The timeline of a stage-3 step: every unit computes forward and backward on the compute
// track; gathers (fetched, then prefetched along the trace) and reduce-scatters on the comm
// track; releases; spans well-formed and within the step.
TEST(Engine, TimelineHasEveryPhaseOnItsTrack) {
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 3;
  setup.options.record_timeline = true;
  setup.options.prefetch_bucket_bytes = 1 << 20;
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  const std::size_t units = run.units.size();
  for (int step = 0; step < 3; ++step) {
    const auto& spans = run.stats[0][static_cast<std::size_t>(step)].timeline;
    ASSERT_FALSE(spans.empty());
    std::map<std::string, std::size_t> count;
    std::set<std::string> tracks;
    double first = 1e300, last = -1e300;
    for (const auto& sp : spans) {
      EXPECT_LE(sp.start_ms, sp.end_ms) << sp.category << " " << sp.name;
      EXPECT_GE(sp.start_ms, 0.0) << sp.category;
      ++count[sp.category];
      tracks.insert(sp.track);
      first = std::min(first, sp.start_ms);
      last = std::max(last, sp.end_ms);
      if (sp.category == "forward" || sp.category == "backward" || sp.category == "wait" || sp.category == "release" ||
          sp.category == "optimizer")
        EXPECT_EQ(sp.track, "compute") << sp.category;
      else
        EXPECT_EQ(sp.track, "comm") << sp.category;
    }
    EXPECT_EQ(tracks.size(), 2u);
    EXPECT_EQ(count["forward"], units);
    EXPECT_EQ(count["backward"], units);
    EXPECT_EQ(count["reduce_scatter"], units);
    EXPECT_EQ(count["fetch"] + count["prefetch"], 2 * units);  // one gather per unit per pass
    EXPECT_EQ(count["release"], 2 * units);
    EXPECT_EQ(count["optimizer"], 1u);
    if (step == 0) EXPECT_EQ(count["prefetch"], 0u);  // no trace yet
    else EXPECT_GT(count["prefetch"], units);          // most gathers ahead of use
    EXPECT_LT(last - first, 60'000.0);
  }
}

// An epoch from another stream that passes late (a loaded machine runs that stream's worker
// last): no stream of the engine runs ahead of it, so no span can be stamped before it (the trace
// once held spans at -1.9 ms).
TEST(Engine, TimelineNeverStartsBeforeALateEpoch) {
  auto clock = async::Stream::create(async::Device::cpu(), {.name = "clock"});
  ASSERT_TRUE(clock);
  std::atomic<bool> go{false};
  ASSERT_TRUE(clock->launch([&] {
    while (!go.load()) std::this_thread::yield();
  }));
  auto epoch = clock->record_timed();
  ASSERT_TRUE(epoch);
  bool compute_held = false, comm_held = false;
  ZeroSetup setup;
  setup.steps = 2;
  setup.options.record_timeline = true;
  setup.after_create = [&](Engine& engine, Context& ctx, collectives::Communicator& comm) -> Result<void> {
    COSHARD_TRY(engine.set_timeline_epoch(*epoch));
    COSHARD_TRY_ASSIGN(auto on_compute, ctx.stream().record());
    COSHARD_TRY_ASSIGN(auto on_comm, comm.stream().record());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    compute_held = !on_compute.ready();
    comm_held = !on_comm.ready();
    go = true;
    return {};
  };
  const auto run = run_zero(setup);
  ASSERT_TRUE(run.error.empty()) << run.error;
  EXPECT_TRUE(compute_held) << "the compute stream ran ahead of the timeline's epoch";
  EXPECT_TRUE(comm_held) << "the communication stream ran ahead of the timeline's epoch";
  for (const auto& stats : run.stats[0]) {
    ASSERT_FALSE(stats.timeline.empty());
    for (const auto& sp : stats.timeline) EXPECT_GE(sp.start_ms, 0.0) << sp.category << " " << sp.name;
  }
}

// Adaptive prefetch end to end: from its own measurements (device timestamps, one step behind) it
// keeps the hit rate high on a fast and a slow link and changes nothing in the math.
TEST(Engine, AdaptivePrefetchFollowsTheMeasuredLink) {
  auto run_with = [](std::chrono::microseconds delay, bool adaptive) {
    ZeroSetup setup;
    setup.world = 2;
    setup.steps = 5;
    setup.model = GptConfig{.vocab = 32, .max_seq = 8, .dim = 128, .layers = 2, .heads = 4, .mlp_ratio = 4};
    setup.comm_delay = delay;
    setup.options.adaptive_prefetch = adaptive;
    return run_zero(setup);
  };
  const auto fast = run_with(std::chrono::microseconds(0), true);
  const auto slow = run_with(std::chrono::microseconds(15'000), true);
  const auto on_demand = run_with(std::chrono::microseconds(0), false);
  ASSERT_TRUE(fast.error.empty()) << fast.error;
  ASSERT_TRUE(slow.error.empty()) << slow.error;
  ASSERT_TRUE(on_demand.error.empty()) << on_demand.error;
  for (int step = 2; step < 5; ++step) {  // step 1 measures; step 2 on decides from measurements
    EXPECT_GT(fast.stats[0][static_cast<std::size_t>(step)].hit_rate(), 0.9) << "step " << step;
    EXPECT_GT(slow.stats[0][static_cast<std::size_t>(step)].hit_rate(), 0.9) << "step " << step;
    ASSERT_TRUE(slow.stats[0][static_cast<std::size_t>(step)].exposed_comm_ms.has_value());
  }
  // How far ahead it gathers for a given link is asserted on given measurements
  // (prefetch_horizon_test.cpp), not from wall time here: under load a "fast" link measures slow.
  // Whatever it decided, the numbers are on-demand fetching's.
  EXPECT_EQ(losses_of(fast), losses_of(on_demand));
  EXPECT_EQ(losses_of(slow), losses_of(on_demand));
}

// Optimizer offload to pinned host memory runs the same kernels in the same order: the losses
// are bit-identical to the optimizer on the device, at every stage, with clipping, at world sizes
// 1 and 2; the step moves gradient shards out and parameter shards back, and adds no host sync.
TEST(Engine, CpuOptimizerOffloadGivesTheSameLosses) {
  StepControlOptions clip;
  clip.max_grad_norm = 0.5f;
  for (int stage : {1, 2, 3}) {
    for (int world : {1, 2}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", world " + std::to_string(world));
      ZeroSetup setup;
      setup.world = world;
      setup.steps = 6;
      setup.control = clip;
      setup.options.zero_stage = stage;
      const auto device = run_zero(setup);
      setup.options.offload_optimizer = OptimizerOffload::cpu;
      setup.strict_after_first = true;
      const auto offloaded = run_zero(setup);
      ASSERT_TRUE(device.error.empty()) << device.error;
      ASSERT_TRUE(offloaded.error.empty()) << offloaded.error;
      EXPECT_EQ(losses_of(offloaded), losses_of(device));
      EXPECT_EQ(offloaded.strict_blocking_waits, 0u);
      const auto& stats = offloaded.stats[0].back();
      std::size_t shard_bytes = 0;
      for (const auto& u : offloaded.units) shard_bytes += static_cast<std::size_t>(u.shard) * 4;
      EXPECT_EQ(stats.swap_bytes, 2 * shard_bytes);
      EXPECT_GT(stats.optimizer.grad_norm, 0.0f);
      EXPECT_EQ(stats.optimizer.steps, 6);
    }
  }
}

// The offloaded CPU step during backward: each unit stepped on the host as soon as its gradient
// shard is out gives the bits of stepping after backward (without clipping each update depends
// on its own unit alone), at stages 2 and 3, world sizes 1 and 2, with the parameters on the
// device or in pinned memory, with evaluation between steps; steady steps stay free of blocking
// waits, and every unit was stepped during backward.
TEST(Engine, StepInBackwardGivesTheBitsOfSteppingAfterIt) {
  const auto folder = std::filesystem::current_path() / ("engine_sib_" + std::to_string(::getpid()));
  std::filesystem::remove_all(folder);
  struct Case {
    int stage, world;
    OffloadTarget optimizer, params;
  };
  constexpr auto none = OffloadTarget::none, cpu = OffloadTarget::cpu, nvme = OffloadTarget::nvme;
  // nvme: the swapper's pass runs beside forward and backward (two swap buffers: one stepping,
  // one reading ahead, so reads wait for backward to hand units over).
  for (const Case& c : {Case{2, 1, cpu, none}, Case{2, 2, cpu, none}, Case{3, 1, cpu, none}, Case{3, 2, cpu, none},
                        Case{3, 2, cpu, cpu}, Case{2, 2, nvme, none}, Case{3, 1, nvme, none}, Case{3, 2, nvme, none},
                        Case{3, 2, nvme, cpu}, Case{3, 2, nvme, nvme}}) {
    // Under a sanitizer the two-rank cases alone (each placement and stage still runs).
    if (coshard::testing::kSanitized && c.world == 1) continue;
    SCOPED_TRACE("stage " + std::to_string(c.stage) + ", world " + std::to_string(c.world) + ", optimizer " +
                 std::string(to_string(c.optimizer)) + ", params " + std::string(to_string(c.params)));
    ZeroSetup setup;
    setup.world = c.world;
    setup.steps = 6;
    setup.evaluate_between_steps = true;
    setup.options.zero_stage = c.stage;
    setup.options.offload_optimizer = c.optimizer;
    setup.options.offload_params = c.params;
    setup.options.offload_optimizer.nvme_path = folder;
    setup.options.offload_optimizer.buffer_count = 2;
    const auto after = run_zero(setup);
    setup.options.step_in_backward = true;
    setup.strict_after_first = true;
    const auto during = run_zero(setup);
    ASSERT_TRUE(after.error.empty()) << after.error;
    ASSERT_TRUE(during.error.empty()) << during.error;
    EXPECT_EQ(losses_of(during), losses_of(after));
    EXPECT_EQ(during.eval_losses, after.eval_losses);
    EXPECT_EQ(during.strict_blocking_waits, 0u);
    for (int rank = 0; rank < c.world; ++rank) {
      for (std::size_t step = 0; step < during.stats[0].size(); ++step) {
        const auto& d = during.stats[static_cast<std::size_t>(rank)][step];
        const auto& a = after.stats[static_cast<std::size_t>(rank)][step];
        EXPECT_EQ(d.stepped_in_backward, during.units.size());
        EXPECT_EQ(a.stepped_in_backward, 0u);
        // The reported norm sums the units in backward order instead of unit order: the same up
        // to rounding (without clipping it decides nothing).
        EXPECT_NEAR(d.optimizer.grad_norm, a.optimizer.grad_norm, 1e-5f * a.optimizer.grad_norm);
        EXPECT_EQ(d.optimizer.steps, a.optimizer.steps);
        EXPECT_EQ(d.swap_bytes, a.swap_bytes) << "the same transfers, at other times";
      }
    }
  }
  std::filesystem::remove_all(folder);
  // Two micro-batches: the shards are out only after the last, so the step runs after backward.
  ZeroSetup accumulate;
  accumulate.steps = 2;
  accumulate.micro_batches = 2;
  accumulate.options.offload_optimizer = OptimizerOffload::cpu;
  accumulate.options.step_in_backward = true;
  const auto run = run_zero(accumulate);
  ASSERT_TRUE(run.error.empty()) << run.error;
  EXPECT_EQ(run.stats[0].back().stepped_in_backward, 0u);
}

// Where each step's time went (StepTimeSplit): the CPU streams' busy time, the host optimizer's
// only when it is offloaded, and with anything on NVMe the disk's bytes and busy time, each
// direction within the wall time and `busy` between the larger direction and their sum. The
// optimizer alone on NVMe reads and writes back the same swap files every steady step.
TEST(Engine, EachStepsTimeIsSplitIntoComputeOptimizerAndTheDisk) {
  const auto folder = std::filesystem::current_path() / ("engine_split_" + std::to_string(::getpid()));
  std::filesystem::remove_all(folder);
  struct Case {
    OffloadTarget optimizer, params;
  };
  constexpr auto none = OffloadTarget::none, cpu = OffloadTarget::cpu, nvme = OffloadTarget::nvme;
  for (const Case& c : {Case{none, none}, Case{cpu, cpu}, Case{nvme, none}, Case{nvme, nvme}}) {
    SCOPED_TRACE("optimizer " + std::string(to_string(c.optimizer)) + ", params " + std::string(to_string(c.params)));
    ZeroSetup setup;
    setup.world = 2;
    setup.steps = 4;
    setup.options.zero_stage = 3;
    setup.options.offload_optimizer = c.optimizer;
    setup.options.offload_params = c.params;
    setup.options.offload_optimizer.nvme_path = folder;
    const auto run = run_zero(setup);
    ASSERT_TRUE(run.error.empty()) << run.error;
    const bool on_nvme = c.optimizer == nvme || c.params == nvme;
    for (int rank = 0; rank < setup.world; ++rank) {
      const auto& steps = run.stats[static_cast<std::size_t>(rank)];
      for (std::size_t step = 0; step < steps.size(); ++step) {
        const StepTimeSplit& t = steps[step].time_split;
        EXPECT_GT(t.wall_ms, 0.0);
        ASSERT_TRUE(t.compute_ms.has_value());
        EXPECT_GT(*t.compute_ms, 0.0);
        ASSERT_TRUE(t.compute_idle_ms().has_value());
        EXPECT_GE(*t.compute_idle_ms(), 0.0);
        EXPECT_EQ(t.optimizer_ms.has_value(), c.optimizer != none);
        if (t.optimizer_ms) EXPECT_GT(*t.optimizer_ms, 0.0);
        EXPECT_EQ(t.nvme, on_nvme);
        if (!on_nvme) {
          EXPECT_EQ(t.nvme_read_bytes + t.nvme_written_bytes, 0u);
          continue;
        }
        EXPECT_GT(t.nvme_read_bytes, 0u);
        EXPECT_GT(t.nvme_written_bytes, 0u);
        EXPECT_GT(t.nvme_read_ms, 0.0);
        EXPECT_GT(t.nvme_write_ms, 0.0);
        EXPECT_LE(t.nvme_busy_ms, t.nvme_read_ms + t.nvme_write_ms + 1e-6);
        EXPECT_GE(t.nvme_busy_ms, std::max(t.nvme_read_ms, t.nvme_write_ms) - 1e-6);
        EXPECT_LE(t.nvme_busy_ms, t.wall_ms + 1e-6);
        // (With the parameters on NVMe a read ahead may finish on either side of a step's end.)
        if (step > 0 && c.params == none) {
          const StepTimeSplit& first = steps[1].time_split;
          EXPECT_EQ(t.nvme_read_bytes, first.nvme_read_bytes) << "steady steps move the same bytes";
          EXPECT_EQ(t.nvme_read_bytes, t.nvme_written_bytes) << "each swap file read and written back";
        }
      }
    }
  }
  std::filesystem::remove_all(folder);
}

// A non-finite gradient: stepping after backward skips the step; with step_in_backward the units
// already stepped cannot be skipped, so the step fails on every rank, saying so. (A huge learning
// rate makes the parameters overflow at the first step, so the second step's gradients are not
// finite.)
TEST(Engine, StepInBackwardFailsEveryRankOnANonFiniteGradient) {
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 3;
  setup.lr = 1e38f;
  setup.options.offload_optimizer = OptimizerOffload::cpu;
  const auto after = run_zero(setup);
  ASSERT_TRUE(after.error.empty()) << after.error;
  bool skipped = false;
  for (const auto& st : after.stats[0]) skipped = skipped || st.optimizer.last_skipped;
  EXPECT_TRUE(skipped) << "the learning rate did not make a gradient overflow";
  setup.options.step_in_backward = true;
  const auto during = run_zero(setup);
  for (const auto& e : during.errors)
    EXPECT_NE(e.find("a non-finite gradient with step_in_backward"), std::string::npos) << "[" << e << "]";
}

// step_in_backward with the optimizer on NVMe, swap files truncated behind the store's back
// between steps: the swapper's pass beside forward and backward fails its read-ahead, backward
// goes on (the ranks launch the same collectives), and the step fails on every rank with the
// store's error naming the file and offset; nothing hangs.
TEST(Engine, StepInBackwardOnNvmeFailsEveryRankOnAnIoFaultNamingTheFile) {
  const auto folder = std::filesystem::current_path() / ("engine_sib_fault_" + std::to_string(::getpid()));
  std::filesystem::remove_all(folder);
  ZeroSetup setup;
  setup.world = 2;
  setup.steps = 3;
  setup.options.zero_stage = 3;
  setup.options.offload_optimizer = OptimizerOffload::nvme;
  setup.options.offload_optimizer.nvme_path = folder;
  setup.options.step_in_backward = true;
  setup.before_step = [&](int rank, int step) {
    if (step != 2) return;  // each rank cuts its own files, its last step's writes done
    for (const auto& f : std::filesystem::directory_iterator(folder / ("rank" + std::to_string(rank) + "-of-2")))
      std::filesystem::resize_file(f.path(), 100);
  };
  const auto run = run_zero(setup);
  ASSERT_EQ(run.errors.size(), 2u);
  for (const auto& e : run.errors) {
    EXPECT_NE(e.find("unit"), std::string::npos) << "[" << e << "]";
    EXPECT_NE(e.find("offset"), std::string::npos) << "[" << e << "]";
  }
  for (const auto& stats : run.stats) EXPECT_EQ(stats.size(), 2u) << "the first two steps, and not the third";
  std::filesystem::remove_all(folder);
}

// Optimizer state on NVMe, streamed through pinned buffers by the swapper each step: the same
// kernels in the same order, so the same losses bit for bit (AdamW: master and two moments per
// sub-group), at stages 1 and 3 and world sizes 1 and 2.
TEST(Engine, NvmeOptimizerOffloadGivesTheSameLosses) {
  const auto folder = std::filesystem::current_path() / ("engine_nvme_" + std::to_string(::getpid()));
  std::filesystem::remove_all(folder);
  StepControlOptions clip;
  clip.max_grad_norm = 0.5f;
  for (int stage : {1, 3}) {
    for (int world : {1, 2}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", world " + std::to_string(world));
      ZeroSetup setup;
      setup.world = world;
      setup.steps = 5;
      setup.control = clip;
      setup.options.zero_stage = stage;
      const auto device = run_zero(setup);
      setup.options.offload_optimizer = OptimizerOffload::nvme;
      setup.options.offload_optimizer.nvme_path = folder;
      setup.options.offload_optimizer.buffer_count = 3;
      bool saw_swap_file = false;
      const std::filesystem::path rank0 = folder / ("rank0-of-" + std::to_string(world));
      setup.before_step = [&](int rank, int step) {
        if (rank == 0 && step == 1) saw_swap_file = std::filesystem::exists(rank0 / "unit0");
      };
      const auto swapped = run_zero(setup);
      EXPECT_TRUE(saw_swap_file) << "the state is in swap files during the run";
      EXPECT_FALSE(std::filesystem::exists(rank0)) << "and they are gone after it";
      ASSERT_TRUE(device.error.empty()) << device.error;
      ASSERT_TRUE(swapped.error.empty()) << swapped.error;
      EXPECT_EQ(losses_of(swapped), losses_of(device));
      std::size_t shard_bytes = 0;
      for (const auto& u : swapped.units) shard_bytes += static_cast<std::size_t>(u.shard) * 4;
      // gradients out, parameters back, and master + two moments read and written
      EXPECT_GE(swapped.stats[0].back().swap_bytes, 2 * shard_bytes + 2 * 3 * shard_bytes);
    }
  }
  std::filesystem::remove_all(folder);
}

// Parameter offload (stage 3): the shards leave the device, into pinned memory (the masters, or a
// copy the nvme optimizer refreshes) or onto NVMe (the masters in the swap files, read ahead
// along the trace). The same kernels in the same order: training and evaluation losses are bit
// for bit those of the same optimizer offload with the shards on the device, the device holds
// less by at least every shard, and steady steps add no hidden host sync.
TEST(Engine, ParameterOffloadGivesTheSameLossesAndFreesTheDeviceShards) {
  const auto folder = std::filesystem::current_path() / ("engine_params_" + std::to_string(::getpid()));
  std::filesystem::remove_all(folder);
  StepControlOptions clip;
  clip.max_grad_norm = 0.5f;
  struct Case {
    OffloadTarget optimizer, params;
  };
  for (const Case c : {Case{OffloadTarget::cpu, OffloadTarget::cpu}, Case{OffloadTarget::nvme, OffloadTarget::cpu},
                       Case{OffloadTarget::nvme, OffloadTarget::nvme}}) {
    for (int world : {1, 2}) {
      SCOPED_TRACE(std::string("optimizer ") + std::string(to_string(c.optimizer)) + ", params " +
                   std::string(to_string(c.params)) + ", world " + std::to_string(world));
      ZeroSetup setup;
      setup.world = world;
      setup.steps = 5;
      setup.control = clip;
      setup.evaluate_between_steps = true;
      setup.options.zero_stage = 3;
      setup.options.prefetch_bucket_bytes = 16 << 10;
      setup.options.offload_optimizer = c.optimizer;
      setup.options.offload_optimizer.nvme_path = folder;
      setup.options.offload_optimizer.buffer_count = 3;
      setup.options.offload_params.buffer_count = 3;
      const auto resident = run_zero(setup);
      setup.options.offload_params = c.params;
      setup.strict_after_first = true;
      const auto offloaded = run_zero(setup);
      ASSERT_TRUE(resident.error.empty()) << resident.error;
      ASSERT_TRUE(offloaded.error.empty()) << offloaded.error;
      EXPECT_EQ(losses_of(offloaded), losses_of(resident));
      EXPECT_EQ(offloaded.eval_losses[0], resident.eval_losses[0]);
      EXPECT_EQ(offloaded.strict_blocking_waits, 0u);
      std::size_t shard_bytes = 0;
      for (const auto& u : offloaded.units) shard_bytes += static_cast<std::size_t>(u.shard) * 4;
      EXPECT_GE(resident.device_bytes, offloaded.device_bytes + shard_bytes)
          << resident.device_bytes << " bytes on the device with the shards there, " << offloaded.device_bytes
          << " without; the shards are " << shard_bytes;
      EXPECT_GT(offloaded.stats[0].back().prefetch_hits, 0u);
    }
  }
  std::filesystem::remove_all(folder);
}

TEST(Engine, OffloadRefusesABudgetTooSmallForTheShards) {
  Rank r;
  auto comms = collectives::make_local_communicators(1);
  ASSERT_TRUE(comms);
  auto model = make_gpt(kConfig);
  auto opt = Optimizer::adamw({});
  ASSERT_TRUE(model && opt);
  EngineOptions o;
  o.offload_optimizer = OptimizerOffload::cpu;
  o.host_memory_budget = 4096;
  auto e = Engine::create(*r.ctx, *(*comms)[0], **model, **opt, o);
  ASSERT_FALSE(e);
  EXPECT_NE(e.error().message().find("host_memory_budget=4096"), std::string::npos) << e.error().message();
  EXPECT_NE(e.error().message().find("offload_optimizer=cpu"), std::string::npos) << e.error().message();
}

}  // namespace
}  // namespace coshard::zero
