// The optimizer on NVMe in sub-groups (EngineOptions::sub_group_size): each unit's master and
// state streamed in pieces of at most sub_group_size elements gives the bits of whole units, with
// the parameters on the device, in pinned memory or on NVMe, in f32 and bf16, stepped after
// backward or during it, with a frozen unit; a checkpoint saved in pieces loads into whole units
// and back, continuing the same losses; the pinned swap buffers follow the sub-group, not the
// largest unit (the estimate and the pool alike). With swap_gradients the gradient shards go to the
// swap files as backward reduces them: none in pinned memory, the losses of keeping them there.
#include <gtest/gtest.h>

#include <cmath>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "coshard/zero/engine.hpp"
#include "support/sanitizers.hpp"
#include "coshard/offload/pinned_pool.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "../support/on_ranks.hpp"
#include "../support/rank_engine.hpp"
#include "../support/regression_mlp.hpp"

namespace coshard::zero {
namespace {

using ::coshard::testing::kMlpFeatures;
using ::coshard::testing::kMlpOutputs;
using ::coshard::testing::kMlpRows;
using modules::Init;
namespace fs = std::filesystem;

constexpr int kWorld = 2;
constexpr std::int64_t kWide = 96;  // a hidden layer's shard (4656 elements) spans five 1024-element pieces

// fc1 (frozen), three wide layers and a head: units of one piece and of several.
Result<std::unique_ptr<modules::Sequential>> make_model() {
  auto net = std::make_unique<modules::Sequential>();
  net->add("fc1", std::make_unique<modules::Linear>(kMlpFeatures, kWide, true, Init::normal(0.3)));
  net->add("act1", std::make_unique<modules::Gelu>());
  for (int i = 2; i <= 4; ++i) {
    net->add("fc" + std::to_string(i), std::make_unique<modules::Linear>(kWide, kWide, true, Init::normal(0.1)));
    net->add("act" + std::to_string(i), std::make_unique<modules::Gelu>());
  }
  net->add("head", std::make_unique<modules::Linear>(kWide, kMlpOutputs, true, Init::normal(0.3)));
  return net;
}

struct Case {
  OffloadTarget params = OffloadTarget::none;
  DataType dtype = DataType::f32;
  bool step_in_backward = false;
  bool frozen = false;
  int micro_batches = 1;
  float lr = 3e-2f;
  bool clip = true;  // at norm 0.5 (never with step_in_backward: refused)
  bool swap_gradients = false;
  std::string name() const {
    return "parameters " + std::string(to_string(params)) + ", " + std::string(collectives::to_string(dtype)) +
           (step_in_backward ? ", step in backward" : "") + (frozen ? ", fc3 frozen" : "") +
           (micro_batches > 1 ? ", " + std::to_string(micro_batches) + " micro-batches" : "") +
           (clip ? "" : ", no clipping") + (swap_gradients ? ", gradients swapped" : "");
  }
};

EngineOptions options(const Case& c, std::size_t sub_group_size) {
  EngineOptions o;
  o.zero_stage = 3;
  o.max_live_bytes = 160 << 10;
  o.dtype = c.dtype;
  o.offload_optimizer = OffloadTarget::nvme;
  o.offload_optimizer.buffer_count = 2;
  o.offload_params = c.params;
  o.offload_params.buffer_count = 2;
  o.step_in_backward = c.step_in_backward;
  o.swap_gradients = c.swap_gradients;
  o.sub_group_size = sub_group_size;
  return o;
}

struct Outcome {
  std::vector<double> losses;
  std::map<std::string, std::vector<std::byte>> final;
  std::size_t peak_device_bytes = 0;  // rank 0's compute allocator: peak_in_use_bytes
};

// Steps [first, first + count) under `o`, from the seed or from `load_from`; with `save_to`, a
// checkpoint after the last step.
Result<Outcome> train(const Case& c, EngineOptions o, const std::string& tag, int first = 0, int count = 4,
                      const fs::path& load_from = {}, const fs::path& save_to = {}) {
  // Under the test's own name: ctest runs this file's tests side by side, and a swap folder is
  // locked by the run that writes it.
  const auto swap = fs::current_path() / "sub_groups_scratch" /
                    ::testing::UnitTest::GetInstance()->current_test_info()->name() / tag;
  Outcome out;
  const auto errors = ::coshard::testing::on_ranks(kWorld, [&](int r, collectives::Communicator& comm)
                                                                -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto model, make_model());
    if (c.frozen) {
      COSHARD_CO_TRY_ASSIGN(const std::size_t matched, model->set_trainable_matching("fc3.*", false));
      (void)matched;
    }
    modules::StepControlOptions control;
    control.max_grad_norm = c.clip && !c.step_in_backward ? 0.5f : 0.0f;
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
      COSHARD_CO_TRY(co_await engine->begin_step(c.micro_batches, c.lr));
      const std::int64_t per_micro = rows / c.micro_batches;
      for (int m = 0; m < c.micro_batches; ++m) {
        COSHARD_CO_TRY_ASSIGN(auto mb, ::coshard::testing::regression_rows(ctx, step, r * rows + m * per_micro, per_micro));
        COSHARD_CO_TRY(co_await ::coshard::testing::add_micro_batch(ctx, *engine, *model, loss, std::move(mb), o.dtype));
      }
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
      out.peak_device_bytes = allocator->stats().peak_in_use_bytes;
    }
    engine.reset();
    COSHARD_CO_TRY(stream.synchronize());
    co_return Result<void>{};
  });
  fs::remove_all(swap);
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return out;
}

