// TrainerConfig: validation, sizes with units, and the DeepSpeed JSON mapping.
#include <gtest/gtest.h>

#include "coshard/trainer/config.hpp"
#include "coshard/trainer/trainer.hpp"
#include "../support/regression_mlp.hpp"

namespace coshard::trainer {
namespace {

using modules::DataType;

TEST(ParseSize, UnitsAndErrors) {
  EXPECT_EQ(*parse_size("4096"), 4096u);
  EXPECT_EQ(*parse_size("64MiB"), 64ull << 20);
  EXPECT_EQ(*parse_size("64mib"), 64ull << 20);
  EXPECT_EQ(*parse_size("1.5GB"), 1'500'000'000u);
  EXPECT_EQ(*parse_size("2K"), 2048u);
  EXPECT_EQ(*parse_size("1e8"), 100'000'000u);
  EXPECT_EQ(*parse_size("3 GiB"), 3ull << 30);
  for (const char* bad : {"", "MiB", "-1", "12x", "1.5", "0x10", "1e30"}) {
    auto r = parse_size(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.error().message().find(std::string("'") + bad + "'"), std::string::npos) << r.error().message();
  }
}

TEST(ParseOffload, Forms) {
  EXPECT_EQ(parse_offload("none")->device, OffloadDevice::none);
  EXPECT_EQ(parse_offload("cpu")->device, OffloadDevice::cpu);
  auto n = parse_offload("nvme:/mnt/fast");
  ASSERT_TRUE(n);
  EXPECT_EQ(n->device, OffloadDevice::nvme);
  EXPECT_EQ(n->nvme_path, "/mnt/fast");
  EXPECT_FALSE(parse_offload("gpu"));
}

TEST(TrainerConfig, DefaultsAreValid) { EXPECT_TRUE(TrainerConfig{}.validate()); }

TEST(TrainerConfig, EachBadValueIsNamed) {
  struct Case {
    void (*edit)(TrainerConfig&);
    const char* expect;
  };
  const Case cases[] = {
      {[](TrainerConfig& c) { c.zero_stage = 4; }, "zero_stage=4"},
      {[](TrainerConfig& c) { c.zero_stage = -1; }, "zero_stage=-1: expected 0, 1, 2 or 3"},
      {[](TrainerConfig& c) { c.max_live_bytes = 0; }, "max_live_bytes=0"},
      {[](TrainerConfig& c) { c.gradient_accumulation_steps = 0; }, "gradient_accumulation_steps=0"},
      {[](TrainerConfig& c) { c.max_grad_norm = -1; }, "max_grad_norm=-1"},
      {[](TrainerConfig& c) { c.lr = 0; }, "lr=0"},
      {[](TrainerConfig& c) { c.beta2 = 1; }, "beta2=1"},
      {[](TrainerConfig& c) { c.warmup_steps = -3; }, "warmup_steps=-3"},
      {[](TrainerConfig& c) { c.dtype = DataType::i32; }, "dtype=i32"},
      {[](TrainerConfig& c) { c.reduce_dtype = DataType::bf16; }, "reduce_dtype=bf16"},
      {[](TrainerConfig& c) { c.offload_optimizer.device = OffloadDevice::nvme; }, "offload_optimizer=nvme: needs a path"},
      {[](TrainerConfig& c) { c.offload_params.device = OffloadDevice::cpu; },
       "offload_params=cpu with offload_optimizer=none"},
      {[](TrainerConfig& c) {
         c.zero_stage = 2;
         c.offload_optimizer.device = OffloadDevice::cpu;
         c.offload_params.device = OffloadDevice::cpu;
       },
       "offload_params=cpu with zero_stage=2"},
      {[](TrainerConfig& c) {
         c.offload_optimizer.device = OffloadDevice::cpu;
         c.offload_params.device = OffloadDevice::nvme;
       },
       "offload_params=nvme with offload_optimizer=cpu"},
      {[](TrainerConfig& c) {
         c.offload_optimizer = {.device = OffloadDevice::nvme, .nvme_path = "/a"};
         c.offload_params = {.device = OffloadDevice::nvme, .nvme_path = "/b"};
       },
       "offload_params.nvme_path=/b"},
  };
  for (const auto& k : cases) {
    TrainerConfig c;
    k.edit(c);
    auto r = c.validate();
    ASSERT_FALSE(r) << k.expect;
    EXPECT_NE(r.error().message().find(k.expect), std::string::npos) << r.error().message();
  }
}

TEST(TrainerConfig, WarmupIsLinear) {
  TrainerConfig c;
  c.lr = 1.0f;
  c.warmup_steps = 4;
  EXPECT_FLOAT_EQ(c.lr_at(0), 0.25f);
  EXPECT_FLOAT_EQ(c.lr_at(3), 1.0f);
  EXPECT_FLOAT_EQ(c.lr_at(100), 1.0f);
}

TEST(DeepSpeedJson, WholeConfigMapsEveryZeroKey) {
  const char* text = R"({
    "train_batch_size": 32,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}},
    "zero_optimization": {
      "stage": 3,
      "stage3_prefetch_bucket_size": 5e7,
      "stage3_max_live_parameters": 1e9,
      "stage3_max_reuse_distance": "1e9",
      "stage3_param_persistence_threshold": 100000,
      "stage3_use_all_reduce_for_fetch_params": true,
      "zero_module_granularity_threshold": 1000,
      "reduce_bucket_size": 5e8,
      "overlap_comm": true,
      "contiguous_gradients": true,
      "offload_optimizer": {"device": "none", "pin_memory": true, "buffer_count": 8},
      "offload_param": {"device": "none"}
    }
  })";
  std::vector<std::string> notes;
  auto c = TrainerConfig::from_json(text, TrainerConfig{}, &notes);
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->zero_stage, 3);
  EXPECT_EQ(c->prefetch_bucket_bytes, 50'000'000u * 4);  // elements of f32
  EXPECT_EQ(c->max_live_bytes, 1'000'000'000ull * 4);
  EXPECT_FALSE(c->max_live_follows_model) << "a budget the config names is exact";
  EXPECT_EQ(c->max_reuse_distance_elements, 1'000'000'000u);
  EXPECT_EQ(c->persistence_threshold_bytes, 400'000u);
  EXPECT_EQ(c->module_granularity_bytes, 4000u);
  EXPECT_EQ(c->fetch_mode, zero::FetchMode::all_reduce);
  EXPECT_EQ(c->gradient_accumulation_steps, 2);
  EXPECT_FLOAT_EQ(c->max_grad_norm, 0.5f);
  EXPECT_EQ(c->optimizer, OptimizerKind::adamw);
  EXPECT_FLOAT_EQ(c->lr, 1e-4f);
  EXPECT_FLOAT_EQ(c->beta1, 0.8f);
  EXPECT_FLOAT_EQ(c->beta2, 0.9f);
  EXPECT_FLOAT_EQ(c->weight_decay.value_or(-1), 0.1f);
  EXPECT_EQ(c->offload_optimizer.buffer_count, 8);
  // Accepted without effect, and said so.
  auto noted = [&](std::string_view key) {
    return std::any_of(notes.begin(), notes.end(), [&](const std::string& n) { return n.starts_with(key); });
  };
  EXPECT_TRUE(noted("zero_optimization.reduce_bucket_size"));
  EXPECT_TRUE(noted("zero_optimization.offload_optimizer.pin_memory=true: no effect"));
  EXPECT_EQ(c->train_batch_size, 32);  // taken now: checked against the world by check_batch
}

TEST(DeepSpeedJson, AutoPrefetchIsAdaptive) {
  auto c = TrainerConfig::from_json(R"({"stage": 3, "stage3_prefetch_bucket_size": "auto"})", TrainerConfig{});
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_TRUE(c->adaptive_prefetch);
  EXPECT_EQ(c->prefetch_bucket_bytes, 0u);
  EXPECT_TRUE(c->engine_options().adaptive_prefetch);
}

// One set of optimizer defaults: the config's are the optimizers' own, and so are the builder's.
TEST(TrainerConfigDefaults, AreTheOptimizersOwn) {
  const TrainerConfig c;
  const modules::AdamWOptions adam;
  const modules::SgdOptions sgd;
  EXPECT_EQ(c.beta1, adam.beta1);
  EXPECT_EQ(c.beta2, adam.beta2);
  EXPECT_EQ(c.eps, adam.eps);
  EXPECT_FALSE(c.weight_decay.has_value());  // each optimizer's own
  EXPECT_EQ(c.momentum, sgd.momentum);
  EXPECT_EQ(c.nesterov, sgd.nesterov);
  const auto built = TrainerBuilder{}.adamw(1e-3f).config();
  EXPECT_EQ(built.weight_decay.value_or(-1), adam.weight_decay);
  EXPECT_EQ(built.beta2, adam.beta2);
  EXPECT_EQ(TrainerBuilder{}.sgd(1e-3f).config().momentum, sgd.momentum);
}

TEST(DeepSpeedJson, CpuOptimizerOffloadIsTaken) {
  std::vector<std::string> notes;
  auto c = TrainerConfig::from_json(
      R"({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": false, "buffer_size": 1e8}})", TrainerConfig{},
      &notes);
  ASSERT_TRUE(c) << c.error().message();
  // Keys without effect are said so, not silently dropped.
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[0].find("offload_optimizer.buffer_size: no effect"), std::string::npos) << notes[0];
  EXPECT_NE(notes[1].find("offload_optimizer.pin_memory=false: no effect"), std::string::npos) << notes[1];
  EXPECT_EQ(c->offload_optimizer.device, OffloadDevice::cpu);
  EXPECT_EQ(c->engine_options().offload_optimizer, zero::OptimizerOffload::cpu);
}

