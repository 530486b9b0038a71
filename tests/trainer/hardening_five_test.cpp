// coshard-train against a hostile user, round five (issue 60): each case as the report gave it,
// asserting the outcome, an exit status below 128, and that nothing the user did not name as an
// output is lost.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "binary_harness.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

// A Llama with LoRA on q and v, 2 steps.
const std::vector<std::string> kLlama = {"--model", "llama", "--layers", "2", "--dim", "32", "--heads", "4",
                                         "--kv-heads", "2", "--seq", "8", "--batch", "4", "--vocab", "48",
                                         "--steps", "2", "--quiet"};
const std::vector<std::string> kLora = {"--lora-rank", "4", "--lora-alpha", "8"};

std::vector<std::string> lora(std::vector<std::string> more) { return with(with(kLlama, kLora), more); }

// A folder's files and their bytes (what a refused run must leave as it was).
std::map<std::string, std::string> contents(const fs::path& folder) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(folder)) out[e.path().filename().string()] = slurp(e.path());
  return out;
}

void refused(const Exit& r, const std::string& expect) {
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(expect), std::string::npos) << "expected: " << expect << "\n" << r.output;
}

// Item 3: the adapter folders are in the up-front path checks, as every other path is: refused by
// name before the first step, the input folder unchanged.
TEST(HardeningFive, AdapterFoldersAreCheckedWithEveryOtherPath) {
  const fs::path dir = scratch("h5_adapter_paths");
  const fs::path peft = dir / "peft";
  const auto made = run(lora({"--export-adapter", peft.string()}), dir);
  ASSERT_EQ(made.code, 0) << made.output;
  const auto before = contents(peft);
  ASSERT_EQ(before.size(), 2u);
  fs::create_directory_symlink(peft, dir / "peft_link");
  const fs::path metrics = dir / "m.jsonl";
  // The export onto the folder read: as given, through a link, through /./.
  for (const std::string& out : {peft.string(), (dir / "peft_link").string(), (dir / "." / "peft").string()}) {
    SCOPED_TRACE(out);
    refused(run(lora({"--adapter", peft.string(), "--export-adapter", out, "--metrics", metrics.string()}), dir),
            "lies inside --export-adapter");
    EXPECT_FALSE(fs::exists(metrics)) << "refused after training";
  }
  EXPECT_EQ(contents(peft), before) << "the adapter folder read was changed";
  // Another output inside the export folder, the same folder as --export, inside --checkpoint-dir.
  refused(run(lora({"--export-adapter", (dir / "out").string(), "--metrics", (dir / "out" / "m.jsonl").string()}), dir),
          "--metrics " + (dir / "out" / "m.jsonl").string() + " lies inside --export-adapter");
  refused(run(lora({"--export-adapter", (dir / "both").string(), "--export", (dir / "both").string()}), dir),
          "is the same folder as");
  refused(run(lora({"--export-adapter", (dir / "ck" / "a").string(), "--checkpoint-dir", (dir / "ck").string()}), dir),
          "lies inside --checkpoint-dir");
  // An empty path, a regular file, a folder that cannot be made.
  refused(run(lora({"--export-adapter", ""}), dir), "--export-adapter");
  std::ofstream(dir / "file") << "mine";
  refused(run(lora({"--export-adapter", (dir / "file").string(), "--metrics", metrics.string()}), dir),
          "--export-adapter " + (dir / "file").string() + ": is a regular file; expected a folder");
  refused(run(lora({"--export-adapter", (dir / "file" / "sub").string(), "--metrics", metrics.string()}), dir),
          "--export-adapter " + (dir / "file" / "sub").string() + ": cannot create the folder");
  EXPECT_EQ(slurp(dir / "file"), "mine");
  EXPECT_FALSE(fs::exists(metrics));
  // An --adapter folder without its weights: named before anything trains.
  fs::create_directory(dir / "half");
  fs::copy_file(peft / "adapter_config.json", dir / "half" / "adapter_config.json");
  const auto half = run(lora({"--adapter", (dir / "half").string()}), dir);
  EXPECT_EQ(half.code, 2) << half.output;
  EXPECT_NE(half.output.find("--adapter " + (dir / "half" / "adapter_model.safetensors").string() + ": no such file"),
            std::string::npos)
      << half.output;
}

