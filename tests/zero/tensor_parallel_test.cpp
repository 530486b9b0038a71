// Tensor parallelism beside ZeRO: a Llama split over the tensor ranks of a mesh
// (modules/tensor_parallel.hpp, make_llama with a group) and sharded over its data ranks, against
// the unsharded single-rank run: world 4 as data 2 x tensor 2 and data 1 x tensor 4, world 6 as
// data 3 x tensor 2 (uneven ZeRO shards), stages 0-3, grouped-query attention, tied and untied
// embeddings, clipping (the norm summed over both dimensions, replicated parameters once),
// offload, hybrid sharding, accumulation and activation checkpointing. Losses within 1e-5
// relative, the whole parameters (each rank's parts put back together) within 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coshard/collectives/mesh.hpp"
#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/lora.hpp"
#include "coshard/modules/tensor_parallel.hpp"
#include "coshard/zero/checkpoint.hpp"
#include "coshard/zero/engine.hpp"
#include "../support/on_ranks.hpp"
#include "../support/token_batch.hpp"
#include "../support/value_differences.hpp"

namespace coshard::zero {
namespace {

namespace fs = std::filesystem;
using Values = std::map<std::string, std::vector<double>>;

constexpr std::int64_t kSequences = 12;  // the global batch: divides among 1, 2, 3 and 4 data ranks
constexpr std::int64_t kSeq = 8;
// (At 1e-2, data parallelism alone (world 3, tensor 1) already ends 1.7e-5 from the unsharded
// run on a few elements whose gradients are near zero: AdamW normalizes the last-bit differences
// of another order of additions into lr-sized steps. At 3e-3 every layout stays within 1e-5.)
constexpr float kLr = 3e-3f;

modules::LlamaConfig llama(bool tied) {
  modules::LlamaConfig c;
  c.vocab = 64;
  c.max_seq = kSeq;
  c.dim = 32;
  c.layers = 2;
  c.heads = 8;
  c.kv_heads = 4;  // grouped-query: two query heads a key/value head, on every split here
  c.intermediate = 48;
  c.tie_embeddings = tied;
  c.init_std = 0.1;
  return c;
}

struct Layout {
  int world = 1;
  int tensor = 1;
  int stage = 0;
  int shard = 0;  // hybrid sharding over the data ranks
  bool tied = true;
  int micro_batches = 1;
  bool checkpointed = false;
  OffloadTarget optimizer = OffloadTarget::none;
  OffloadTarget params = OffloadTarget::none;
  FetchMode fetch = FetchMode::all_gather;
  std::string freeze;            // a glob of parameters that do not train
  bool no_decay_for_vectors = false;  // a parameter group
  int steps = 5;
  // Checkpoints: saved after the last step into save_dir (frozen units in, unless save_frozen is
  // false), or loaded from resume_dir before step first_step (the step it was saved after).
  fs::path save_dir, resume_dir;
  bool save_frozen = true;
  int first_step = 0;
  std::string name() const {
    return "data " + std::to_string(world / tensor) + " x tensor " + std::to_string(tensor) + ", stage " +
           std::to_string(stage) + (shard ? ", shards over " + std::to_string(shard) : "") +
           (tied ? ", tied" : ", untied") + ", " + std::to_string(micro_batches) + " micro-batches" +
           (checkpointed ? ", checkpointed" : "") + ", optimizer " + std::string(to_string(optimizer)) +
           ", parameters " + std::string(to_string(params)) +
           (fetch == FetchMode::all_reduce ? ", fetch all_reduce" : "") + (freeze.empty() ? "" : ", frozen " + freeze) +
           (no_decay_for_vectors ? ", no decay for vectors" : "") +
           (resume_dir.empty() ? "" : ", resumed at step " + std::to_string(first_step));
  }
  // What the unsharded reference must share.
  std::string model_key() const { return std::to_string(tied) + "|" + freeze + "|" + std::to_string(no_decay_for_vectors); }
};

struct TrainedRun {
  std::vector<double> losses;
  std::vector<double> norms;  // the gradients' norm before clipping, per step
  Values whole;  // every parameter whole, put together from the tensor ranks' parts
};

// Sequence s of step `step`: tokens and their next tokens, a pattern the model can learn.
std::vector<std::int32_t> sequence(int step, std::int64_t s, std::int64_t vocab) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(kSeq + 1));
  for (std::int64_t i = 0; i <= kSeq; ++i)
    t[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((s * 7 + i * (3 + s % 4) + step * 5) % vocab);
  return t;
}

Result<modules::Batch> batch(Context& ctx, int step, std::int64_t first, std::int64_t rows, std::int64_t vocab) {
  return ::coshard::testing::token_batch(ctx, first, rows, kSeq, [&](std::int64_t s) { return sequence(step, s, vocab); });
}

Result<TrainedRun> train(const Layout& k) {
  const auto swap = fs::current_path() / "tensor_parallel_scratch" /
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  const auto config = llama(k.tied);
  TrainedRun run;
  std::mutex mutex;
  const auto errors = ::coshard::testing::on_ranks(k.world, [&](int r, collectives::Communicator& world)
                                                                -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto mesh, collectives::Mesh::create(world, {.tensor = k.tensor, .shard = k.shard}));
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama(config, mesh.tensor()));
    if (k.checkpointed) modules::apply_activation_checkpointing(*model, {.every = 1});
    if (!k.freeze.empty()) COSHARD_CO_TRY(model->set_trainable_matching(k.freeze, false));
    modules::StepControlOptions control;
    control.max_grad_norm = 0.5f;  // clips: the norm must count every element once, over both dimensions
    COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw({.weight_decay = 0.1f}, control));
    if (k.no_decay_for_vectors) COSHARD_CO_TRY(opt->set_parameter_groups({modules::ParameterGroup::no_decay_for_vectors()}));
    EngineOptions o;
    o.zero_stage = k.stage;
    o.max_live_bytes = 24 << 10;  // stage 3: fewer units at once than the model has
    o.offload_optimizer = k.optimizer;
    o.offload_params = k.params;
    o.fetch_mode = k.fetch;
    o.offload_optimizer.nvme_path = swap / ("rank" + std::to_string(r));
    COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(ctx, mesh, *model, *opt, o));
    COSHARD_CO_TRY(co_await engine->initialize(7));  // (a resume's frozen units left out keep these values)
    const CheckpointOptions checkpoint{.frozen_units = k.save_frozen};
    if (!k.resume_dir.empty()) COSHARD_CO_TRY(co_await engine->load_checkpoint(k.resume_dir, checkpoint));
    std::unique_ptr<modules::Loss> loss;
    if (k.tensor > 1)
      loss = std::make_unique<modules::VocabParallelCrossEntropyLoss>(mesh.tensor(), config.vocab);
    else
      loss = std::make_unique<modules::CrossEntropyLoss>();
    const std::int64_t rows = kSequences / mesh.data_size() / k.micro_batches;
    for (int step = k.first_step; step < k.steps; ++step) {
      COSHARD_CO_TRY(co_await engine->begin_step(k.micro_batches, kLr));
      for (int m = 0; m < k.micro_batches; ++m) {
        COSHARD_CO_TRY_ASSIGN(auto mb, batch(ctx, step, (mesh.data_rank() * k.micro_batches + m) * rows, rows,
                                             config.vocab));
        COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(*model, mb.inputs));
        loss->set_targets(mb.targets);
        COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(*loss, out));
        COSHARD_CO_TRY_ASSIGN(Tensor dout, co_await ctx.backward(*loss, engine->backward_seed()));
        COSHARD_CO_TRY(co_await ctx.backward(*model, dout));
        COSHARD_CO_TRY(engine->add_loss(value));
      }
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      if (r == 0) {
        run.losses.push_back(stats.loss);
        run.norms.push_back(stats.optimizer.grad_norm);
      }
    }
    if (!k.save_dir.empty()) {
      COSHARD_CO_TRY(co_await engine->save_checkpoint(k.save_dir, checkpoint));
      COSHARD_CO_TRY(co_await engine->finish_checkpoint());
    }
    COSHARD_CO_TRY_ASSIGN(auto gathered, co_await engine->gather_parameters());
    if (mesh.data_rank() == 0) {
      std::map<std::string, const modules::Parameter*> params;
      model->for_each_parameter([&](const std::string& name, modules::Parameter& p) { params[name] = &p; });
      std::lock_guard lock(mutex);
      for (const auto& g : gathered) {
        std::vector<double> part(g.bytes.size() / sizeof(float));
        for (std::size_t i = 0; i < part.size(); ++i) {
          float f = 0;
          std::memcpy(&f, g.bytes.data() + 4 * i, 4);
          part[i] = f;
        }
        const modules::Parameter& p = *params.at(g.name);
        auto& whole = run.whole[g.name];
        whole.resize(static_cast<std::size_t>(p.whole_shape().numel()));
        if (p.split()) {
          p.split()->place_part(part, whole);
        } else {
          if (mesh.tensor_rank() == 0) whole = part;
        }
      }
    }
    engine.reset();
    COSHARD_CO_TRY(stream.synchronize());
    co_return Result<void>{};
  });
  fs::remove_all(swap);
  if (!errors.empty()) {  // every rank's (which rank fails first varies)
    std::string all;
    for (const auto& e : errors) all += (all.empty() ? "" : "\n") + e;
    return fail(ErrorCode::internal, all);
  }
  return run;
}