// DeepSpeed's sub_group_size (elements) is coshard's: the swap buffers follow it; a value that is
// no count is named.
TEST(DeepSpeedJson, SubGroupSizeIsTaken) {
  auto c = TrainerConfig::from_json(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e8,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}})", TrainerConfig{});
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->engine_options().sub_group_size, 100'000'000u);
  auto bad = TrainerConfig::from_json(R"({"zero_optimization": {"sub_group_size": -5}})", TrainerConfig{});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("sub_group_size"), std::string::npos) << bad.error().message();
}

// ZeRO-Infinity's usual section: parameters and optimizer state on NVMe, in one folder.
TEST(DeepSpeedJson, NvmeParameterOffloadIsTaken) {
  auto c = TrainerConfig::from_json(R"({"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4},
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5}})",
                                    TrainerConfig{});
  ASSERT_TRUE(c) << c.error().message();
  ASSERT_TRUE(c->validate()) << c->validate().error().message();
  const auto o = c->engine_options();
  EXPECT_EQ(o.offload_params, zero::OffloadTarget::nvme);
  EXPECT_EQ(o.offload_params.buffer_count, 5);
  EXPECT_EQ(o.offload_optimizer.nvme_path, "/local_nvme");
}

TEST(DeepSpeedJson, Bf16SizesAreTwoBytesAnElement) {
  auto c = TrainerConfig::from_json(
      R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 1000}})",
      TrainerConfig{});
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->dtype, DataType::bf16);
  EXPECT_EQ(c->reduce_dtype, DataType::bf16);
  EXPECT_EQ(c->zero_stage, 2);
  EXPECT_EQ(c->prefetch_bucket_bytes, 2000u);
}

