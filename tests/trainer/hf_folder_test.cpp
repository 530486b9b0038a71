// Hugging Face's Llama folders: config.json read and written (the published Llama-3.2-1B config
// among them) and bad ones refused by name; transformers' names and layouts to and from coshard's
// fused ones; a folder written at one world size and stage (single file, or shards with their
// index) loading into another with every bit of every parameter; damaged folders refused before
// anything changes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>

#include "coshard/modules/llama.hpp"
#include "coshard/modules/safetensors_folder.hpp"
#include "coshard/trainer/trainer.hpp"
#include "coshard/zero/hf_llama.hpp"
#include "../support/on_ranks.hpp"

namespace coshard::trainer {
namespace {

namespace fs = std::filesystem;
using modules::LlamaConfig;
using zero::GatheredParameter;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::current_path() / "hf_folder_test_scratch" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// meta-llama/Llama-3.2-1B's config.json as published.
constexpr std::string_view kLlama32Config = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
  "use_cache": true, "vocab_size": 128256})";

TEST(HfLlamaConfig, ReadsThePublishedLlama32ConfigAsItsPreset) {
  auto c = zero::parse_hf_llama_config(kLlama32Config, "config.json");
  ASSERT_TRUE(c) << c.error().message();
  auto preset = modules::llama_preset("Llama-3.2-1B");
  ASSERT_TRUE(preset);
  EXPECT_EQ(c->parameter_count(), preset->config.parameter_count());
  EXPECT_EQ(c->kv_heads, 8);
  EXPECT_EQ(c->resolved_head_dim(), 64);
  EXPECT_TRUE(c->tie_embeddings);
  EXPECT_EQ(c->rope_scaling.factor, 32);
  EXPECT_EQ(c->rope_scaling.original_max_positions, 8192);
  EXPECT_EQ(c->rope_theta, 500000.0);
  // What coshard writes reads back as the same model.
  auto again = zero::parse_hf_llama_config(zero::hf_llama_config_json(*c, modules::DataType::bf16), "written");
  ASSERT_TRUE(again) << again.error().message();
  EXPECT_EQ(zero::hf_llama_config_json(*again, modules::DataType::bf16), zero::hf_llama_config_json(*c, modules::DataType::bf16));
}

TEST(HfLlamaConfig, RefusesWhatCoshardCannotBuildByName) {
  auto with = [](std::string_view key, std::string_view value) {
    std::string text(kLlama32Config);
    const std::string needle = "\"" + std::string(key) + "\": ";
    const auto at = text.find(needle);
    EXPECT_NE(at, std::string::npos) << key;
    const bool object = text[at + needle.size()] == '{';
    const auto end = object ? text.find('}', at) + 1 : text.find_first_of(",}", at + needle.size());
    return text.replace(at + needle.size(), end - at - needle.size(), value);
  };
  const std::pair<std::string, std::string> cases[] = {
      {with("model_type", "\"gpt2\"").replace(0, 0, ""), "model_type \"gpt2\""},
      {with("attention_bias", "true"), "\"attention_bias\"=true"},
      {with("hidden_act", "\"gelu\""), "\"hidden_act\"=\"gelu\""},
      {with("num_key_value_heads", "5"), "kv_heads=5"},
      {with("hidden_size", "\"2048\""), "\"hidden_size\"=\"2048\""},
      {with("rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4.0}"), "rope scaling \"yarn\""},
      {"[1, 2]", "not a JSON object"},
      {"{\"model_type\": \"llama\"}", "\"vocab_size\" is missing"},
  };
  for (const auto& [text, expected] : cases) {
    std::string t = text;
    if (expected == "model_type \"gpt2\"") {  // the architecture would still say Llama
      const auto at = t.find("LlamaForCausalLM");
      t.replace(at, std::string_view("LlamaForCausalLM").size(), "GPT2LMHeadModel");
    }
    auto c = zero::parse_hf_llama_config(t, "config.json");
    ASSERT_FALSE(c) << expected;
    EXPECT_NE(c.error().message().find(expected), std::string::npos) << c.error().message();
  }
}