// The losses of a run and of the run that resumed from its checkpoint, one after the other.
std::vector<double> joined(const Outcome& before, const Outcome& after) {
  std::vector<double> losses = before.losses;
  losses.insert(losses.end(), after.losses.begin(), after.losses.end());
  return losses;
}

TEST(SubGroups, PiecesGiveTheBitsOfWholeUnits) {
  for (const Case& c : {Case{}, Case{OffloadTarget::cpu}, Case{OffloadTarget::nvme}, Case{OffloadTarget::none, DataType::bf16},
                        Case{OffloadTarget::cpu, DataType::bf16}, Case{OffloadTarget::nvme, DataType::bf16},
                        Case{OffloadTarget::none, DataType::f32, true}, Case{OffloadTarget::nvme, DataType::f32, true},
                        Case{OffloadTarget::none, DataType::f32, false, true},
                        Case{OffloadTarget::nvme, DataType::bf16, true, true}}) {
    SCOPED_TRACE(c.name());
    auto whole = train(c, options(c, 0), "whole");
    ASSERT_TRUE(whole) << whole.error().message();
    // 1000 rounds up to 1024 (whole pages of fp32): pieces of 1024 and a shorter last one.
    for (const std::size_t pieces : {std::size_t{1000}, std::size_t{2048}}) {
      if (coshard::testing::kSanitized && pieces == 2048) continue;  // (under a sanitizer: the short last piece)
      auto split = train(c, options(c, pieces), "pieces");
      ASSERT_TRUE(split) << split.error().message();
      EXPECT_EQ(split->losses, whole->losses) << "sub_group_size " << pieces;
      EXPECT_TRUE(split->final == whole->final) << "sub_group_size " << pieces;
    }
  }
}

TEST(SubGroups, ACheckpointInPiecesLoadsIntoWholeUnitsAndBack) {
  const fs::path dir = fs::current_path() / "sub_groups_scratch" / "checkpoints";
  fs::remove_all(dir);
  for (const OffloadTarget params : {OffloadTarget::none, OffloadTarget::nvme}) {
    const Case c{params, DataType::f32, false, true};
    SCOPED_TRACE(c.name());
    auto straight = train(c, options(c, 0), "straight", 0, 6);
    ASSERT_TRUE(straight) << straight.error().message();
    for (const auto& [saved_in, loaded_in] : {std::pair<std::size_t, std::size_t>{1024, 0}, {0, 1024}, {1024, 2048}}) {
      SCOPED_TRACE("saved with sub_group_size " + std::to_string(saved_in) + ", loaded with " + std::to_string(loaded_in));
      fs::remove_all(dir);
      auto before = train(c, options(c, saved_in), "before", 0, 3, {}, dir);
      ASSERT_TRUE(before) << before.error().message();
      auto after = train(c, options(c, loaded_in), "after", 3, 3, dir);
      ASSERT_TRUE(after) << after.error().message();
      EXPECT_EQ(joined(*before, *after), straight->losses);
      EXPECT_TRUE(after->final == straight->final);
    }
  }
  fs::remove_all(dir);
}

