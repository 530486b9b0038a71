// ParameterStore: seeded initialisation, safetensors round trips, strict loading that refuses
// a mismatched file without touching the parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "coshard/modules/gpt.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "coshard/modules/safetensors.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

namespace fs = std::filesystem;

fs::path temp_path(const std::string& name) {
  fs::path dir = fs::path(::testing::TempDir()) / ("pstore_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

class Store : public testing::ModuleFixture {
 protected:
  GptConfig config{.vocab = 16, .max_seq = 8, .dim = 8, .layers = 1, .heads = 2, .mlp_ratio = 2};

  std::vector<double> values_of(ParameterStore& s) {
    auto v = rt_.block_on(ctx_->read(s.values()));
    EXPECT_TRUE(v);
    return v ? *v : std::vector<double>{};
  }
};

TEST_F(Store, BindsEveryParameterWithGpt2NamesAndCounts) {
  auto model = make_gpt(config);
  ASSERT_TRUE(model);
  auto store = ParameterStore::create(*ctx_, **model, DataType::f32);
  ASSERT_TRUE(store) << store.error().message();
  EXPECT_EQ(store->numel(), config.parameter_count());
  std::vector<std::string> names;
  for (const auto& e : store->entries()) names.push_back(e.name);
  EXPECT_EQ(names.front(), "embed.wte");
  EXPECT_NE(std::find(names.begin(), names.end(), "h0.attn.qkv.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "h0.mlp.proj.bias"), names.end());
  EXPECT_EQ(names.back(), "head.bias");
  (*model)->for_each_parameter([](const std::string& name, Parameter& p) { EXPECT_TRUE(p.bound()) << name; });
}

TEST_F(Store, InitialisationDependsOnlyOnSeedAndName) {
  auto a = make_gpt(config), b = make_gpt(config);
  auto sa = ParameterStore::create(*ctx_, **a, DataType::f32);
  auto sb = ParameterStore::create(*ctx_, **b, DataType::f64);
  ASSERT_TRUE(sa && sb);
  ASSERT_TRUE(rt_.block_on(sa->initialize(*ctx_, 9)));
  ASSERT_TRUE(rt_.block_on(sb->initialize(*ctx_, 9)));
  auto va = values_of(*sa), vb = values_of(*sb);
  ASSERT_EQ(va.size(), vb.size());
  for (std::size_t i = 0; i < va.size(); ++i) ASSERT_EQ(static_cast<float>(vb[i]), static_cast<float>(va[i])) << i;
  // GPT-2 init: LayerNorm gains are ones, biases zeros, weights ~ N(0, 0.02).
  for (const auto& e : sa->entries()) {
    const auto n = static_cast<std::size_t>(e.parameter->numel());
    const auto first = va.begin() + e.offset;
    if (e.name.ends_with("ln.weight") || e.name == "ln_f.weight")
      EXPECT_TRUE(std::all_of(first, first + static_cast<std::ptrdiff_t>(n), [](double x) { return x == 1.0; })) << e.name;
    if (e.name.ends_with("bias"))
      EXPECT_TRUE(std::all_of(first, first + static_cast<std::ptrdiff_t>(n), [](double x) { return x == 0.0; })) << e.name;
    if (e.name == "embed.wte") {
      double sq = 0;
      for (std::size_t i = 0; i < n; ++i) sq += first[static_cast<std::ptrdiff_t>(i)] * first[static_cast<std::ptrdiff_t>(i)];
      EXPECT_NEAR(std::sqrt(sq / static_cast<double>(n)), 0.02, 0.004);
    }
  }
}

TEST_F(Store, SafetensorsRoundTripAcrossDtypes) {
  auto a = make_gpt(config), b = make_gpt(config);
  auto sa = ParameterStore::create(*ctx_, **a, DataType::f32);
  auto sb = ParameterStore::create(*ctx_, **b, DataType::f64);
  ASSERT_TRUE(sa && sb);
  ASSERT_TRUE(rt_.block_on(sa->initialize(*ctx_, 3)));
  const auto path = temp_path("gpt.safetensors");
  auto saved = rt_.block_on(sa->save(*ctx_, path, {{"format", "pt"}}));
  ASSERT_TRUE(saved) << saved.error().message();
  auto file = SafetensorsFile::load(path);
  ASSERT_TRUE(file) << file.error().message();
  EXPECT_EQ(file->tensors().size(), sa->entries().size());
  EXPECT_EQ(file->metadata().at("format"), "pt");
  const auto* wte = file->find("embed.wte");
  ASSERT_NE(wte, nullptr);
  EXPECT_EQ(wte->dtype, SafeDType::f32);
  EXPECT_EQ(wte->shape, (std::vector<std::int64_t>{16, 8}));

  auto loaded = rt_.block_on(sb->load(*ctx_, path));  // F32 file into f64 parameters
  ASSERT_TRUE(loaded) << loaded.error().message();
  EXPECT_EQ(values_of(*sa), values_of(*sb));
}

TEST_F(Store, StrictLoadRefusesMismatchesAndLeavesParametersAlone) {
  auto model = make_gpt(config);
  auto store = ParameterStore::create(*ctx_, **model, DataType::f32);
  ASSERT_TRUE(store);
  ASSERT_TRUE(rt_.block_on(store->initialize(*ctx_, 1)));
  const auto before = values_of(*store);
  const auto path = temp_path("full.safetensors");
  ASSERT_TRUE(rt_.block_on(store->save(*ctx_, path)));
  auto full = SafetensorsFile::load(path);
  ASSERT_TRUE(full);

  // Rewrites the file with one tensor changed (or dropped, or one added).
  auto variant = [&](const std::string& name, auto&& edit) {
    std::vector<SafeTensorView> views;
    for (const auto& t : full->tensors()) views.push_back({t.name, t.dtype, t.shape, full->data(t)});
    edit(views);
    const auto p = temp_path(name);
    EXPECT_TRUE(save_safetensors(p, views));
    return p;
  };
  std::vector<std::byte> extra_bytes(4 * 3);
  const auto missing = variant("missing.safetensors", [](auto& v) { v.erase(v.begin() + 2); });
  const auto extra = variant("extra.safetensors", [&](auto& v) {
    v.push_back({"not.a.parameter", SafeDType::f32, {3}, extra_bytes});
  });
  std::vector<std::byte> wrong_shape_bytes(16 * 4 * 4);
  const auto reshaped = variant("shape.safetensors", [&](auto& v) {
    v[0] = {"embed.wte", SafeDType::f32, {16, 4}, wrong_shape_bytes};
  });
  std::vector<std::byte> int_bytes(16 * 8 * 4);
  const auto ints = variant("dtype.safetensors", [&](auto& v) {
    v[0] = {"embed.wte", SafeDType::i32, {16, 8}, int_bytes};
  });
  struct Case {
    fs::path path;
    std::string expect;
  };
  for (const auto& c : {Case{missing, "is missing"}, Case{extra, "not.a.parameter"}, Case{reshaped, "[16, 4]"},
                        Case{ints, "I32"}, Case{temp_path("absent.safetensors"), "absent"}}) {
    auto r = rt_.block_on(store->load(*ctx_, c.path));
    ASSERT_FALSE(r) << c.path;
    EXPECT_NE(r.error().message().find(c.expect), std::string::npos) << r.error().message();
    EXPECT_EQ(values_of(*store), before) << c.path;
  }
}

TEST_F(Store, UnboundModelsAndBadTokensFailWithClearErrors) {
  auto model = make_gpt(config);
  ASSERT_TRUE(model);
  Tensor t = tokens({1, 2, 3, 4}, Shape{1, 4});
  auto unbound = rt_.block_on(ctx_->forward(**model, t));
  ASSERT_FALSE(unbound);
  EXPECT_NE(unbound.error().message().find("not bound"), std::string::npos) << unbound.error().message();

  auto store = ParameterStore::create(*ctx_, **model, DataType::f32);
  ASSERT_TRUE(store);
  ASSERT_TRUE(rt_.block_on(store->initialize(*ctx_, 1)));
  // Sequence longer than max_seq.
  auto too_long = rt_.block_on(ctx_->forward(**model, tokens(std::vector<int>(9, 1), Shape{1, 9})));
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.error().message().find("max_positions 8"), std::string::npos) << too_long.error().message();
}

TEST_F(Store, ATokenOutsideTheVocabularyFailsTheStreamNotTheProcess) {
  async::Runtime rt;
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "bad-tokens"});
  ASSERT_TRUE(stream);
  auto ctx = Context::create(*stream, *allocator_);
  ASSERT_TRUE(ctx);
  auto model = make_gpt(config);
  auto store = ParameterStore::create(*ctx, **model, DataType::f32);
  ASSERT_TRUE(store);
  auto body = [&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY(co_await store->initialize(*ctx, 1));
    const std::vector<double> ids{1, 99, 2, 3};
    auto bytes = encode_values(ids, DataType::i32);
    COSHARD_CO_TRY_ASSIGN(Tensor t, ctx->upload(bytes, Shape{1, 4}, DataType::i32));
    COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx->forward(**model, t));
    COSHARD_CO_TRY_ASSIGN(auto done, stream->record());
    co_return co_await done;
  };
  auto r = rt.block_on(body());
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("tokens[1]=99"), std::string::npos) << r.error().message();
  EXPECT_NE(r.error().message().find("[0, 16)"), std::string::npos) << r.error().message();
}

}  // namespace
}  // namespace coshard::modules
