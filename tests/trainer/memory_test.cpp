// The memory estimate against what a Trainer really allocates: on the CPU its device memory is
// its allocator's, so the peak of that allocator over real steps must lie under the estimate and
// not far from it, for every stage, dtype and offload; a plan the machine cannot hold is refused
// by Engine::create and by the estimate with the numbers, before anything is allocated.
#include <gtest/gtest.h>

#include <mutex>
#include <thread>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "coshard/trainer/memory.hpp"
#include "coshard/trainer/trainer.hpp"
#include "../../trainer/app/memory_check.hpp"  // coshard-train's attention choice

namespace coshard::trainer {
namespace {

using zero::MemoryPlace;

constexpr modules::GptConfig kModel{.vocab = 96, .max_seq = 32, .dim = 64, .layers = 3, .heads = 4, .mlp_ratio = 4};
constexpr std::int64_t kBatch = 8;
constexpr std::int64_t kSeq = 32;
constexpr int kWorld = 2;

struct Case {
  const char* name;
  int stage;
  modules::DataType dtype;
  OffloadDevice offload;
  int accumulation;
};

// The device allocator's peak of each rank over three steps.
Result<std::vector<std::size_t>> peaks_of(const TrainerConfig& c) {
  auto comms = collectives::make_local_communicators(kWorld);
  if (!comms) return fail(std::move(comms).error());
  std::mutex mutex;
  std::vector<std::string> errors;
  std::vector<std::size_t> peaks(kWorld, 0);
  const SyntheticTask task(kModel.vocab, 3);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] {
      async::Runtime rt;
      auto done = rt.block_on([&]() -> async::Task<Result<void>> {
        COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(kModel));
        TrainerBuilder builder(c);
        builder.communicator(*(*comms)[static_cast<std::size_t>(r)]);
        COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
        for (std::uint64_t step = 0; step < 3; ++step)
          COSHARD_CO_TRY(co_await t.step(task.batch(step, kBatch, kSeq).rank_rows(r, kWorld)));
        // What the plan asked for: the estimate's promise. (The blocks' bytes on top depend on
        // which cached blocks the device had passed when asked: timing, not the plan.)
        peaks[static_cast<std::size_t>(r)] = t.context().allocator().stats().peak_requested_bytes;
        co_return Result<void>{};
      }());
      if (!done) {
        std::lock_guard lock(mutex);
        errors.push_back(done.error().message());
      }
    });
  for (auto& t : threads) t.join();
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return peaks;
}

class EstimateBoundsTheTrainer : public ::testing::TestWithParam<Case> {};

TEST_P(EstimateBoundsTheTrainer, DevicePeakUnderTheEstimateAndNear) {
  const Case k = GetParam();
  TrainerConfig c;
  c.zero_stage = k.stage;
  c.set_compute_dtype(k.dtype);
  c.max_live_bytes = 96 << 10;  // stage 3: a few units at once (the largest is 64 KiB)
  c.prefetch_bucket_bytes = 32 << 10;
  c.gradient_accumulation_steps = k.accumulation;
  c.offload_optimizer.device = k.offload;
  c.lr = 1e-3f;
  auto model = modules::make_gpt(kModel);
  ASSERT_TRUE(model);
  const std::int64_t rows = kBatch / kWorld;
  MemoryInputs in{.rows_per_rank = rows,
                  .seq = kSeq,
                  .activation_bytes = modules::gpt_activation_bytes(kModel, rows / k.accumulation, kSeq, k.dtype)};
  auto estimate = estimate_memory(c, **model, kWorld, in);
  ASSERT_TRUE(estimate) << estimate.error().message();
  const std::size_t expected = estimate->bytes(MemoryPlace::device);
  auto peaks = peaks_of(c);
  ASSERT_TRUE(peaks) << peaks.error().message();
  for (const std::size_t peak : *peaks) {
    RecordProperty("estimate_over_peak", std::to_string(static_cast<double>(expected) / static_cast<double>(peak)));
    EXPECT_LE(peak, expected) << estimate->describe();
    EXPECT_LE(static_cast<double>(expected), 1.2 * static_cast<double>(peak)) << estimate->describe();
  }
}