TEST(DeepSpeedJson, Fp16TurnsOnDynamicLossScaling) {
  auto c = TrainerConfig::from_json(R"({"fp16": {"enabled": true, "initial_scale_power": 12}})", TrainerConfig{});
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->dtype, DataType::f16);
  EXPECT_EQ(c->loss_scaling, modules::LossScaling::dynamic);
  EXPECT_FLOAT_EQ(c->initial_loss_scale, 4096.0f);
}

TEST(DeepSpeedJson, BareZeroSectionAndBaseValuesKept) {
  TrainerConfig base;
  base.lr = 0.25f;
  auto c = TrainerConfig::from_json(R"({"stage": 1, "stage3_max_live_parameters": 10})", base);
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->zero_stage, 1);
  EXPECT_EQ(c->max_live_bytes, 40u);
  EXPECT_FLOAT_EQ(c->lr, 0.25f);
}

TEST(DeepSpeedJson, TheActivationCheckpointingSectionCheckpointsEveryBlock) {
  std::vector<std::string> notes;
  auto c = TrainerConfig::from_json(
      R"({"activation_checkpointing": {"partition_activations": false, "contiguous_memory_optimization": false,
                                       "number_checkpoints": 4, "synchronize_checkpoint_boundary": false,
                                       "profile": false, "cpu_checkpointing": false}})",
      TrainerConfig{}, &notes);
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->activation_checkpointing.every, 1);
  EXPECT_EQ(notes.size(), 5u);
  // A base that picks every N-th block keeps it.
  TrainerConfig base;
  base.activation_checkpointing.every = 3;
  auto kept = TrainerConfig::from_json(R"({"activation_checkpointing": {}})", base);
  ASSERT_TRUE(kept) << kept.error().message();
  EXPECT_EQ(kept->activation_checkpointing.every, 3);
  auto host = TrainerConfig::from_json(R"({"activation_checkpointing": {"cpu_checkpointing": true}})", TrainerConfig{});
  ASSERT_FALSE(host);
  EXPECT_NE(host.error().message().find("activation_checkpointing.cpu_checkpointing=true"), std::string::npos)
      << host.error().message();
  auto not_object = TrainerConfig::from_json(R"({"activation_checkpointing": true})", TrainerConfig{});
  ASSERT_FALSE(not_object);
  EXPECT_FALSE(TrainerConfig::from_json(R"({"activation_checkpointing": {"number_checkpoints": -1}})", TrainerConfig{}));
}