using ::coshard::testing::relative;

// `got` ran steps [first, first + its losses) of `want`'s.
void expect_close(const TrainedRun& got, const TrainedRun& want, const std::string& what, std::size_t first = 0) {
  ASSERT_EQ(got.losses.size() + first, want.losses.size()) << what;
  for (std::size_t i = 0; i < got.losses.size(); ++i)
    EXPECT_LE(relative(got.losses[i], want.losses[first + i]), 1e-5)
        << what << ": step " << first + i << " loss " << got.losses[i] << ", expected " << want.losses[first + i];
  // Every step clips (the reference's norm is over 0.5), so a norm that counted a part twice or
  // missed one would also move the weights; it is compared on its own here.
  for (std::size_t i = 0; i < got.norms.size(); ++i) {
    EXPECT_GT(want.norms[first + i], 0.5) << "the reference must clip at step " << first + i;
    EXPECT_LE(relative(got.norms[i], want.norms[first + i]), 1e-5)
        << what << ": step " << first + i << " gradient norm " << got.norms[i] << ", expected " << want.norms[first + i];
  }
  const auto [most, where] = ::coshard::testing::largest_difference(got.whole, want.whole, what);
  EXPECT_LE(most, 1e-5) << what << ": the whole parameters differ by " << most << " at " << where;
  std::printf("%s: losses and parameters within %.2g\n", what.c_str(), most);
}

