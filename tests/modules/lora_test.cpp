// Low-rank adapters (lora.hpp): which layers apply_lora adapts and what it freezes, the errors
// that name the value, the adapted output against the base plus its scaled product on its rows
// (in f64 on the CPU), PEFT's initialisation, and dropout masks replayed by a recompute.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/lora.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

using testing::random_values;

class Lora : public testing::ModuleFixture {
 protected:
  std::map<std::string, bool> trainability(Module& m) {
    std::map<std::string, bool> out;
    m.for_each_parameter([&](const std::string& name, Parameter& p) { out[name] = p.trainable(); });
    return out;
  }
  std::vector<double> read(const Tensor& t) {
    auto r = rt_.block_on(ctx_->read(t));
    EXPECT_TRUE(r) << r.error().message();
    return r ? *r : std::vector<double>{};
  }
};

TEST_F(Lora, ApplyAdaptsTheMatchedLinearLayersAndFreezesEverythingElse) {
  auto gpt = make_gpt(GptConfig{.vocab = 32, .max_seq = 8, .dim = 16, .layers = 2, .heads = 2});
  ASSERT_TRUE(gpt);
  auto made = apply_lora(**gpt, LoraOptions{.targets = {"*.attn.qkv", "h1.mlp.*"}, .rank = 4, .alpha = 8});
  ASSERT_TRUE(made) << made.error().message();
  std::vector<std::string> paths;
  for (const auto& a : *made) paths.push_back(a.path);
  // In model order; "h1.mlp.*" matches the MLP's two linear layers, not its norm or activation.
  EXPECT_EQ(paths, (std::vector<std::string>{"h0.attn.qkv.lora", "h1.attn.qkv.lora", "h1.mlp.fc.lora",
                                             "h1.mlp.proj.lora"}));
  for (const auto& [name, trains] : trainability(**gpt)) {
    const bool adapter = name.find(".lora.") != std::string::npos;
    EXPECT_EQ(trains, adapter) << name;
  }
  const LoraAdapter& a = *made->front().adapter;
  EXPECT_EQ(a.a().shape(), (Shape{4, 16}));
  EXPECT_EQ(a.b().shape(), (Shape{48, 4}));
  EXPECT_FLOAT_EQ(a.scale(), 2.0f);
}

TEST_F(Lora, LlamaProjectionsGoByTheirHuggingFaceNamesOnTheRowsOfTheFusedLayers) {
  const LlamaConfig c = llama_preset("llama-tiny")->config;  // heads 4, kv 2, head_dim 16, MLP 128
  auto llama = make_llama(c);
  ASSERT_TRUE(llama);
  auto made = apply_lora(**llama, LoraOptions{.targets = {"q_proj", "*.v_proj", "down_proj", "h1.mlp.gate_up"}});
  ASSERT_TRUE(made) << made.error().message();
  std::vector<std::string> got;
  for (const auto& a : *made)
    got.push_back(a.path + " " + a.hf_projection + " " + std::to_string(a.layer) + " [" +
                  std::to_string(a.adapter->row_begin()) + "," + std::to_string(a.adapter->row_end()) + ")");
  EXPECT_EQ(got, (std::vector<std::string>{
                     "h0.attn.qkv.lora_q_proj q_proj 0 [0,64)", "h0.attn.qkv.lora_v_proj v_proj 0 [96,128)",
                     "h0.mlp.down.lora_down_proj down_proj 0 [0,64)", "h1.attn.qkv.lora_q_proj q_proj 1 [0,64)",
                     "h1.attn.qkv.lora_v_proj v_proj 1 [96,128)", "h1.mlp.gate_up.lora_gate_proj gate_proj 1 [0,128)",
                     "h1.mlp.gate_up.lora_up_proj up_proj 1 [128,256)", "h1.mlp.down.lora_down_proj down_proj 1 [0,64)"}));
  EXPECT_EQ(made->front().adapter->b().shape(), (Shape{64, 8}));
}