TEST(DeepSpeedJson, EveryUnknownKeyIsListed) {
  auto c = TrainerConfig::from_json(
      R"({"zero_optimization": {"stage": 3, "stage3_magic": 1, "offload_param": {"device": "none", "nvme_speed": 9}},
          "activation_checkpointing": {"recompute_magic": true}, "pipeline": {}})",
      TrainerConfig{});
  ASSERT_FALSE(c);
  const auto& m = c.error().message();
  EXPECT_NE(m.find("zero_optimization.stage3_magic"), std::string::npos) << m;
  EXPECT_NE(m.find("zero_optimization.offload_param.nvme_speed"), std::string::npos) << m;
  EXPECT_NE(m.find("activation_checkpointing.recompute_magic"), std::string::npos) << m;
  EXPECT_NE(m.find("pipeline"), std::string::npos) << m;
}

TEST(DeepSpeedJson, BadValuesAreNamed) {
  struct Case {
    const char* json;
    const char* expect;
  };
  const Case cases[] = {
      {R"({"stage": 4})", "stage=4"},
      {R"({"stage": 3, "overlap_comm": false})", "overlap_comm=false"},
      {R"({"stage": 3, "stage3_max_live_parameters": -5})", "stage3_max_live_parameters=-5"},
      // Sizes and counts that would overflow are named as written, never by what they wrap to.
      {R"({"stage": 3, "stage3_max_live_parameters": 4611686018427387904})",
       "stage3_max_live_parameters=4611686018427387904 (4 bytes an element: more than 2^62 bytes)"},
      {R"({"stage": 3, "stage3_prefetch_bucket_size": 1e300})", "stage3_prefetch_bucket_size=1e+300 (expected a whole number"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e19}}})",
       "warmup_num_steps=1e+19 (expected a whole number from 0 to 2^62)"},
      {R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}})", "offload_param"},
      {R"({"stage": 3, "offload_optimizer": {"device": "tape"}})", "offload_optimizer.device=\"tape\""},
      {R"({"optimizer": {"type": "Lamb"}})", "optimizer.type=\"Lamb\""},
      {R"([1, 2])", "expected a JSON object"},
      {R"({"stage": )", "not valid JSON"},
  };
  for (const auto& k : cases) {
    auto c = TrainerConfig::from_json(k.json, TrainerConfig{});
    ASSERT_FALSE(c) << k.json;
    EXPECT_NE(c.error().message().find(k.expect), std::string::npos) << k.json << " -> " << c.error().message();
  }
}