class TensorParallel : public ::testing::Test {
 protected:
  // The unsharded single-rank run of the same model (tied or not, frozen parameters, groups).
  static const TrainedRun& reference(const Layout& k) {
    static std::map<std::string, TrainedRun> runs;
    auto it = runs.find(k.model_key());
    if (it == runs.end()) {
      auto run = train({.world = 1, .tensor = 1, .stage = 0, .tied = k.tied, .freeze = k.freeze,
                        .no_decay_for_vectors = k.no_decay_for_vectors});
      EXPECT_TRUE(run) << run.error().message();
      it = runs.emplace(k.model_key(), run ? std::move(*run) : TrainedRun{}).first;
    }
    return it->second;
  }
};

TEST_F(TensorParallel, EveryStageOnEveryMeshTrainsTheUnshardedModel) {
  std::vector<Layout> cases;
  cases.push_back({.world = 3, .tensor = 1, .stage = 3});  // the mesh without tensor parallelism
  for (int stage = 0; stage <= 3; ++stage) {
    cases.push_back({.world = 4, .tensor = 2, .stage = stage});
    cases.push_back({.world = 4, .tensor = 4, .stage = stage, .tied = false});
    cases.push_back({.world = 6, .tensor = 2, .stage = stage, .tied = stage % 2 == 0});
  }
  for (const auto& k : cases) {
    auto got = train(k);
    ASSERT_TRUE(got) << k.name() << ": " << got.error().message();
    expect_close(*got, reference(k), k.name());
  }
}