// Byte patterns that say where each element came from.
std::vector<GatheredParameter> numbered_parameters(const LlamaConfig& c) {
  auto model = modules::make_llama(c);
  EXPECT_TRUE(model);
  std::vector<GatheredParameter> out;
  float next = 1;
  (*model)->for_each_parameter([&](const std::string& name, modules::Parameter& p) {
    std::vector<float> values(static_cast<std::size_t>(p.numel()));
    for (auto& v : values) v = next++;
    const auto* bytes = reinterpret_cast<const std::byte*>(values.data());
    out.push_back({name, p.shape(), std::vector<std::byte>(bytes, bytes + values.size() * 4)});
  });
  return out;
}

TEST(HfLlamaLayout, SplitsAndStacksQkvAndGateUpInTransformersOrder) {
  for (bool tied : {true, false}) {
    const LlamaConfig c{.vocab = 10, .dim = 8, .layers = 2, .heads = 4, .kv_heads = 2, .head_dim = 2,
                        .intermediate = 6, .tie_embeddings = tied};
    const auto params = numbered_parameters(c);
    auto hf = zero::to_hf_llama(c, params, 4);
    ASSERT_TRUE(hf) << hf.error().message();
    std::map<std::string, const GatheredParameter*> by_name;
    for (const auto& t : *hf) by_name[t.name] = &t;
    EXPECT_EQ(by_name.count("lm_head.weight"), tied ? 0u : 1u);
    EXPECT_EQ(by_name.size(), 1 + 2 * 9 + 1 + (tied ? 0 : 1));
    const auto& q = *by_name.at("model.layers.1.self_attn.q_proj.weight");
    const auto& k = *by_name.at("model.layers.1.self_attn.k_proj.weight");
    const auto& v = *by_name.at("model.layers.1.self_attn.v_proj.weight");
    EXPECT_EQ(q.shape, (modules::Shape{8, 8}));
    EXPECT_EQ(k.shape, (modules::Shape{4, 8}));
    EXPECT_EQ(v.shape, (modules::Shape{4, 8}));
    const GatheredParameter* qkv = nullptr;
    for (const auto& p : params)
      if (p.name == "h1.attn.qkv.weight") qkv = &p;
    ASSERT_NE(qkv, nullptr);
    std::vector<std::byte> stacked = q.bytes;
    stacked.insert(stacked.end(), k.bytes.begin(), k.bytes.end());
    stacked.insert(stacked.end(), v.bytes.begin(), v.bytes.end());
    EXPECT_EQ(stacked, qkv->bytes) << "q rows, then k, then v";
    EXPECT_EQ(by_name.at("model.layers.0.mlp.gate_proj.weight")->shape, (modules::Shape{6, 8}));
    EXPECT_EQ(by_name.at("model.layers.0.post_attention_layernorm.weight")->shape, (modules::Shape{8}));
    // And back, bit for bit.
    auto back = zero::from_hf_llama(c, *hf, 4);
    ASSERT_TRUE(back) << back.error().message();
    ASSERT_EQ(back->size(), params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ((*back)[i].name, params[i].name);
      EXPECT_EQ((*back)[i].bytes, params[i].bytes) << params[i].name;
    }
  }
}

TEST(HfLlamaLayout, MissingExtraAndReshapedTensorsAreNamed) {
  const LlamaConfig c{.vocab = 10, .dim = 8, .layers = 1, .heads = 2, .kv_heads = 1, .intermediate = 6,
                      .tie_embeddings = true};
  auto hf = zero::to_hf_llama(c, numbered_parameters(c), 4);
  ASSERT_TRUE(hf);
  auto without = *hf;
  without.erase(without.begin() + 3);
  auto missing = zero::from_hf_llama(c, without, 4);
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message().find((*hf)[3].name + " is missing"), std::string::npos) << missing.error().message();
  auto extra = *hf;
  extra.push_back({"model.layers.7.mlp.up_proj.weight", modules::Shape{6, 8}, std::vector<std::byte>(192)});
  auto refused = zero::from_hf_llama(c, extra, 4);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("model.layers.7.mlp.up_proj.weight is not part"), std::string::npos);
  auto reshaped = *hf;
  reshaped[0].shape = modules::Shape{8, 10};
  auto wrong = zero::from_hf_llama(c, reshaped, 4);
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.error().message().find("model.embed_tokens.weight is [8, 10]"), std::string::npos) << wrong.error().message();
  // A tied model's file may repeat the embedding as lm_head.weight, but not differ from it.
  auto copy = *hf;
  copy.push_back({"lm_head.weight", copy[0].shape, copy[0].bytes});
  EXPECT_TRUE(zero::from_hf_llama(c, copy, 4));
  copy.back().bytes[0] = std::byte{1};
  EXPECT_FALSE(zero::from_hf_llama(c, copy, 4));
}

