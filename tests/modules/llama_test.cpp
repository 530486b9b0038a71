// make_llama and its presets (shapes and parameter counts of Meta's releases), the checks of a
// bad configuration, activation checkpointing's policy and wrapping, and the activation memory a
// Context measures: checkpointing lowers it and changes no bit of the loss or the gradients.
#include <gtest/gtest.h>

#include <set>

#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

TEST(LlamaPresets, HaveThePublishedParameterCounts) {
  // The counts transformers reports (sum of numel over model.parameters(), tied counted once).
  const std::pair<const char*, std::int64_t> published[] = {
      {"Llama-3.2-1B", 1'235'814'400}, {"Llama-3.2-3B", 3'212'749'824}, {"Llama-3.1-8B", 8'030'261'248}};
  for (const auto& [name, count] : published) {
    auto p = llama_preset(name);
    ASSERT_TRUE(p) << p.error().message();
    EXPECT_EQ(p->name, name);
    EXPECT_TRUE(p->config.validate()) << name;
    EXPECT_EQ(p->config.parameter_count(), count) << name;
  }
  auto lower = llama_preset("llama-3.2-1b");
  ASSERT_TRUE(lower) << "names are case-insensitive";
  EXPECT_EQ(lower->name, "Llama-3.2-1B");
  EXPECT_TRUE(lower->config.tie_embeddings);
  EXPECT_EQ(lower->config.rope_scaling.factor, 32);
  auto small = llama_preset("llama-100m");
  ASSERT_TRUE(small);
  EXPECT_NEAR(static_cast<double>(small->config.parameter_count()), 100e6, 5e6);
  auto missing = llama_preset("Llama-9000");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message().find("Llama-9000"), std::string::npos);
  EXPECT_NE(missing.error().message().find("Llama-3.1-8B"), std::string::npos) << "the error lists the presets";
  std::set<std::string_view> names;
  for (const auto& p : llama_presets()) EXPECT_TRUE(names.insert(p.name).second) << p.name;
}

TEST(MakeLlama, BuildsTheParametersItCountsUnderTheirNames) {
  for (bool tied : {false, true}) {
    LlamaConfig c{.vocab = 40, .dim = 24, .layers = 2, .heads = 6, .kv_heads = 2, .intermediate = 20,
                  .tie_embeddings = tied};
    auto model = make_llama(c);
    ASSERT_TRUE(model) << model.error().message();
    EXPECT_EQ((*model)->parameter_count(), c.parameter_count());
    std::vector<std::string> names;
    std::map<std::string, Shape> shapes;
    (*model)->for_each_parameter([&](const std::string& n, Parameter& p) {
      names.push_back(n);
      shapes.emplace(n, p.shape());
    });
    std::vector<std::string> expected{"embed.weight"};
    for (int l = 0; l < 2; ++l)
      for (const char* p : {"attn.norm.weight", "attn.qkv.weight", "attn.proj.weight", "mlp.norm.weight",
                            "mlp.gate_up.weight", "mlp.down.weight"})
        expected.push_back("h" + std::to_string(l) + "." + p);
    expected.push_back("norm.weight");
    if (!tied) expected.push_back("head.weight");
    EXPECT_EQ(names, expected);
    EXPECT_EQ(shapes.at("h0.attn.qkv.weight"), (Shape{(6 + 2 * 2) * 4, 24}));
    EXPECT_EQ(shapes.at("h1.mlp.gate_up.weight"), (Shape{40, 24}));
    EXPECT_EQ(shapes.at("h1.mlp.down.weight"), (Shape{24, 20}));
  }
}

TEST(MakeLlama, RefusesABadShapeNamingTheValue) {
  auto expect_refused = [](LlamaConfig c, const std::string& named) {
    auto m = make_llama(c);
    ASSERT_FALSE(m) << named;
    EXPECT_NE(m.error().message().find(named), std::string::npos) << m.error().message();
  };
  expect_refused({.heads = 4, .kv_heads = 3}, "kv_heads=3");
  expect_refused({.dim = 30, .heads = 4}, "dim=30");
  expect_refused({.dim = 36, .heads = 4, .kv_heads = 2}, "head_dim=9");  // odd: rotary pairs halves
  expect_refused({.intermediate = 0}, "intermediate=0");
  expect_refused({.rope_theta = 0.5}, "rope_theta=0.5");
  expect_refused({.norm_eps = 0}, "norm_eps=0");
  expect_refused({.rope_scaling = {.factor = 8, .low_freq_factor = 4, .high_freq_factor = 1}}, "low_freq_factor=4");
}

TEST(ActivationCheckpointingPolicy, ParsesAndPicksEveryNthBlock) {
  EXPECT_EQ(ActivationCheckpointing::parse("none")->every, 0);
  EXPECT_EQ(ActivationCheckpointing::parse("full")->every, 1);
  EXPECT_EQ(ActivationCheckpointing::parse("3")->every, 3);
  for (const char* bad : {"", "0", "-2", "2x", "some"}) {
    auto p = ActivationCheckpointing::parse(bad);
    ASSERT_FALSE(p) << bad;
    EXPECT_NE(p.error().message().find("expected none, full, or N"), std::string::npos);
  }
  const ActivationCheckpointing second{2};
  EXPECT_FALSE(second.checkpoints(0));
  EXPECT_TRUE(second.checkpoints(1));
  EXPECT_TRUE(second.checkpoints(3));
  EXPECT_EQ(second.to_string(), "every 2nd block");
  EXPECT_EQ(ActivationCheckpointing{1}.to_string(), "full");

  auto model = make_llama({.layers = 5});
  ASSERT_TRUE(model);
  EXPECT_EQ(apply_activation_checkpointing(**model, second), 2);  // h1, h3
  EXPECT_EQ(apply_activation_checkpointing(**model, second), 0) << "never wrapped twice";
  std::vector<std::string> wrapped;
  for (const auto& c : (*model)->children())
    if (c.module->type_name() == "Checkpointed") wrapped.push_back(c.name);
  EXPECT_EQ(wrapped, (std::vector<std::string>{"h1", "h3"}));
  EXPECT_EQ((*model)->parameter_count(), LlamaConfig{.layers = 5}.parameter_count()) << "names and parameters unchanged";
}

class LlamaMemory : public testing::ModuleFixture {
 protected:
  struct Pass {
    double loss = 0;
    std::vector<double> grads;
    std::size_t peak = 0;
  };
  Pass forward_backward_of(const ActivationCheckpointing& policy) {
    auto body = [&]() -> async::Task<Result<Pass>> {
      const LlamaConfig c{.vocab = 64, .max_seq = 16, .dim = 32, .layers = 4, .heads = 4, .kv_heads = 2,
                          .intermediate = 64};
      COSHARD_CO_TRY_ASSIGN(auto model, make_llama(c));
      apply_activation_checkpointing(*model, policy);
      COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(*ctx_, *model, DataType::f32));
      COSHARD_CO_TRY(co_await store.initialize(*ctx_, 9));
      std::vector<int> ids(4 * 16);
      for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int>((i * 7 + 3) % 64);
      Tensor x = tokens(ids, Shape{4, 16});
      Tensor y = tokens(std::vector<int>(ids.rbegin(), ids.rend()), Shape{4, 16});
      COSHARD_CO_TRY_ASSIGN(Tensor seed, ctx_->upload(encode_values(std::vector<double>{1.0}, DataType::f32), Shape{1},
                                                      DataType::f32));
      CrossEntropyLoss loss;
      ctx_->reset_activation_peak();
      COSHARD_CO_TRY_ASSIGN(Tensor value, co_await forward_backward(*ctx_, *model, loss, x, y, seed));
      Pass p;
      p.peak = ctx_->activation_memory().peak_bytes;
      COSHARD_CO_TRY_ASSIGN(auto l, co_await ctx_->read(value));
      p.loss = l[0];
      COSHARD_CO_TRY_ASSIGN(p.grads, co_await ctx_->read(store.grads()));
      co_return p;
    };
    auto r = rt_.block_on(body());
    EXPECT_TRUE(r) << r.error().message();
    return r ? *r : Pass{};
  }
};