// #48 item 5: two names for one setting with different values are refused naming both (the file
// order settled it in silence: stage 3 trained where zero_stage said 1); the same value twice is
// one setting given twice.
TEST(DeepSpeedJson, TwoNamesForOneSettingMustAgree) {
  const std::vector<std::pair<const char*, const char*>> conflicts = {
      {R"({"zero_stage": 1, "zero_optimization": {"stage": 3}})", "zero_stage=1 and zero_optimization.stage=3 (two names for zero_stage"},
      {R"({"lr": 0.1, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})", "lr=0.1 and optimizer.params.lr=0.01 (two names for lr"},
      {R"({"gradient_clipping": 1.0, "max_grad_norm": 0.5})", "gradient_clipping=1 and max_grad_norm=0.5 (two names for max_grad_norm"},
  };
  for (const auto& [text, expected] : conflicts) {
    auto c = TrainerConfig::from_json(text, TrainerConfig{});
    ASSERT_FALSE(c) << text;
    EXPECT_NE(c.error().message().find(expected), std::string::npos) << c.error().message();
  }
  auto same = TrainerConfig::from_json(R"({"zero_stage": 2, "zero_optimization": {"stage": 2}, "lr": 0.01,
      "optimizer": {"params": {"lr": 0.01}}})", TrainerConfig{});
  ASSERT_TRUE(same) << same.error().message();
  EXPECT_EQ(same->zero_stage, 2);
  EXPECT_FLOAT_EQ(same->lr, 0.01f);
  // warmup_steps no longer resets warmup_shape (the keys' order decided it).
  auto shaped = TrainerConfig::from_json(R"({"warmup_shape": "log", "warmup_steps": 5})", TrainerConfig{});
  ASSERT_TRUE(shaped) << shaped.error().message();
  EXPECT_EQ(shaped->warmup_shape, WarmupShape::log);
  // adaptive_prefetch beside a prefetch_bucket_bytes: adaptive, capped there, whatever the order.
  auto capped = TrainerConfig::from_json(R"({"adaptive_prefetch": true, "prefetch_bucket_bytes": 8388608})", TrainerConfig{});
  ASSERT_TRUE(capped) << capped.error().message();
  EXPECT_TRUE(capped->adaptive_prefetch);
  EXPECT_EQ(capped->prefetch_bucket_bytes, 8388608u);
}

// "auto" for the budget of gathered parameters is the default, which follows the model (#48 item 4:
// --print-config writes it so, and it reads back).
TEST(DeepSpeedJson, AutoMaxLiveFollowsTheModel) {
  TrainerConfig exact;
  exact.max_live_bytes = 4096;
  exact.max_live_follows_model = false;
  for (const char* text : {R"({"stage": 3, "stage3_max_live_parameters": "auto"})", R"({"max_live_bytes": "auto"})"}) {
    auto c = TrainerConfig::from_json(text, exact);
    ASSERT_TRUE(c) << text << ": " << c.error().message();
    EXPECT_TRUE(c->max_live_follows_model) << text;
    EXPECT_EQ(c->max_live_bytes, TrainerConfig{}.max_live_bytes) << text;
  }
}

TEST(DeepSpeedJson, MissingFileIsNamed) {
  auto c = TrainerConfig::from_json_file("/nonexistent/ds.json", TrainerConfig{});
  ASSERT_FALSE(c);
  EXPECT_NE(c.error().message().find("/nonexistent/ds.json"), std::string::npos);
}

}  // namespace
}  // namespace coshard::trainer