TEST_F(TensorParallel, ComposesWithOffloadHybridShardingAccumulationCheckpointingFreezingAndGroups) {
  const std::vector<Layout> cases = {
      {.world = 4, .tensor = 2, .stage = 2, .optimizer = OffloadTarget::cpu},
      {.world = 4, .tensor = 2, .stage = 3, .optimizer = OffloadTarget::cpu, .params = OffloadTarget::cpu},
      {.world = 4, .tensor = 2, .stage = 3, .optimizer = OffloadTarget::nvme},
      {.world = 8, .tensor = 2, .stage = 3, .shard = 2},
      {.world = 4, .tensor = 2, .stage = 3, .micro_batches = 2},
      {.world = 4, .tensor = 2, .stage = 3, .checkpointed = true},
      {.world = 4, .tensor = 2, .stage = 3, .fetch = FetchMode::all_reduce},
      {.world = 4, .tensor = 2, .stage = 3, .freeze = "h0.*"},
      {.world = 6, .tensor = 2, .stage = 2, .freeze = "h1.mlp.gate_up.weight", .no_decay_for_vectors = true},
  };
  for (const auto& k : cases) {
    auto got = train(k);
    ASSERT_TRUE(got) << k.name() << ": " << got.error().message();
    expect_close(*got, reference(k), k.name());
  }
}

// A checkpoint saved at one mesh resumes at another tensor size and data size: every split
// parameter (and its master and AdamW moments) put together whole from the saved parts and cut
// anew, the replicated ones as they are; the resumed steps and the final weights those of the
// uninterrupted unsharded run.
TEST_F(TensorParallel, ACheckpointResumesAtAnotherTensorSize) {
  const fs::path dir = fs::current_path() / "tensor_parallel_scratch" / "reshard";
  fs::remove_all(dir);
  struct From {
    Layout saved;
    std::vector<Layout> resumed;
  };
  const std::vector<From> cases = {
      {{.world = 4, .tensor = 2, .stage = 3, .steps = 3, .save_dir = dir / "data2x2"},
       {{.world = 2, .tensor = 2, .stage = 2},  // data 1 x tensor 2
        {.world = 4, .tensor = 1, .stage = 3},  // data 4 x tensor 1
        {.world = 4, .tensor = 4, .stage = 1, .optimizer = OffloadTarget::cpu},
        {.world = 6, .tensor = 2, .stage = 3},  // uneven ZeRO shards
        {.world = 1, .tensor = 1, .stage = 0}}},
      {{.world = 2, .tensor = 1, .stage = 3, .steps = 3, .save_dir = dir / "data2"},
       {{.world = 4, .tensor = 2, .stage = 3}, {.world = 4, .tensor = 4, .stage = 2, .shard = 0}}},
      // Frozen units saved (their parameters alone) and left out (their values from initialize).
      {{.world = 4, .tensor = 2, .stage = 3, .freeze = "h0.*", .steps = 3, .save_dir = dir / "frozen"},
       {{.world = 4, .tensor = 1, .stage = 3, .freeze = "h0.*"}, {.world = 4, .tensor = 4, .stage = 2, .freeze = "h0.*"}}},
      {{.world = 4, .tensor = 2, .stage = 2, .freeze = "h0.*", .steps = 3, .save_dir = dir / "left_out", .save_frozen = false},
       {{.world = 2, .tensor = 1, .stage = 3, .freeze = "h0.*", .save_frozen = false}}},
  };
  for (const auto& c : cases) {
    auto saved = train(c.saved);
    ASSERT_TRUE(saved) << c.saved.name() << ": " << saved.error().message();
    for (Layout k : c.resumed) {
      k.resume_dir = c.saved.save_dir;
      k.first_step = c.saved.steps;
      auto got = train(k);
      ASSERT_TRUE(got) << k.name() << ": " << got.error().message();
      expect_close(*got, reference(k), "saved at " + c.saved.name() + "; " + k.name(), static_cast<std::size_t>(k.first_step));
    }
  }
  // A damaged `latest` in another size's folder is named, not passed over for an older step.
  fs::create_directories(dir / "data2" / "tensor-1-of-2");
  std::ofstream(dir / "data2" / "tensor-1-of-2" / "latest") << "garbage\n";
  auto damaged = train({.world = 4, .tensor = 2, .stage = 3, .resume_dir = dir / "data2", .first_step = 3});
  ASSERT_FALSE(damaged);
  EXPECT_NE(damaged.error().message().find("'garbage' is not a checkpoint folder name"), std::string::npos)
      << damaged.error().message();
  // Another model (untied: an output layer the checkpoint lacks) is refused by name.
  auto untied = train({.world = 4, .tensor = 4, .stage = 3, .tied = false, .resume_dir = dir / "data2x2", .first_step = 3});
  ASSERT_FALSE(untied);
  EXPECT_NE(untied.error().message().find("is not in it (another model?)"), std::string::npos) << untied.error().message();
  // Tensor rank 0's folder copied over tensor rank 1's: the units look the same (names, sizes),
  // the manifest tells them apart.
  fs::copy(dir / "data2x2", dir / "swapped", fs::copy_options::recursive);
  fs::remove_all(dir / "swapped" / "tensor-1-of-2");
  fs::copy(dir / "swapped" / "tensor-0-of-2", dir / "swapped" / "tensor-1-of-2", fs::copy_options::recursive);
  auto swapped = train({.world = 4, .tensor = 2, .stage = 3, .resume_dir = dir / "swapped", .first_step = 3});
  ASSERT_FALSE(swapped);
  EXPECT_NE(swapped.error().message().find("its manifest says tensor rank 0 of 2, this rank is tensor rank 1 of 2"),
            std::string::npos)
      << swapped.error().message();
  // Tensor ranks' folders at different steps (a save cut short between two folders' publishes):
  // tensor rank 1's `latest` names an older step.
  const fs::path one = dir / "data2x2" / "tensor-1-of-2";
  fs::copy(one / "step-00000003", one / "step-00000002");
  {
    std::ifstream in(one / "step-00000002" / "manifest.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto at = text.find("\"step\": 3");
    ASSERT_NE(at, std::string::npos) << text.substr(0, 400);
    text.replace(at, 9, "\"step\": 2");
    std::ofstream(one / "step-00000002" / "manifest.json", std::ios::trunc) << text;
    std::ofstream(one / "latest", std::ios::trunc) << "step-00000002\n";
  }
  auto torn = train({.world = 4, .tensor = 1, .stage = 3, .resume_dir = dir / "data2x2", .first_step = 3});
  ASSERT_FALSE(torn);
  EXPECT_NE(torn.error().message().find("tensor rank 1's folder is at step 2, tensor rank 0's at step 3"), std::string::npos)
      << torn.error().message();
  fs::remove_all(dir);
}