constexpr LlamaConfig kModel{.vocab = 40, .max_seq = 8, .dim = 32, .layers = 2, .heads = 4, .kv_heads = 2,
                             .head_dim = 8, .intermediate = 48, .rope_theta = 10000.0, .tie_embeddings = true};

TrainerConfig config(int stage, std::uint64_t seed) {
  TrainerConfig c;
  c.zero_stage = stage;
  c.lr = 1e-2f;
  c.seed = seed;
  c.max_live_bytes = 64 << 20;
  return c;
}

// Two steps, then the export; the parameters exported.
std::vector<GatheredParameter> train_and_export(const fs::path& folder, std::size_t max_shard_bytes) {
  static const SyntheticTask task(kModel.vocab, 5);
  std::vector<GatheredParameter> exported;
  std::mutex mutex;
  auto errors = ::coshard::testing::on_ranks(3, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama(kModel));
    TrainerBuilder builder(config(3, 4));
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    for (int i = 0; i < 2; ++i)
      COSHARD_CO_TRY(co_await t.step(task.batch(static_cast<std::uint64_t>(i), 6, 8).rank_rows(rank, 3)));
    modules::SafetensorsFolderOptions options;
    options.max_shard_bytes = max_shard_bytes;
    COSHARD_CO_TRY(co_await zero::export_hf_llama(t.engine(), folder, kModel, std::move(options)));
    COSHARD_CO_TRY_ASSIGN(auto params, co_await t.engine().gather_parameters());
    if (rank == 0) {
      std::lock_guard lock(mutex);
      exported = std::move(params);
    }
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
  return exported;
}

// The folder loaded at world size 2, stage 1; the parameters it then holds (or the error).
Result<std::vector<GatheredParameter>> load_folder(const fs::path& folder) {
  auto read = zero::read_hf_llama_config(folder);
  if (!read) return fail(std::move(read).error());
  const LlamaConfig c = *read;
  std::vector<GatheredParameter> loaded;
  std::mutex mutex;
  auto errors = ::coshard::testing::on_ranks(2, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama(c));
    TrainerBuilder builder(config(1, 99));  // other initial weights, replaced by the folder's
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    COSHARD_CO_TRY_ASSIGN(auto before, co_await t.engine().gather_parameters());
    auto done = co_await zero::load_hf_llama(t.engine(), folder, c);
    COSHARD_CO_TRY_ASSIGN(auto params, co_await t.engine().gather_parameters());
    if (!done) {  // refused: nothing changed
      for (std::size_t i = 0; i < params.size(); ++i)
        if (params[i].bytes != before[i].bytes)
          co_return fail(ErrorCode::internal, "a refused load changed ", params[i].name);
      co_return fail(std::move(done).error());
    }
    if (rank == 0) {
      std::lock_guard lock(mutex);
      loaded = std::move(params);
    }
    co_return Result<void>{};
  });
  if (!errors.empty()) return fail(ErrorCode::invalid_argument, errors.front());
  return loaded;
}