namespace coshard::trainer {
namespace {

// Warm-up then cosine or linear decay to a minimum, and DeepSpeed's three schedulers onto it.
TEST(LrSchedule, WarmsUpThenDecaysToTheMinimum) {
  TrainerConfig c;
  c.lr = 1.0f;
  c.warmup_steps = 4;
  c.warmup_min_lr = 0.2f;
  c.decay = LrDecay::cosine;
  c.decay_steps = 14;
  c.min_lr = 0.1f;
  ASSERT_TRUE(c.validate());
  EXPECT_FLOAT_EQ(c.lr_at(0), 0.4f);   // 0.2 + 0.8 * 1/4
  EXPECT_FLOAT_EQ(c.lr_at(3), 1.0f);
  EXPECT_FLOAT_EQ(c.lr_at(4), 1.0f);   // the decay starts at the top
  EXPECT_FLOAT_EQ(c.lr_at(9), 0.55f);  // halfway: the mean of lr and min_lr
  EXPECT_FLOAT_EQ(c.lr_at(14), 0.1f);
  EXPECT_FLOAT_EQ(c.lr_at(1000), 0.1f);
  c.decay = LrDecay::linear;
  EXPECT_FLOAT_EQ(c.lr_at(9), 0.55f);
  EXPECT_FLOAT_EQ(c.lr_at(6), 0.82f);
  c.decay_steps = 4;
  EXPECT_FALSE(c.validate());
}

TEST(LrSchedule, DeepSpeedSchedulersMap) {
  auto cosine = TrainerConfig::from_json(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10,
                    "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": "linear"}}})",
                                         TrainerConfig{});
  ASSERT_TRUE(cosine) << cosine.error().message();
  EXPECT_EQ(cosine->decay, LrDecay::cosine);
  EXPECT_EQ(cosine->decay_steps, 100);
  EXPECT_FLOAT_EQ(cosine->lr_at(0), 0.001f + 0.009f * 0.1f);
  EXPECT_FLOAT_EQ(cosine->lr_at(100), 0.0001f);
  auto decay = TrainerConfig::from_json(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50,
      "warmup_min_lr": 0.0, "warmup_max_lr": 0.002, "warmup_num_steps": 5}}})",
                                        TrainerConfig{});
  ASSERT_TRUE(decay) << decay.error().message();
  EXPECT_EQ(decay->warmup_shape, WarmupShape::log);  // DeepSpeed's default warmup_type
  EXPECT_FLOAT_EQ(decay->lr, 0.002f);
  EXPECT_FLOAT_EQ(decay->lr_at(4), 0.002f);
  EXPECT_FLOAT_EQ(decay->lr_at(50), 0.0f);
  auto bad = TrainerConfig::from_json(R"({"scheduler": {"type": "OneCycle", "params": {}}})", TrainerConfig{});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("scheduler.type=\"OneCycle\""), std::string::npos) << bad.error().message();
  auto no_total = TrainerConfig::from_json(R"({"scheduler": {"type": "WarmupDecayLR"}})", TrainerConfig{});
  ASSERT_FALSE(no_total);
  EXPECT_NE(no_total.error().message().find("total_num_steps: required"), std::string::npos);
}

// train_batch_size = micro batch x accumulation x world, as DeepSpeed checks it.
TEST(BatchSizes, AreCheckedAgainstEachOtherAndTheWorld) {
  auto c = TrainerConfig::from_json(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                        "gradient_accumulation_steps": 2})",
                                    TrainerConfig{});
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->check_batch(4, 0).value_or(-1), 32);
  EXPECT_EQ(c->check_batch(4, 32).value_or(-1), 32);
  auto wrong_world = c->check_batch(2, 0);
  ASSERT_FALSE(wrong_world);
  EXPECT_NE(wrong_world.error().message().find("world size 2: expected train_batch_size = micro batch x accumulation x world = 16"),
            std::string::npos)
      << wrong_world.error().message();
  auto other = c->check_batch(4, 64);
  ASSERT_FALSE(other);
  EXPECT_NE(other.error().message().find("the config's global batch is 32, not 64"), std::string::npos);
  TrainerConfig plain;
  EXPECT_EQ(plain.check_batch(2, 16).value_or(-1), 16);
  EXPECT_FALSE(plain.check_batch(3, 16));
}

}  // namespace
}  // namespace coshard::trainer