using modules::DataType;
constexpr std::size_t kGiB = std::size_t{1} << 30;

TEST(MemoryEstimate, ChecksEveryPlaceForEveryRankOfTheProcess) {
  zero::MemoryEstimate e;
  e.add(MemoryPlace::device, "parameters", 6 * kGiB);
  e.add(MemoryPlace::pinned_host, "buffers", 1 * kGiB);
  e.add(MemoryPlace::pageable_host, "state", 1 * kGiB);
  e.add(MemoryPlace::nvme, "swap", 3 * kGiB);
  e.add(MemoryPlace::nvme, "nothing", 0);  // not an item
  EXPECT_EQ(e.items.size(), 4u);
  EXPECT_EQ(e.bytes(MemoryPlace::nvme), 3 * kGiB);
  EXPECT_NE(e.describe().find("pinned host    1.00 GiB"), std::string::npos) << e.describe();

  // The CPU as device: its memory is the host's, so everything counts against the host.
  zero::MachineMemory cpu{.host_bytes = 10 * kGiB, .device = "cpu"};
  EXPECT_TRUE(zero::check_fits(e, 1, cpu));
  auto two = zero::check_fits(e, 2, cpu);
  ASSERT_FALSE(two);
  EXPECT_EQ(two.error().code(), ErrorCode::out_of_memory);
  EXPECT_NE(two.error().message().find("2 ranks of this process need 16.0 GiB (17179869184 bytes) of host memory"),
            std::string::npos)
      << two.error().message();
  EXPECT_NE(two.error().message().find("may take 10.0 GiB (10737418240 bytes)"), std::string::npos);

  // A device of its own: the device and the host each against theirs.
  zero::MachineMemory gpu{.host_bytes = 3 * kGiB, .device_bytes = 5 * kGiB, .device = "cuda:0"};
  auto device = zero::check_fits(e, 1, gpu);
  ASSERT_FALSE(device);
  EXPECT_NE(device.error().message().find("one rank need 6.00 GiB (6442450944 bytes) on cuda:0, which has 5.00 GiB"),
            std::string::npos)
      << device.error().message();
  gpu.device_bytes = 7 * kGiB;
  EXPECT_TRUE(zero::check_fits(e, 1, gpu));
  gpu.host_bytes = kGiB;
  EXPECT_FALSE(zero::check_fits(e, 1, gpu));

  // The swap files against the free space of their folder.
  zero::MachineMemory disk{.host_bytes = 100 * kGiB, .device = "cpu", .nvme_free_bytes = 2 * kGiB,
                              .nvme_path = "/fast/swap"};
  auto nvme = zero::check_fits(e, 1, disk);
  ASSERT_FALSE(nvme);
  EXPECT_NE(nvme.error().message().find("3.00 GiB (3221225472 bytes) of swap files under /fast/swap, which has 2.00 GiB"),
            std::string::npos)
      << nvme.error().message();
}

TEST(MemoryEstimate, ReadsTheFreeSpaceOfAFolderNotMadeYet) {
  const auto folder = std::filesystem::current_path() / "memory_test_scratch" / "not" / "made" / "yet";
  std::filesystem::remove_all(std::filesystem::current_path() / "memory_test_scratch");
  auto m = zero::machine_memory(async::Device::cpu(), folder);
  ASSERT_TRUE(m) << m.error().message();
  ASSERT_TRUE(m->nvme_free_bytes);
  // The free space of the nearest existing parent (other writers may move it a little meanwhile).
  const auto here = static_cast<double>(std::filesystem::space(std::filesystem::current_path()).available);
  EXPECT_NEAR(static_cast<double>(*m->nvme_free_bytes), here, 1e9);
  EXPECT_FALSE(std::filesystem::exists(folder)) << "reading it creates nothing";
  EXPECT_GT(m->host_bytes, 0u);
  EXPECT_FALSE(m->device_bytes) << "the CPU has no memory apart from the host's";
}