TEST(HfLlamaFolder, RoundTripsSingleAndShardedAtAnotherWorldSizeAndStage) {
  for (std::size_t shard : {std::size_t{1} << 30, std::size_t{8} << 10}) {
    SCOPED_TRACE(shard > (1u << 20) ? "one file" : "shards");
    const fs::path dir = scratch(shard > (1u << 20) ? "single" : "sharded");
    const auto exported = train_and_export(dir, shard);
    ASSERT_FALSE(exported.empty());
    EXPECT_TRUE(fs::exists(dir / "config.json"));
    EXPECT_EQ(fs::exists(dir / "model.safetensors"), shard > (1u << 20));
    EXPECT_EQ(fs::exists(dir / "model.safetensors.index.json"), shard <= (1u << 20));
    auto files = modules::SafetensorsFolder::load(dir);
    ASSERT_TRUE(files) << files.error().message();
    if (shard <= (1u << 20)) EXPECT_GT(files->files().size(), 2u);
    bool has_q = false;
    for (const auto& e : files->tensors()) has_q = has_q || e.info->name == "model.layers.1.self_attn.q_proj.weight";
    EXPECT_TRUE(has_q);
    auto loaded = load_folder(dir);
    ASSERT_TRUE(loaded) << loaded.error().message();
    ASSERT_EQ(loaded->size(), exported.size());
    for (std::size_t i = 0; i < exported.size(); ++i) EXPECT_EQ((*loaded)[i].bytes, exported[i].bytes) << exported[i].name;
  }
  // Exporting the single file over the sharded folder leaves no shard behind to mix with it.
  const fs::path dir = scratch("sharded");
  train_and_export(dir, 8 << 10);
  train_and_export(dir, std::size_t{1} << 30);
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_TRUE(entry.path().filename() == "model.safetensors" || entry.path().filename() == "config.json")
        << entry.path();
}

// A folder holding both model.safetensors and an index with its shards (as some uploads do) is
// read as transformers reads it: model.safetensors, the index ignored.
TEST(HfLlamaFolder, ASingleFileBesideAnIndexIsTheOneRead) {
  const fs::path single = scratch("both_single"), both = scratch("both");
  train_and_export(single, std::size_t{1} << 30);
  train_and_export(both, 8 << 10);
  fs::copy_file(single / "model.safetensors", both / "model.safetensors");
  ASSERT_TRUE(fs::exists(both / "model.safetensors.index.json"));
  auto files = modules::SafetensorsFolder::load(both);
  ASSERT_TRUE(files) << files.error().message();
  ASSERT_EQ(files->files().size(), 1u);
  EXPECT_EQ(files->files().front().filename(), "model.safetensors");
}

TEST(HfLlamaFolder, DamagedFoldersAreRefusedBeforeAnythingChanges) {
  const fs::path dir = scratch("damaged");
  train_and_export(dir, 8 << 10);
  const fs::path index = dir / "model.safetensors.index.json";
  std::string text;
  {
    std::ifstream in(index);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto expect_refused = [&](const std::string& index_text, const std::string& expected) {
    { std::ofstream(index, std::ios::trunc) << index_text; }
    auto r = load_folder(dir);
    ASSERT_FALSE(r) << expected;
    EXPECT_NE(r.error().message().find(expected), std::string::npos) << r.error().message();
  };
  // A shard named that is not there; one outside the folder; a tensor the index sends elsewhere.
  std::string absent = text;
  for (auto at = absent.find("model-00001-of-"); at != std::string::npos; at = absent.find("model-00001-of-"))
    absent.replace(at, 15, "model-00099-of-");
  expect_refused(absent, "model-00099-of-");
  std::string escape = text;
  escape.replace(escape.find("\"model-00002-of-"), 1, "\"../");
  expect_refused(escape, "expected a file name in the index's own folder");
  expect_refused("{\"weight_map\": {}}", "non-empty \"weight_map\"");
  { std::ofstream(index, std::ios::trunc) << text; }
  // A truncated shard.
  auto files = modules::SafetensorsFolder::load(dir);
  ASSERT_TRUE(files) << files.error().message();
  const fs::path shard = files->files().front();
  fs::resize_file(shard, fs::file_size(shard) - 4);
  auto r = load_folder(dir);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find(shard.filename().string()), std::string::npos) << r.error().message();
}

}  // namespace
}  // namespace coshard::trainer