TEST_F(Lora, ErrorsNameTheValue) {
  auto fresh = [] { return std::move(*make_gpt(GptConfig{.vocab = 32, .max_seq = 8, .dim = 16, .layers = 1, .heads = 2})); };
  auto message = [&](LoraOptions o) {
    auto model = fresh();
    auto r = apply_lora(*model, o);
    return r ? std::string("(accepted)") : r.error().message();
  };
  EXPECT_NE(message({.targets = {"*.nothing"}}).find("\"*.nothing\" matches no linear layer (nor any module)"),
            std::string::npos);
  EXPECT_NE(message({.targets = {"h0.attn.ln"}}).find("h0.attn.ln (LayerNorm)"), std::string::npos);
  EXPECT_NE(message({.targets = {"*.qkv"}, .rank = 0}).find("rank=0"), std::string::npos);
  EXPECT_NE(message({.targets = {"*.qkv"}, .alpha = -1}).find("alpha=-1"), std::string::npos);
  EXPECT_NE(message({.targets = {"*.qkv"}, .dropout = 1}).find("dropout=1"), std::string::npos);
  EXPECT_NE(message({}).find("no targets"), std::string::npos);
  auto model = fresh();
  ASSERT_TRUE(apply_lora(*model, LoraOptions{.targets = {"*.qkv"}}));
  auto again = apply_lora(*model, LoraOptions{.targets = {"*.qkv"}});
  ASSERT_FALSE(again);
  EXPECT_NE(again.error().message().find("h0.attn.qkv already has adapters"), std::string::npos);
  Linear l(4, 6);
  auto rows = l.add_lora("x", 4, 7, LoraOptions{.targets = {"x"}});
  ASSERT_FALSE(rows);
  EXPECT_NE(rows.error().message().find("rows [4, 7) of an output of 6"), std::string::npos);
}

// y = x W^T + b, plus scale * (x A^T) B^T on rows [2, 5): computed here in f64 from the values.
TEST_F(Lora, TheOutputIsTheBasePlusTheScaledProductOnItsRows) {
  Linear l(4, 6);
  const LoraOptions o{.targets = {"x"}, .rank = 2, .alpha = 5};
  ASSERT_TRUE(l.add_lora("lora", 2, 5, o));
  auto store = ParameterStore::create(*ctx_, l, DataType::f64);
  ASSERT_TRUE(store) << store.error().message();
  const auto pv = random_values(static_cast<std::size_t>(store->numel()), 3, 0.5);
  ASSERT_TRUE(rt_.block_on(drained()));
  std::copy(pv.begin(), pv.end(), store->values().span<double>().begin());
  auto value = [&](const std::string& name, std::size_t i) {
    for (const auto& e : store->entries())
      if (e.name == name) return pv[static_cast<std::size_t>(e.offset) + i];
    ADD_FAILURE() << "no parameter " << name;
    return 0.0;
  };
  const auto xv = random_values(3 * 4, 4);
  const Tensor x = host_tensor(xv, Shape{3, 4}, DataType::f64);
  auto y = rt_.block_on(ctx_->forward(l, x));
  ASSERT_TRUE(y) << y.error().message();
  const auto got = read(*y);
  for (int r = 0; r < 3; ++r)
    for (int j = 0; j < 6; ++j) {
      double want = value("bias", static_cast<std::size_t>(j));
      for (int i = 0; i < 4; ++i) want += xv[r * 4 + i] * value("weight", static_cast<std::size_t>(j * 4 + i));
      if (j >= 2 && j < 5)
        for (int k = 0; k < 2; ++k) {
          double ax = 0;
          for (int i = 0; i < 4; ++i) ax += xv[r * 4 + i] * value("lora.A", static_cast<std::size_t>(k * 4 + i));
          want += 2.5 * ax * value("lora.B", static_cast<std::size_t>((j - 2) * 2 + k));
        }
      EXPECT_NEAR(got[static_cast<std::size_t>(r * 6 + j)], want, 1e-12) << "row " << r << " column " << j;
    }
  l.clear_saved_recursive();
}