TEST(MemoryEstimate, UnitsAreTheEnginesOwn) {
  auto model = modules::make_gpt(kModel);
  ASSERT_TRUE(model);
  zero::EngineOptions o;
  o.module_granularity_bytes = 20000;  // small leaves merge
  auto planned = zero::plan_units(**model, 3, o);
  ASSERT_TRUE(planned) << planned.error().message();
  std::vector<zero::FetchUnitInfo> built;
  auto comms = collectives::make_local_communicators(3);
  ASSERT_TRUE(comms);
  std::vector<std::thread> threads;
  std::mutex mutex;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      async::Runtime rt;
      auto done = rt.block_on([&]() -> async::Task<Result<void>> {
        auto own = modules::make_gpt(kModel);
        if (!own) co_return fail(std::move(own).error());
        TrainerConfig c;
        c.module_granularity_bytes = o.module_granularity_bytes;
        TrainerBuilder builder(c);
        builder.communicator(*(*comms)[static_cast<std::size_t>(r)]);
        COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(**own));
        std::lock_guard lock(mutex);
        if (r == 0) built = t.engine().units();
        co_return Result<void>{};
      }());
      EXPECT_TRUE(done) << done.error().message();
    });
  for (auto& t : threads) t.join();
  ASSERT_EQ(planned->size(), built.size());
  EXPECT_LT(built.size(), 6u * static_cast<std::size_t>(kModel.layers) + 3) << "the small leaves were merged";
  for (std::size_t i = 0; i < built.size(); ++i) {
    EXPECT_EQ((*planned)[i].name, built[i].name);
    EXPECT_EQ((*planned)[i].parameters, built[i].parameters);
    EXPECT_EQ((*planned)[i].padded, built[i].padded);
    EXPECT_EQ((*planned)[i].shard, built[i].shard);
  }
}

// The engine refuses what no machine here holds (tens of terabytes), before allocating.
TEST(MemoryEstimate, TheEngineRefusesAPlanTheMachineCannotHold) {
  const modules::GptConfig huge{.vocab = 256, .max_seq = 64, .dim = 16384, .layers = 256, .heads = 64};
  auto comms = collectives::make_local_communicators(1);
  ASSERT_TRUE(comms);
  async::Runtime rt;
  auto built = rt.block_on([&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(huge));
    TrainerBuilder builder;
    builder.communicator(*comms->front()).max_live_bytes(std::size_t{64} << 30);
    COSHARD_CO_TRY(co_await builder.build(*model));
    co_return Result<void>{};
  }());
  ASSERT_FALSE(built);
  EXPECT_EQ(built.error().code(), ErrorCode::out_of_memory);
  EXPECT_NE(built.error().message().find("memory estimate: one rank need"), std::string::npos) << built.error().message();
  EXPECT_NE(built.error().message().find("of host memory (the device is the CPU: its memory counted too)"),
            std::string::npos);
}