TEST(TensorParallelShapes, WhatCannotSplitIsRefusedByName) {
  EXPECT_TRUE(collectives::validate(collectives::MeshShape{.tensor = 2}, 4));
  auto bad = collectives::validate(collectives::MeshShape{.tensor = 3}, 4);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("tensor-parallel size 3 does not divide the world of 4"), std::string::npos)
      << bad.error().message();
  bad = collectives::validate(collectives::MeshShape{.tensor = 2, .shard = 3}, 8);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("shard group size 3 does not divide the 4 data-parallel ranks"), std::string::npos)
      << bad.error().message();
  auto c = llama(true);
  EXPECT_TRUE(modules::check_tensor_parallel(c, 4));
  bad = modules::check_tensor_parallel(c, 8);  // 4 key/value heads
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("does not divide the key/value heads (4)"), std::string::npos) << bad.error().message();
  c.intermediate = 50;
  bad = modules::check_tensor_parallel(c, 4);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("the MLP width (50)"), std::string::npos) << bad.error().message();
  c = llama(true);
  c.vocab = 66;
  bad = modules::check_tensor_parallel(c, 4);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("the vocabulary (66)"), std::string::npos) << bad.error().message();
}

// #60 item 8: a split model given to an engine that has no tensor group trained wrong in silence
// (each tensor rank clipped with its own norm, the replicated weights drifted apart): refused by
// name, on every rank, before anything is made; so is LoRA on a split model without its group.
TEST(TensorParallelShapes, ASplitModelWithoutItsTensorGroupIsRefused) {
  std::mutex mutex;
  std::vector<std::string> messages;
  const auto errors = ::coshard::testing::on_ranks(4, [&](int, collectives::Communicator& world) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto mesh, collectives::Mesh::create(world, {.tensor = 2}));
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama(llama(true), mesh.tensor()));
    COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw({}));
    EngineOptions o;
    o.zero_stage = 3;
    auto plain = Engine::create(ctx, mesh.data(), *model, *opt, o);  // (the data group alone)
    auto other = o;
    other.tensor_parallel = &world;  // (a group of another size than the split's)
    auto wrong_size = Engine::create(ctx, mesh.data(), *model, *opt, other);
    auto no_group = modules::apply_lora(*model, {.targets = {"q_proj"}, .rank = 2});
    std::lock_guard lock(mutex);
    for (auto* r : {&plain, &wrong_size}) messages.push_back(*r ? std::string("accepted") : r->error().message());
    messages.push_back(no_group ? std::string("accepted") : no_group.error().message());
    co_return Result<void>{};
  });
  ASSERT_TRUE(errors.empty()) << errors.front();
  ASSERT_EQ(messages.size(), 12u);
  for (std::size_t i = 0; i < messages.size(); i += 3) {
    EXPECT_NE(messages[i].find("of a tensor-parallel split, and the engine has no tensor group"), std::string::npos) << messages[i];
    EXPECT_NE(messages[i + 1].find("is split in 2 parts, and the engine's tensor group has 4 ranks"), std::string::npos)
        << messages[i + 1];
    EXPECT_NE(messages[i + 2].find("give LoraOptions::tensor_group"), std::string::npos) << messages[i + 2];
  }
}