// As PEFT initialises: A Kaiming-uniform (within +-1/sqrt(in)), B zero, so the adapted model's
// first output is its base's, bit for bit.
TEST_F(Lora, AnAdaptedModelStartsAsItsBase) {
  auto run = [&](bool adapted) {
    auto gpt = make_gpt(GptConfig{.vocab = 32, .max_seq = 8, .dim = 16, .layers = 2, .heads = 2});
    EXPECT_TRUE(gpt);
    if (adapted) EXPECT_TRUE(apply_lora(**gpt, LoraOptions{.targets = {"*.qkv", "*.fc"}, .rank = 4}));
    auto store = ParameterStore::create(*ctx_, **gpt, DataType::f32);
    EXPECT_TRUE(store);
    EXPECT_TRUE(rt_.block_on(store->initialize(*ctx_, 5)));
    if (adapted) {
      const double bound = 1.0 / std::sqrt(16.0);
      double largest = 0;
      for (const auto& e : store->entries()) {
        const auto v = read(e.parameter->value());
        if (e.name.ends_with(".lora.B"))
          for (double b : v) EXPECT_EQ(b, 0.0) << e.name;
        if (e.name.ends_with(".lora.A"))
          for (double a : v) largest = std::max(largest, std::abs(a));
      }
      EXPECT_GT(largest, 0.5 * bound);
      EXPECT_LE(largest, bound);
    }
    std::vector<double> ids(2 * 8);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<double>((i * 7) % 32);
    auto logits = rt_.block_on(ctx_->forward(**gpt, host_tensor(ids, Shape{2, 8}, DataType::i32)));
    EXPECT_TRUE(logits);
    auto values = read(*logits);
    (*gpt)->clear_saved_recursive();
    return values;
  };
  EXPECT_EQ(run(true), run(false));
}

// Dropout on the adapter's input: the same masks for the same seed, another seed other masks, and
// a checkpointed block's recompute replays its forward's masks (the gradients are those without
// checkpointing, bit for bit).
TEST_F(Lora, DropoutMasksAreDeterministicAndReplayedByARecompute) {
  auto gradients = [&](bool checkpointed, std::uint64_t seed) {
    auto inner = std::make_unique<Sequential>();
    inner->add("fc", std::make_unique<Linear>(6, 6));
    Sequential model;
    if (checkpointed) model.add("block", std::make_unique<Checkpointed>(std::move(inner)));
    else model.add("block", std::move(inner));
    EXPECT_TRUE(apply_lora(model, LoraOptions{.targets = {"*.fc"}, .rank = 3, .dropout = 0.5, .seed = seed}));
    EXPECT_TRUE(model.set_trainable(true));  // (every gradient, the dropout's effect on all of them)
    auto store = ParameterStore::create(*ctx_, model, DataType::f64);
    EXPECT_TRUE(store);
    const auto pv = random_values(static_cast<std::size_t>(store->numel()), 9, 0.5);
    EXPECT_TRUE(rt_.block_on(drained()));
    std::copy(pv.begin(), pv.end(), store->values().span<double>().begin());
    const Tensor x = host_tensor(random_values(4 * 6, 10), Shape{4, 6}, DataType::f64);
    for (int pass = 0; pass < 2; ++pass) {  // (the second pass: the next masks)
      auto y = rt_.block_on(ctx_->forward(model, x));
      EXPECT_TRUE(y);
      auto dx = rt_.block_on(ctx_->backward(model, host_tensor(random_values(4 * 6, 11), Shape{4, 6}, DataType::f64)));
      EXPECT_TRUE(dx);
    }
    return read(store->grads());
  };
  const auto plain = gradients(false, 1);
  EXPECT_EQ(gradients(false, 1), plain);
  EXPECT_EQ(gradients(true, 1), plain);
  EXPECT_NE(gradients(false, 2), plain);
}

}  // namespace
}  // namespace coshard::modules