TEST_F(LlamaMemory, CheckpointingLowersThePeakAndChangesNoBit) {
  const Pass none = forward_backward_of({0});
  const Pass every_other = forward_backward_of({2});
  const Pass full = forward_backward_of({1});
  ASSERT_GT(none.peak, 0u);
  EXPECT_EQ(full.loss, none.loss);
  EXPECT_EQ(every_other.loss, none.loss);
  EXPECT_EQ(full.grads, none.grads);
  EXPECT_EQ(every_other.grads, none.grads);
  EXPECT_LT(every_other.peak, none.peak);
  EXPECT_LT(full.peak, every_other.peak);
  RecordProperty("peak_ratio_full", std::to_string(static_cast<double>(full.peak) / static_cast<double>(none.peak)));
}

// The estimates the memory check uses follow the same policy: checkpointed blocks keep their input.
TEST(ActivationEstimates, FallWithCheckpointedBlocks) {
  auto preset = llama_preset("llama-100m");
  ASSERT_TRUE(preset);
  const auto none = llama_activation_bytes(preset->config, 4, 128, DataType::f32, 0);
  const auto half = llama_activation_bytes(preset->config, 4, 128, DataType::f32, 6);
  const auto full = llama_activation_bytes(preset->config, 4, 128, DataType::f32, 12);
  EXPECT_LT(half, none);
  EXPECT_LT(full, half);
  const GptConfig gpt{.vocab = 50304, .max_seq = 1024, .dim = 768, .layers = 12, .heads = 12};
  EXPECT_LT(gpt_activation_bytes(gpt, 8, 1024, DataType::bf16, 12), gpt_activation_bytes(gpt, 8, 1024, DataType::bf16));
}