TEST(TensorParallelShapes, APartIsTakenAndPlacedBackSegmentBySegment) {
  // A fused [q | k | v] projection of 2 + 1 + 1 rows of 3 columns, over 2 ranks: rank 1 keeps
  // q's second row, k's second half and v's second half.
  modules::TensorSplit split{.dim = 0, .segments = {4, 2, 2}, .parts = 2, .index = 1, .whole = Shape{8, 3}};
  auto shape = split.part_shape();
  ASSERT_TRUE(shape);
  EXPECT_EQ(shape->to_string(), Shape({4, 3}).to_string());
  std::vector<double> whole(24), part(12), back(24, -1);
  for (std::size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<double>(i);
  split.take_part(whole, part);
  const std::vector<double> want = {6, 7, 8, 9, 10, 11, 15, 16, 17, 21, 22, 23};
  EXPECT_EQ(part, want);
  split.place_part(part, back);
  for (std::size_t i = 0; i < 24; ++i) EXPECT_EQ(back[i], (i >= 6 && i < 12) || (i >= 15 && i < 18) || i >= 21 ? whole[i] : -1);
  // Columns: a [2, 4] row-parallel weight over 2 ranks, rank 0 keeps columns 0 and 1.
  modules::TensorSplit columns{.dim = 1, .segments = {4}, .parts = 2, .index = 0, .whole = Shape{2, 4}};
  std::vector<double> w = {0, 1, 2, 3, 4, 5, 6, 7}, p(4);
  columns.take_part(w, p);
  EXPECT_EQ(p, (std::vector<double>{0, 1, 4, 5}));
  modules::TensorSplit odd{.dim = 0, .segments = {3}, .parts = 2, .index = 0, .whole = Shape{3, 2}};
  auto refused = odd.part_shape();
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("a segment of 3 does not divide into 2 parts"), std::string::npos);
}

}  // namespace
}  // namespace coshard::zero