// Item 4: an adapter_config.json nested 150,000 deep is refused by name (it killed the run with
// SIGSEGV), whether the folder's settings are read (no --lora-rank) or checked at the load.
TEST(HardeningFive, ADeeplyNestedAdapterConfigIsRefusedByName) {
  const fs::path dir = scratch("h5_deep_peft");
  const fs::path peft = dir / "peft";
  ASSERT_EQ(run(lora({"--export-adapter", peft.string()}), dir).code, 0);
  const std::string deep = std::string(150000, '[') + std::string(150000, ']');
  for (const std::string& key : {"r", "peft_type"}) {
    SCOPED_TRACE(key);
    std::ofstream(peft / "adapter_config.json", std::ios::trunc)
        << "{\"peft_type\": " << (key == "peft_type" ? deep : "\"LORA\"") << ", \"r\": " << (key == "r" ? deep : "4")
        << ", \"lora_alpha\": 8}";
    for (const bool rank_given : {false, true}) {
      const auto r = run(rank_given ? lora({"--adapter", peft.string()}) : with(kLlama, {"--adapter", peft.string()}), dir);
      EXPECT_GT(r.code, 0) << r.output;
      EXPECT_LT(r.code, 128) << r.output;
      EXPECT_NE(r.output.find("JSON nested deeper than 64 levels"), std::string::npos) << r.output.substr(0, 2000);
      EXPECT_LT(r.output.size(), 4000u) << "the value was echoed";
    }
  }
}