// A tensor the user keeps (a forward's output, and the activations it left saved in the modules)
// after the Trainer, its stream and its allocator are gone stays valid, and is freed when dropped.
TEST(TensorLifetime, ATensorKeptAfterTheTrainerIsGoneStaysValid) {
  auto comms = collectives::make_local_communicators(1);
  ASSERT_TRUE(comms);
  auto model = modules::make_gpt(kModel);
  ASSERT_TRUE(model);
  modules::Tensor kept;
  std::vector<double> read_then;
  {
    async::Runtime rt;
    auto done = rt.block_on([&]() -> async::Task<Result<void>> {
      TrainerBuilder builder;
      builder.communicator(*comms->front()).zero_stage(1);
      COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(**model));
      const SyntheticTask task(kModel.vocab, 3);
      const HostBatch batch = task.batch(0, 2, kSeq);
      COSHARD_CO_TRY(co_await t.step(batch));
      // The user's own forward pass (an inference pass): its output is kept.
      COSHARD_CO_TRY_ASSIGN(auto tokens, t.context().upload(std::as_bytes(std::span<const std::int32_t>(batch.tokens)),
                                                            modules::Shape{2, kSeq}, DataType::i32));
      COSHARD_CO_TRY(t.engine().begin_inference());
      COSHARD_CO_TRY_ASSIGN(kept, co_await t.context().forward(**model, tokens));
      COSHARD_CO_TRY_ASSIGN(read_then, co_await t.context().read(kept));
      COSHARD_CO_TRY(co_await t.engine().end_inference());
      co_return Result<void>{};
    }());
    ASSERT_TRUE(done) << done.error().message();
  }  // the trainer, its stream, allocator and engine are gone
  ASSERT_EQ(kept.dtype(), DataType::f32);
  ASSERT_EQ(static_cast<std::size_t>(kept.numel()), read_then.size());
  const auto* now = static_cast<const float*>(kept.data());  // CPU memory: readable from the host
  for (std::size_t i = 0; i < read_then.size(); ++i) ASSERT_EQ(static_cast<double>(now[i]), read_then[i]) << i;
  kept = {};
  model->reset();  // the model goes last, after the allocator its values lived in: no crash (ASan checks)
}

INSTANTIATE_TEST_SUITE_P(
    Plans, EstimateBoundsTheTrainer,
    ::testing::Values(Case{"stage0_f32", 0, DataType::f32, OffloadDevice::none, 1},
                      Case{"stage0_bf16_accumulating", 0, DataType::bf16, OffloadDevice::none, 2},
                      Case{"stage1_f32", 1, DataType::f32, OffloadDevice::none, 1},
                      Case{"stage1_bf16", 1, DataType::bf16, OffloadDevice::none, 1},
                      Case{"stage2_f32", 2, DataType::f32, OffloadDevice::none, 1},
                      Case{"stage2_bf16_accumulating", 2, DataType::bf16, OffloadDevice::none, 2},
                      Case{"stage3_f32", 3, DataType::f32, OffloadDevice::none, 1},
                      Case{"stage3_bf16", 3, DataType::bf16, OffloadDevice::none, 1},
                      Case{"stage3_f32_offload_cpu", 3, DataType::f32, OffloadDevice::cpu, 1},
                      Case{"stage3_bf16_offload_cpu", 3, DataType::bf16, OffloadDevice::cpu, 2}),
    [](const auto& info) { return std::string(info.param.name); });

// coshard-train keeps materialized attention only where the run leaves a tenth of the device's free
// memory unclaimed (every rank of the process counted), and never where that memory is unknown.
TEST(AttentionChoice, MaterializedOnlyWithATenthOfTheDeviceToSpare) {
  constexpr std::size_t kGiB = std::size_t{1} << 30;
  train_app::RunMemory m;
  m.per_rank.add(MemoryPlace::device, "activations", 45 * kGiB);
  EXPECT_FALSE(train_app::fits_with_headroom(m, 1)) << "no machine read";
  m.machine = zero::MachineMemory{};
  m.machine->host_bytes = 1000 * kGiB;
  EXPECT_FALSE(train_app::fits_with_headroom(m, 1)) << "the CPU: no device memory of its own";
  m.machine->device_bytes = 100 * kGiB;
  EXPECT_TRUE(train_app::fits_with_headroom(m, 1));
  EXPECT_TRUE(train_app::fits_with_headroom(m, 2)) << "90 GiB of 100";
  EXPECT_FALSE(train_app::fits_with_headroom(m, 3)) << "135 GiB of 100";
  m.per_rank.add(MemoryPlace::device, "one more byte", 1);
  EXPECT_FALSE(train_app::fits_with_headroom(m, 2)) << "one byte past 90%";
}

}  // namespace
}  // namespace coshard::trainer