namespace coshard::zero {
namespace {

// A manifest of one tensor rank's folder: one fused [8 | 2 | 2] x 8 projection split over 2 ranks
// (this folder's part [6, 8]) and a replicated norm, with what is edited into it in each case.
std::string tensor_manifest(const std::string& unit_fields, const std::string& tensor = R"({"size": 2, "rank": 1})") {
  return R"({"format": "coshard-checkpoint", "version": 1, "step": 3, "world_size": 1, "zero_stage": 3,
             "dtype": "f32", "optimizer": "adamw",
             "optimizer_state": "0000000000000000000000000000000000000000000000000000000000000000",
             "tensor_parallel": )" + tensor + R"(,
             "units": [{"name": "qkv", "parameters": ["qkv.weight", "norm.weight"], "numel": 56, "shard": 56, )" +
         unit_fields + R"(}],
             "files": [{"rank": 0, "name": "rank-00000.safetensors", "bytes": 1, "crc32": 0}]})";
}

TEST(TensorParallelShapes, AManifestsShapesAndSplitsAreReadAndCheckedByName) {
  const std::string shapes = R"("shapes": [[6, 8], [8]])";
  const std::string split = R"({"dim": 0, "segments": [8, 2, 2], "whole": [12, 8]})";
  auto m = parse_checkpoint_manifest(tensor_manifest(shapes + R"(, "splits": [)" + split + ", null]"), "test");
  ASSERT_TRUE(m) << m.error().message();
  EXPECT_EQ(m->tensor_size, 2);
  EXPECT_EQ(m->tensor_rank, 1);
  const auto& u = m->units.front();
  ASSERT_EQ(u.shapes.size(), 2u);
  EXPECT_EQ(u.shapes[0], (std::vector<std::int64_t>{6, 8}));
  ASSERT_EQ(u.splits.size(), 2u);
  ASSERT_TRUE(u.splits[0]);
  EXPECT_EQ(u.splits[0]->segments, (std::vector<std::int64_t>{8, 2, 2}));
  EXPECT_FALSE(u.splits[1]);
  // An older manifest (no shapes, no splits, no tensor size) still reads.
  auto older = parse_checkpoint_manifest(tensor_manifest(R"("frozen": false)", R"({"size": 1, "rank": 0})"), "test");
  ASSERT_TRUE(older) << older.error().message();
  EXPECT_TRUE(older->units.front().shapes.empty());

  const std::vector<std::pair<std::string, std::string>> refused = {
      {tensor_manifest(R"("shapes": [[6, 8], [4]])"), "its parameters' shapes hold 52 elements, its 'numel' says 56"},
      {tensor_manifest(R"("shapes": [[6, 8]])"), "'shapes' is not an array of 2 shapes (one per parameter)"},
      {tensor_manifest(R"("shapes": [[1, 1, 1, 1, 48], [8]])"), "expected at most 4 sizes"},
      {tensor_manifest(R"("shapes": [[-6, 8], [8]])"), "expected sizes 0..2^50"},
      {tensor_manifest(R"("shapes": [[1125899906842624, 1125899906842624], [8]])"), "more than 2^50 elements"},
      {tensor_manifest(R"("splits": [null, null])"), "'splits' without 'shapes'"},
      {tensor_manifest(shapes + R"(, "splits": [{"dim": 0, "segments": [8, 2], "whole": [12, 8]}, null])"),
       "its segments add up to 10, its whole dimension 0 is 12"},
      {tensor_manifest(shapes + R"(, "splits": [{"dim": 0, "segments": [9, 3], "whole": [12, 8]}, null])"),
       "a segment of 9, expected a multiple of the tensor size 2"},
      {tensor_manifest(shapes + R"(, "splits": [{"dim": 1, "segments": [8], "whole": [12, 8]}, null])"),
       "one part of 2 is not the shape saved"},
      {tensor_manifest(shapes + R"(, "splits": [{"dim": 2, "segments": [8], "whole": [12, 8]}, null])"),
       "'dim' is 2, expected a dimension of [12,8]"},
      {tensor_manifest(shapes + R"(, "splits": [7, null])"), "expected {\"dim\", \"segments\", \"whole\"} or null"},
      {tensor_manifest(shapes + R"(, "splits": [)" + split + ", null]", R"({"size": 1, "rank": 0})"),
       "saved without tensor parallelism"},
      {tensor_manifest(shapes, R"({"size": 2, "rank": 2})"), "'tensor_parallel': rank 2 of size 2"},
  };
  for (const auto& [text, expected] : refused) {
    auto got = parse_checkpoint_manifest(text, "test");
    ASSERT_FALSE(got) << expected;
    EXPECT_NE(got.error().message().find(expected), std::string::npos) << got.error().message();
  }
}

}  // namespace
}  // namespace coshard::zero