namespace coshard::trainer {
namespace {

// MiCS's shard size is hybrid sharding's shard group size (-1, DeepSpeed's default: the whole
// world); hpZ's partition size is the secondary partition's ranks (1, its default: none).
TEST(DeepSpeedJson, MicsShardSizeIsTheShardGroupAndHpzTheSecondaryPartition) {
  auto c = TrainerConfig::from_json(R"({"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 1})", TrainerConfig{});
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->shard_group_size, 2);
  EXPECT_EQ(c->engine_options().shard_group_size, 2);
  auto off = TrainerConfig::from_json(R"({"stage": 3, "mics_shard_size": -1})", *c);
  ASSERT_TRUE(off) << off.error().message();
  EXPECT_EQ(off->shard_group_size, 0);
  auto own = TrainerConfig::from_json(R"({"shard_group_size": "local"})", TrainerConfig{});
  ASSERT_TRUE(own) << own.error().message();
  EXPECT_TRUE(own->shard_group_local);
  EXPECT_EQ(c->secondary_partition_ranks, 1);
  auto hpz = TrainerConfig::from_json(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})", TrainerConfig{});
  ASSERT_TRUE(hpz) << hpz.error().message();
  EXPECT_EQ(hpz->secondary_partition_ranks, 8);
  EXPECT_TRUE(hpz->validate());
  auto stage2 = TrainerConfig::from_json(R"({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}})", TrainerConfig{});
  ASSERT_FALSE(stage2);
  EXPECT_NE(stage2.error().message().find("secondary_partition_ranks=8 with zero_stage=2"), std::string::npos)
      << stage2.error().message();
  auto zero = TrainerConfig::from_json(R"({"zero_optimization": {"zero_hpz_partition_size": 0}})", TrainerConfig{});
  ASSERT_FALSE(zero);
  EXPECT_NE(zero.error().message().find("zero_hpz_partition_size"), std::string::npos) << zero.error().message();
  auto local = TrainerConfig::from_json(R"({"secondary_partition_ranks": "local"})", TrainerConfig{});
  ASSERT_TRUE(local) << local.error().message();
  EXPECT_TRUE(local->secondary_partition_local);
  auto threads = local->secondary_partition_ranks_for(4);  // (ranks as threads share one machine)
  ASSERT_TRUE(threads) << threads.error().message();
  EXPECT_EQ(*threads, 4);
  auto bad = TrainerConfig::from_json(R"({"stage": 3, "mics_shard_size": -3})", TrainerConfig{});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("mics_shard_size"), std::string::npos) << bad.error().message();
}