// Attention runs fused on CUDA in bf16/f16 for the head sizes the kernels serve (decided by the
// kernels themselves, no device needed), and the estimates then drop the T x T probabilities.
TEST(ActivationEstimates, FusedAttentionDropsTheProbabilities) {
  const bool cuda = async::cuda_compiled();
  EXPECT_EQ(attention_is_fused(async::Device::cuda(0), DataType::bf16, 64), cuda);
  EXPECT_EQ(attention_is_fused(async::Device::cuda(0), DataType::f16, 128), cuda);
  EXPECT_FALSE(attention_is_fused(async::Device::cuda(0), DataType::bf16, 64, AttentionKernels::materialized));
  EXPECT_FALSE(attention_is_fused(async::Device::cuda(0), DataType::f32, 64));
  EXPECT_FALSE(attention_is_fused(async::Device::cuda(0), DataType::bf16, 16));
  EXPECT_FALSE(attention_is_fused(async::Device::cpu(), DataType::bf16, 64));
  auto preset = llama_preset("Llama-3.2-1B");
  ASSERT_TRUE(preset);
  const auto materialized = llama_activation_bytes(preset->config, 1, 2048, DataType::bf16, 0, false);
  const auto fused = llama_activation_bytes(preset->config, 1, 2048, DataType::bf16, 0, true);
  // 16 blocks of 32 heads x 2048^2 bf16 probabilities: about 4 GiB.
  EXPECT_GT(materialized - fused, std::size_t{3} << 30);
  const GptConfig gpt{.vocab = 50304, .max_seq = 1024, .dim = 1600, .layers = 48, .heads = 25};
  EXPECT_LT(gpt_activation_bytes(gpt, 4, 1024, DataType::bf16, 0, true), gpt_activation_bytes(gpt, 4, 1024, DataType::bf16));
}

TEST_F(LlamaMemory, TheMeterCountsTensorsUntilTheyAreDropped) {
  const auto before = ctx_->activation_memory();
  {
    auto a = ctx_->empty(Shape{256}, DataType::f32);
    ASSERT_TRUE(a);
    EXPECT_EQ(ctx_->activation_memory().live_bytes, before.live_bytes + 1024);
    Tensor view = a->slice(16, Shape{8});  // a view shares the memory: counted once
    EXPECT_EQ(ctx_->activation_memory().live_bytes, before.live_bytes + 1024);
  }
  EXPECT_EQ(ctx_->activation_memory().live_bytes, before.live_bytes);
  EXPECT_GE(ctx_->activation_memory().peak_bytes, before.live_bytes + 1024);
  ctx_->reset_activation_peak();
  EXPECT_EQ(ctx_->activation_memory().peak_bytes, before.live_bytes);
}

}  // namespace
}  // namespace coshard::modules