// The estimate's pinned line and the pool the engine reserves alike: a pinned budget of the
// pieces' plan holds a run in pieces and refuses one of whole units.
TEST(SubGroups, TheSwapBuffersFollowTheSubGroup) {
  auto model = make_model();
  ASSERT_TRUE(model);
  const Case c;
  auto whole = estimate_engine_memory(**model, kWorld, options(c, 0), 2);
  auto split = estimate_engine_memory(**model, kWorld, options(c, 1024), 2);
  ASSERT_TRUE(whole) << whole.error().message();
  ASSERT_TRUE(split) << split.error().message();
  // The widest unit's shard (4656 elements) against a 1024-element piece: master and two moments
  // from page boundaries, in each of buffer_count (2) buffers.
  const std::size_t page = offload::page_rounded(1);
  auto rounded = [page](std::size_t b) { return (b + page - 1) / page * page; };
  const std::size_t widest = static_cast<std::size_t>((kWide * kWide + kWide) / kWorld);
  const std::size_t saved = 2 * (3 * rounded(widest * 4) - 3 * rounded(1024 * 4));
  EXPECT_EQ(whole->bytes(MemoryPlace::pinned_host) - split->bytes(MemoryPlace::pinned_host), saved)
      << whole->describe() << "\n" << split->describe();
  EXPECT_EQ(whole->bytes(MemoryPlace::nvme), split->bytes(MemoryPlace::nvme));

  EngineOptions budgeted = options(c, 1024);
  budgeted.host_memory_budget = split->bytes(MemoryPlace::pinned_host);
  auto fits = train(c, budgeted, "budget");
  ASSERT_TRUE(fits) << fits.error().message();
  budgeted.sub_group_size = 0;
  auto refused = train(c, budgeted, "budget");
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("gradient shards and swap buffers"), std::string::npos)
      << refused.error().message();
}

// With step_in_backward the gradient shards stay on the device until the swapper's pass copies
// each piece into its buffer: no gradient shard in pinned memory (the estimate and the pool: a
// budget of that plan holds such a run and refuses one without step_in_backward), the bits of
// stepping after backward, also with two micro-batches (stepped after backward, still through the
// pass); a non-finite gradient there fails the step by name, as during backward.
TEST(SubGroups, WithStepInBackwardNoGradientShardIsPinned) {
  auto model = make_model();
  ASSERT_TRUE(model);
  Case after{OffloadTarget::nvme}, during{OffloadTarget::nvme, DataType::f32, true};
  after.clip = false;  // (as with step_in_backward)
  auto pinned_grads = estimate_engine_memory(**model, kWorld, options(after, 1024), 2);
  auto through_pass = estimate_engine_memory(**model, kWorld, options(during, 1024), 2);
  ASSERT_TRUE(pinned_grads && through_pass);
  // Every trained unit's fp32 gradient shard out of the pool; a 1024-element gradient piece in
  // each of the two swap buffers instead.
  std::size_t shards = 0;
  for (std::int64_t numel : {kMlpFeatures * kWide + kWide, kWide * kWide + kWide, kWide * kWide + kWide,
                             kWide * kWide + kWide, kWide * kMlpOutputs + kMlpOutputs})
    shards += offload::page_rounded(static_cast<std::size_t>(numel / kWorld) * sizeof(float));
  EXPECT_EQ(pinned_grads->bytes(MemoryPlace::pinned_host) - through_pass->bytes(MemoryPlace::pinned_host),
            shards - 2 * offload::page_rounded(1024 * sizeof(float)))
      << pinned_grads->describe() << "\n" << through_pass->describe();

  // Without it, the estimate says what it would save; a machine too small names the largest line.
  EXPECT_NE(pinned_grads->describe().find("with swap_gradients (or step_in_backward, gradient clipping off) no gradient "
                                          "shard is kept"),
            std::string::npos) << pinned_grads->describe();
  EXPECT_EQ(through_pass->describe().find("with step_in_backward"), std::string::npos) << through_pass->describe();
  MachineMemory small;
  small.host_bytes = 1;
  small.device = "cpu";
  auto refused_here = check_fits(*pinned_grads, 1, small);
  ASSERT_FALSE(refused_here);
  EXPECT_NE(refused_here.error().message().find("the largest line: "), std::string::npos) << refused_here.error().message();

  EngineOptions budgeted = options(during, 1024);
  budgeted.host_memory_budget = through_pass->bytes(MemoryPlace::pinned_host);
  auto fits = train(during, budgeted, "budget");
  ASSERT_TRUE(fits) << fits.error().message();
  // The shards waiting for the pass stay within the estimate's two largest: backward waits for
  // the pass beyond that (the device's peak within the estimate's device lines).
  EXPECT_LE(fits->peak_device_bytes, through_pass->bytes(MemoryPlace::device)) << through_pass->describe();
  auto stepped_after = train(after, options(after, 1024), "after");
  ASSERT_TRUE(stepped_after) << stepped_after.error().message();
  EXPECT_EQ(fits->losses, stepped_after->losses);
  EXPECT_TRUE(fits->final == stepped_after->final);
  budgeted.step_in_backward = false;
  auto refused = train(after, budgeted, "budget");
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("gradient shards and swap buffers"), std::string::npos)
      << refused.error().message();

  // Two micro-batches: stepped after backward, the gradients still through the pass.
  Case accumulate_after = after, accumulate_during = during;
  accumulate_after.micro_batches = accumulate_during.micro_batches = 2;
  auto two_after = train(accumulate_after, options(accumulate_after, 1024), "two_after");
  auto two_during = train(accumulate_during, options(accumulate_during, 1024), "two_during");
  ASSERT_TRUE(two_after) << two_after.error().message();
  ASSERT_TRUE(two_during) << two_during.error().message();
  EXPECT_EQ(two_during->losses, two_after->losses);
  EXPECT_TRUE(two_during->final == two_after->final);
  EXPECT_NE(two_during->losses, stepped_after->losses) << "two micro-batches are another run";

  accumulate_during.lr = 1e38f;  // the weights overflow, and the next step's gradients
  auto overflowed = train(accumulate_during, options(accumulate_during, 1024), "overflow");
  ASSERT_FALSE(overflowed);
  EXPECT_NE(overflowed.error().message().find("a non-finite gradient with step_in_backward and the optimizer on nvme"),
            std::string::npos)
      << overflowed.error().message();
}