// Item 5: the PEFT keys that choose modules are honoured as PEFT honours them: a folder of block
// 1's adapters says so (full names, not the bare projection PEFT would put in every block), reads
// back, and reads back under layers_to_transform and a regular expression; a folder whose keys
// select other modules than its tensors is refused by name.
TEST(HardeningFive, PeftKeysChooseTheModulesAsPeftChoosesThem) {
  const fs::path dir = scratch("h5_peft_keys");
  const fs::path peft = dir / "peft";
  const auto made = run(with(kLlama, {"--lora-rank", "4", "--lora-targets", "model.layers.1.self_attn.q_proj", "--lora-targets",
                                      "layers.1.self_attn.v_proj", "--export-adapter", peft.string()}),
                        dir);
  ASSERT_EQ(made.code, 0) << made.output;
  auto config = nlohmann::json::parse(slurp(peft / "adapter_config.json"));
  EXPECT_EQ(config["target_modules"], nlohmann::json({"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}));
  const std::string weights = slurp(peft / "adapter_model.safetensors");
  EXPECT_NE(weights.find("layers.1.self_attn.q_proj.lora_A"), std::string::npos);
  EXPECT_EQ(weights.find("layers.0."), std::string::npos) << "block 0 has no adapters";
  auto rewrite = [&](const nlohmann::json& changes) {
    auto c = config;
    c.update(changes);
    std::ofstream(peft / "adapter_config.json", std::ios::trunc) << c.dump(1);
  };
  const std::vector<nlohmann::json> same = {
      config,
      {{"target_modules", {"q_proj", "v_proj"}}, {"layers_to_transform", {1}}, {"layers_pattern", "layers"}},
      {{"target_modules", {"q_proj", "v_proj"}}, {"layers_to_transform", 1}},
      {{"target_modules", "model\\.layers\\.1\\.self_attn\\.(q|v)_proj"}},
      {{"target_modules", {"q_proj", "v_proj"}}, {"exclude_modules", {"layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj"}}},
  };
  for (const auto& changes : same) {
    SCOPED_TRACE(changes.dump());
    rewrite(changes);
    const auto r = run(with(kLlama, {"--adapter", peft.string(), "--export-adapter", (dir / "again").string()}), dir);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(nlohmann::json::parse(slurp(dir / "again" / "adapter_config.json"))["target_modules"], config["target_modules"]);
  }
  // Keys that select block 0 (whose tensors the file lacks), or nothing.
  rewrite({{"target_modules", {"q_proj", "v_proj"}}});
  const auto every_block = run(with(kLlama, {"--adapter", peft.string()}), dir);
  EXPECT_NE(every_block.code, 0) << every_block.output;
  EXPECT_LT(every_block.code, 128) << every_block.output;
  EXPECT_NE(every_block.output.find("no tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), std::string::npos)
      << every_block.output;
  rewrite({{"target_modules", {"q_proj", "v_proj"}}, {"layers_to_transform", {0}}});
  const auto other_block = run(with(kLlama, {"--adapter", peft.string()}), dir);
  EXPECT_NE(other_block.code, 0) << other_block.output;
  EXPECT_NE(other_block.output.find("is no adapter of this model"), std::string::npos) << other_block.output;
  rewrite({{"target_modules", "q_proj"}});
  refused(run(with(kLlama, {"--adapter", peft.string()}), dir), "target_modules \"q_proj\" selects no module of this Llama");
}

// Item 6: --lora-alpha against the folder's is refused by name (the adapters were trained at that
// scale); --lora-dropout wins and says so; a LoRA checkpoint resumed with another alpha is refused.
TEST(HardeningFive, ALoraSettingThatDisagreesWithTheFolderOrCheckpointIsNeverTakenSilently) {
  const fs::path dir = scratch("h5_lora_settings");
  const fs::path peft = dir / "peft";
  ASSERT_EQ(run(lora({"--export-adapter", peft.string()}), dir).code, 0);
  refused(run(with(kLlama, {"--adapter", peft.string(), "--lora-alpha", "16"}), dir),
          "--lora-alpha 16 with --adapter " + peft.string() + ", whose adapter_config.json says lora_alpha=8");
  // The folder's own alpha given again: taken.
  EXPECT_EQ(run(with(kLlama, {"--adapter", peft.string(), "--lora-alpha", "8"}), dir).code, 0);
  std::vector<std::string> loud = kLlama;
  loud.pop_back();  // (without --quiet: the note)
  const auto dropout = run(with(loud, {"--adapter", peft.string(), "--lora-dropout", "0.1"}), dir);
  EXPECT_EQ(dropout.code, 0) << dropout.output;
  EXPECT_NE(dropout.output.find("config note: --lora-dropout 0.1 over the folder's lora_dropout 0"), std::string::npos)
      << dropout.output;
  // A checkpoint of alpha 8, resumed at alpha 16.
  const fs::path ck = dir / "ck";
  ASSERT_EQ(run(lora({"--checkpoint-dir", ck.string(), "--checkpoint-every", "2"}), dir).code, 0);
  // (--steps 4: something left to train)
  const auto resumed = run(with(without(kLlama, "--steps"), {"--steps", "4", "--lora-rank", "4", "--lora-alpha", "16",
                                                             "--resume", "--checkpoint-dir", ck.string()}),
                           dir);
  EXPECT_NE(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("LoRA alpha"), std::string::npos) << resumed.output;
}

// Item 7: a manifest whose cut of a fused parameter is not the model's is refused naming both.
TEST(HardeningFive, AManifestThatCutsAFusedParameterOtherwiseIsRefused) {
  const fs::path dir = scratch("h5_false_cut");
  const fs::path ck = dir / "ck";
  const std::vector<std::string> tp = with(kLlama, {"--world-size", "2", "--tensor-parallel", "2", "--checkpoint-dir",
                                                    ck.string(), "--checkpoint-every", "2"});
  ASSERT_EQ(run(tp, dir).code, 0);
  // q, k and v rows of h0's qkv: [32, 16, 16]; the manifests say [16, 32, 16].
  int edited = 0;
  for (const std::string t : {"tensor-0-of-2", "tensor-1-of-2"}) {
    const fs::path manifest = ck / t / "step-00000002" / "manifest.json";
    auto m = nlohmann::json::parse(slurp(manifest));
    for (auto& u : m["units"]) {
      if (!u.contains("splits")) continue;
      for (auto& s : u["splits"])
        if (s.is_object() && s["segments"] == nlohmann::json({32, 16, 16})) {
          s["segments"] = {16, 32, 16};
          ++edited;
        }
    }
    std::ofstream(manifest, std::ios::trunc) << m.dump(1);
  }
  ASSERT_GT(edited, 0) << "no qkv split found in the manifests";
  // (at tensor size 1 the unsplit model knows no cut to compare with: the folders' agreement is all)
  for (const std::string size : {"2"}) {
    SCOPED_TRACE("resumed at tensor size " + size);
    const auto r = run(with(without(kLlama, "--steps"), {"--steps", "4", "--world-size", size, "--tensor-parallel", size,
                                                         "--resume", "--checkpoint-dir", ck.string()}),
                       dir);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_LT(r.code, 128) << r.output;
    EXPECT_NE(r.output.find("was saved split along dimension 0 in segments [16, 32, 16]"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("in segments [32, 16, 16]"), std::string::npos) << r.output;
  }
}

// Item 11: the whole --seed range the command line takes reads back from --print-config's JSON.
TEST(HardeningFive, TheLargestSeedRoundTripsThroughPrintConfig) {
  const fs::path dir = scratch("h5_seed");
  for (const std::string seed : {"4611686018427387905", "18446744073709551615"}) {
    SCOPED_TRACE(seed);
    const auto printed = run(with(kLlama, {"--seed", seed, "--print-config"}), dir);
    ASSERT_EQ(printed.code, 0) << printed.output;
    const auto at = printed.output.find('{');
    ASSERT_NE(at, std::string::npos) << printed.output;
    std::ofstream(dir / "c.json", std::ios::trunc) << printed.output.substr(at);
    const auto again = run(with(kLlama, {"--config", (dir / "c.json").string(), "--print-config"}), dir);
    ASSERT_EQ(again.code, 0) << again.output;
    EXPECT_EQ(again.output, printed.output);
    EXPECT_NE(again.output.find("\"seed\": " + seed), std::string::npos) << again.output;
  }
  // Past the range, in either: refused by name.
  refused(run(with(kLlama, {"--seed", "18446744073709551616"}), dir), "seed");
  std::ofstream(dir / "big.json", std::ios::trunc) << "{\"seed\": 18446744073709551616}";
  const auto big = run(with(kLlama, {"--config", (dir / "big.json").string()}), dir);
  EXPECT_EQ(big.code, 2) << big.output;
  EXPECT_NE(big.output.find("seed"), std::string::npos) << big.output;
}

}  // namespace