// ZeRO++'s qwZ keys: int8 weight gathers of every unit or of frozen ones; refused where no weights
// are gathered (stage 2), by the engine's own rule.
TEST(DeepSpeedJson, QuantizedWeightsAreTheQuantizedGathers) {
  auto c = TrainerConfig::from_json(
      R"({"zero_optimization": {"stage": 3, "zero_quantized_weights": true, "zero_quantized_nontrainable_weights": false}})",
      TrainerConfig{});
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->engine_options().quantize_weights, zero::Quantization::int8);
  EXPECT_EQ(c->engine_options().quantize_frozen_weights, zero::Quantization::none);
  EXPECT_TRUE(c->validate());
  auto frozen = TrainerConfig::from_json(R"({"stage": 3, "zero_quantized_nontrainable_weights": true})", TrainerConfig{});
  ASSERT_TRUE(frozen) << frozen.error().message();
  EXPECT_EQ(frozen->quantize_weights, zero::Quantization::none);
  EXPECT_EQ(frozen->quantize_frozen_weights, zero::Quantization::int8);
  auto own = TrainerConfig::from_json(R"({"quantize_weights": "int8", "quantize_weights_block": 256})", TrainerConfig{});
  ASSERT_TRUE(own) << own.error().message();
  EXPECT_EQ(own->quantize_weights_block, 256);
  auto stage2 = TrainerConfig::from_json(R"({"stage": 2, "zero_quantized_weights": true})", TrainerConfig{});
  ASSERT_FALSE(stage2);
  EXPECT_NE(stage2.error().message().find("quantize_weights=int8 with zero_stage=2"), std::string::npos)
      << stage2.error().message();
  auto not_bool = TrainerConfig::from_json(R"({"stage": 3, "zero_quantized_weights": "yes"})", TrainerConfig{});
  ASSERT_FALSE(not_bool);
  EXPECT_NE(not_bool.error().message().find("zero_quantized_weights"), std::string::npos) << not_bool.error().message();
  auto int4 = TrainerConfig::from_json(R"({"quantize_weights": "int4"})", TrainerConfig{});
  ASSERT_FALSE(int4);
  EXPECT_NE(int4.error().message().find("expected none or int8"), std::string::npos) << int4.error().message();
  auto tiny = TrainerConfig::from_json(R"({"quantize_weights_block": 4})", TrainerConfig{});
  EXPECT_FALSE(tiny && tiny->validate());
  // qgZ's key: the gradients' reduction in int4 blocks, as DeepSpeed's all-to-all carries them;
  // refused where no reduce-scatter runs per unit. coshard's own key takes int8 too.
  auto grads = TrainerConfig::from_json(R"({"zero_optimization": {"stage": 2, "zero_quantized_gradients": true}})",
                                        TrainerConfig{});
  ASSERT_TRUE(grads) << grads.error().message();
  EXPECT_EQ(grads->engine_options().quantize_gradients, zero::Quantization::int4);
  auto grads_stage1 = TrainerConfig::from_json(R"({"stage": 1, "zero_quantized_gradients": true})", TrainerConfig{});
  ASSERT_FALSE(grads_stage1);
  EXPECT_NE(grads_stage1.error().message().find("quantize_gradients=int4 with zero_stage=1"), std::string::npos)
      << grads_stage1.error().message();
  auto int8_grads = TrainerConfig::from_json(R"({"quantize_gradients": "int8"})", TrainerConfig{});
  ASSERT_TRUE(int8_grads) << int8_grads.error().message();
  EXPECT_EQ(int8_grads->quantize_gradients, zero::Quantization::int8);
  // DeepSpeed's flag and coshard's name for one setting must agree, as every pair of names must.
  auto both = TrainerConfig::from_json(
      R"({"zero_optimization": {"stage": 3, "zero_quantized_gradients": true}, "quantize_gradients": "int8"})",
      TrainerConfig{});
  ASSERT_FALSE(both);
  EXPECT_NE(both.error().message().find("(two names for quantize_gradients"), std::string::npos) << both.error().message();
  auto off = TrainerConfig::from_json(
      R"({"zero_optimization": {"stage": 3, "zero_quantized_weights": false}, "quantize_weights": "int8"})", TrainerConfig{});
  ASSERT_FALSE(off);
  EXPECT_NE(off.error().message().find("(two names for quantize_weights"), std::string::npos) << off.error().message();
  auto agree = TrainerConfig::from_json(
      R"({"zero_optimization": {"stage": 3, "zero_quantized_gradients": true}, "quantize_gradients": "int4"})",
      TrainerConfig{});
  ASSERT_TRUE(agree) << agree.error().message();
  // A value that is no whole number says what the setting takes (local too).
  for (const char* bad : {R"({"secondary_partition_ranks": 2.5})", R"({"secondary_partition_ranks": "abc"})",
                          R"({"zero_optimization": {"zero_hpz_partition_size": true}})"}) {
    auto refused = TrainerConfig::from_json(bad, TrainerConfig{});
    ASSERT_FALSE(refused) << bad;
    EXPECT_NE(refused.error().message().find("1 (none) or local)"), std::string::npos) << refused.error().message();
  }
  auto odd = TrainerConfig::from_json(R"({"quantize_gradients": "int4", "quantize_gradients_block": 255})", TrainerConfig{});
  ASSERT_FALSE(odd);
  EXPECT_NE(odd.error().message().find("quantize_gradients_block=255 with quantize_gradients=int4: expected an even count"),
            std::string::npos)
      << odd.error().message();
}

// "local": the ranks of one node, resolved when the engine's options are made (ranks as threads
// of one process are one node: the whole world).
TEST(TrainerConfig, LocalShardGroupsAreTheRanksOfOneNode) {
  TrainerConfig c;
  c.shard_group_local = true;
  auto model = coshard::testing::make_regression_mlp();
  ASSERT_TRUE(model);
  auto o = c.engine_options_for(**model, 4);
  ASSERT_TRUE(o) << o.error().message();
  EXPECT_EQ(o->shard_group_size, 4);
}

}  // namespace
}  // namespace coshard::trainer