// swap_gradients: each gradient shard goes into its swap file as backward reduces it, and the
// step's pass reads it back beside the master and state. Without clipping the bits of gradients
// kept in pinned memory; with clipping the norm is summed in another order (piece by piece as the
// units come), so within its rounding. Parameters on the device, pinned or on NVMe; f32 and bf16;
// whole units and pieces; a frozen unit; two micro-batches (written out at the step).
TEST(SubGroups, SwappedGradientsGiveTheLossesOfPinnedOnes) {
  std::vector<Case> cases = {Case{}, Case{OffloadTarget::cpu, DataType::bf16}, Case{OffloadTarget::nvme},
                             Case{OffloadTarget::nvme, DataType::bf16}, Case{OffloadTarget::none, DataType::f32, false, true},
                             Case{OffloadTarget::none, DataType::f32, false, false, 2}};
  for (std::size_t k = 0; k < cases.size(); ++k) {
    Case c = cases[k];
    for (const bool clip : {false, true}) {
      if (clip && k != 0 && k != 3) continue;  // (clipping: parameters on the device in f32, on NVMe in bf16)
      c.clip = clip;
      c.swap_gradients = false;
      SCOPED_TRACE(c.name());
      auto pinned = train(c, options(c, 1000), "swapped_pinned");
      ASSERT_TRUE(pinned) << pinned.error().message();
      c.swap_gradients = true;
      for (const std::size_t pieces : {std::size_t{0}, std::size_t{1000}}) {
        // Under a sanitizer whole units and pieces in turn (each path still runs).
        if (coshard::testing::kSanitized && (pieces == 0) != (k % 2 == 0)) continue;
        auto swapped = train(c, options(c, pieces), "swapped_swapped");
        ASSERT_TRUE(swapped) << swapped.error().message();
        if (!clip) {
          EXPECT_EQ(swapped->losses, pinned->losses) << "sub_group_size " << pieces;
          EXPECT_TRUE(swapped->final == pinned->final) << "sub_group_size " << pieces;
          continue;
        }
        ASSERT_EQ(swapped->losses.size(), pinned->losses.size());
        for (std::size_t i = 0; i < pinned->losses.size(); ++i)
          EXPECT_NEAR(swapped->losses[i], pinned->losses[i], 1e-5 * std::abs(pinned->losses[i]))
              << "step " << i << ", sub_group_size " << pieces;
      }
    }
  }
}

// No gradient shard in pinned memory with swap_gradients (the estimate and the pool: a budget of
// that plan holds the run and refuses one without it); the swap files grow by the gradients; the
// shards waiting to be written stay within the estimate's device lines; a checkpoint saved before
// the first step (no gradient written yet) and one saved after, loaded with or without it, resume
// with the same losses; a non-finite gradient is skipped as without it (nothing was stepped before
// the sum); asked for without the optimizer on NVMe, it is refused by name.
TEST(SubGroups, SwappedGradientsLeavePinnedMemory) {
  auto model = make_model();
  ASSERT_TRUE(model);
  Case kept{OffloadTarget::nvme}, swapped{OffloadTarget::nvme};
  swapped.swap_gradients = true;
  auto pinned_grads = estimate_engine_memory(**model, kWorld, options(kept, 1024), 2);
  EngineOptions in_flight = options(swapped, 1024);
  in_flight.expected_micro_batches = 1;
  auto written_out = estimate_engine_memory(**model, kWorld, in_flight, 2);
  ASSERT_TRUE(pinned_grads && written_out);
  std::size_t shards = 0, trained = 0;
  for (std::int64_t numel : {kMlpFeatures * kWide + kWide, kWide * kWide + kWide, kWide * kWide + kWide,
                             kWide * kWide + kWide, kWide * kMlpOutputs + kMlpOutputs}) {
    shards += offload::page_rounded(static_cast<std::size_t>(numel / kWorld) * sizeof(float));
    trained += static_cast<std::size_t>(numel / kWorld) * sizeof(float);
  }
  EXPECT_EQ(pinned_grads->bytes(MemoryPlace::pinned_host) - written_out->bytes(MemoryPlace::pinned_host),
            shards - 2 * offload::page_rounded(1024 * sizeof(float)))
      << pinned_grads->describe() << "\n" << written_out->describe();
  EXPECT_EQ(written_out->bytes(MemoryPlace::nvme) - pinned_grads->bytes(MemoryPlace::nvme), trained)
      << written_out->describe();
  EXPECT_NE(written_out->describe().find("gradient shards (swap files)"), std::string::npos) << written_out->describe();

  EngineOptions budgeted = options(swapped, 1024);
  budgeted.host_memory_budget = written_out->bytes(MemoryPlace::pinned_host);
  auto fits = train(swapped, budgeted, "swapped_budget");
  ASSERT_TRUE(fits) << fits.error().message();
  EXPECT_LE(fits->peak_device_bytes, written_out->bytes(MemoryPlace::device)) << written_out->describe();
  budgeted.swap_gradients = false;
  auto refused = train(kept, budgeted, "swapped_budget");
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("gradient shards and swap buffers"), std::string::npos)
      << refused.error().message();

  // Checkpoints: before any gradient was written, and after; loaded with and without it.
  const fs::path dir = fs::current_path() / "sub_groups_scratch" / "swapped_checkpoints";
  kept.clip = swapped.clip = false;
  auto straight = train(kept, options(kept, 1024), "swapped_straight", 0, 5);
  ASSERT_TRUE(straight) << straight.error().message();
  for (const int saved_at : {0, 2}) {
    for (const bool loaded_swapped : {true, false}) {
      SCOPED_TRACE("saved after step " + std::to_string(saved_at) + (loaded_swapped ? ", loaded swapped" : ", loaded kept"));
      fs::remove_all(dir);
      auto before = train(swapped, options(swapped, 1024), "swapped_before", 0, saved_at, {}, dir);
      ASSERT_TRUE(before) << before.error().message();
      const Case& next = loaded_swapped ? swapped : kept;
      auto after = train(next, options(next, 1024), "swapped_after", saved_at, 5 - saved_at, dir);
      ASSERT_TRUE(after) << after.error().message();
      EXPECT_EQ(joined(*before, *after), straight->losses);
      EXPECT_TRUE(after->final == straight->final);
    }
  }
  fs::remove_all(dir);

  // A step whose gradients overflow is skipped, not failed.
  Case overflowing = swapped;
  overflowing.lr = 1e38f;
  auto skipped = train(overflowing, options(overflowing, 1024), "swapped_overflow");
  ASSERT_TRUE(skipped) << skipped.error().message();

  Case device_params;
  device_params.swap_gradients = true;
  EngineOptions on_host = options(device_params, 1024);
  on_host.offload_optimizer = OffloadTarget::cpu;
  auto not_nvme = estimate_engine_memory(**model, kWorld, on_host, 2);
  ASSERT_TRUE(not_nvme);  // (the estimate takes what it is given; creating the engine refuses it)
  auto refused_cpu = train(device_params, on_host, "swapped_cpu");
  ASSERT_FALSE(refused_cpu);
  EXPECT_NE(refused_cpu.error().message().find("swap_gradients with offload_optimizer=cpu"), std::string::npos)
      << refused_cpu.error().message();
}

}  // namespace
}  // namespace coshard::zero
