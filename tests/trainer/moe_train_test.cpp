// coshard-train with mixture-of-experts models (#62), the user's path: a Qwen3-MoE and a Mixtral
// Hugging Face folder fine-tuned with --init at world 2, ZeRO-3, offload and accumulation, the
// load-balancing loss on, exported, and the export read back bit for bit; the step metrics of the
// routing; a resume continuing the uninterrupted run; LoRA on the attention of a MoE model leaving
// the experts as they were, and on the experts through a PEFT folder; bad folders and flags refused
// by name before anything runs.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "binary_harness.hpp"

namespace coshard::testing {
namespace {

std::vector<nlohmann::json> lines(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string line;
  std::vector<nlohmann::json> out;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// A folder a user starts from: the preset's model exported as Hugging Face's, nothing trained.
fs::path make_folder(const fs::path& dir, const std::string& preset) {
  const auto made = run({"--model", "llama", "--preset", preset, "--world-size", "1", "--seq", "16", "--batch", "2",
                         "--steps", "1", "--lr", "1e-30", "--seed", "5", "--quiet", "--export", (dir / preset).string()},
                        dir);
  EXPECT_EQ(made.code, 0) << made.output;
  return dir / preset;
}

std::vector<std::string> from(const fs::path& folder, const std::string& steps) {
  return {"--init", folder.string(), "--seq", "16", "--batch", "8", "--lr", "0.003", "--steps", steps, "--world-size", "2"};
}

TEST(CoshardTrainMoe, FoldersFineTuneExportAndReadBackBitForBit) {
  const fs::path dir = scratch("moe_folders");
  for (const std::string preset : {"qwen3-moe-tiny", "mixtral-tiny"}) {
    const fs::path base = make_folder(dir, preset);
    auto config = nlohmann::json::parse(slurp(base / "config.json"));
    EXPECT_EQ(config["model_type"], preset == "mixtral-tiny" ? "mixtral" : "qwen3_moe") << config.dump();
    // Keys coshard does not model, and the loss's weight while output_router_logits is false, as
    // a published folder has them: an export carries them through.
    config["bos_token_id"] = 1;
    config["eos_token_id"] = 2;
    config["use_cache"] = false;
    config["max_window_layers"] = 28;
    config["router_aux_loss_coef"] = 0.02;
    std::ofstream(base / "config.json") << config.dump(2);
    const fs::path metrics = dir / (preset + ".jsonl"), tuned = dir / (preset + "_tuned");
    const auto trained = run(with(from(base, "6"), {"--router-aux-loss-coef", "0.01", "--grad-accum", "2",
                                                    "--offload-optimizer", "cpu", "--metrics", metrics.string(),
                                                    "--export", tuned.string()}),
                             dir);
    ASSERT_EQ(trained.code, 0) << trained.output;
    EXPECT_NE(trained.output.find("mixture of experts:"), std::string::npos) << trained.output;
    EXPECT_NE(trained.output.find("load-balancing loss x 0.01"), std::string::npos) << trained.output;
    const auto steps = lines(metrics);
    ASSERT_EQ(steps.size(), 6u);
    EXPECT_LT(steps.back()["loss"].get<double>(), steps.front()["loss"].get<double>()) << preset << ": nothing learned";
    const int experts = preset == "mixtral-tiny" ? 4 : 8;
    for (const auto& s : steps) {
      // Top 2: the pooled loss is near 2 for a balanced router (transformers' formula), never 0.
      EXPECT_GT(s["aux_loss"].get<double>(), 1.0) << s.dump();
      EXPECT_LT(s["aux_loss"].get<double>(), static_cast<double>(experts)) << s.dump();
      ASSERT_EQ(s["experts_used"].size(), 2u) << s.dump();
      for (const auto& used : s["experts_used"]) EXPECT_TRUE(used.get<int>() >= 2 && used.get<int>() <= experts) << s.dump();
      for (const auto& share : s["largest_expert_share"]) {
        EXPECT_GE(share.get<double>(), 1.0 / experts) << s.dump();
        EXPECT_LE(share.get<double>(), 1.0) << s.dump();
      }
    }
    // Read back: a step at lr 1e-30 changes nothing in f32, so its export is the same file.
    const fs::path again = dir / (preset + "_again");
    const auto read = run({"--init", tuned.string(), "--seq", "16", "--batch", "2", "--lr", "1e-30", "--steps", "1",
                           "--world-size", "2", "--quiet", "--export", again.string()},
                          dir);
    ASSERT_EQ(read.code, 0) << read.output;
    EXPECT_EQ(slurp(tuned / "model.safetensors"), slurp(again / "model.safetensors")) << preset;
    const auto written = nlohmann::json::parse(slurp(tuned / "config.json"));
    EXPECT_EQ(written, nlohmann::json::parse(slurp(again / "config.json")));
    for (const char* key : {"bos_token_id", "eos_token_id", "use_cache", "max_window_layers"})
      EXPECT_EQ(written[key], config[key]) << preset << ": " << key;
    EXPECT_EQ(written["router_aux_loss_coef"], 0.01) << "the run's weight (--router-aux-loss-coef 0.01)";
    EXPECT_EQ(written["output_router_logits"], true);
    EXPECT_NE(slurp(base / "model.safetensors"), slurp(tuned / "model.safetensors")) << preset << ": nothing trained";
  }
}

// --expert-parallel from a folder: each layer's 8 experts over 2 or 4 of 4 ranks train the data-
// parallel run's losses; each export holds every expert and reads back bit for bit at another size.
TEST(CoshardTrainMoe, ExpertParallelRanksTrainTheDataParallelRunFromAFolder) {
  const fs::path dir = scratch("moe_expert_parallel");
  const fs::path base = make_folder(dir, "qwen3-moe-tiny");
  // SGD: AdamW would magnify the rounding of gradients that nearly cancel (the rows reach each
  // expert in another order) and hide a wrong scale of the experts' gradients.
  std::ofstream(dir / "sgd.json") << R"({"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}})";
  std::map<int, std::vector<double>> losses;
  std::map<int, std::string> samples;  // (the key/value cache's passes route as training's)
  for (const int ep : {1, 2, 4}) {
    const std::string tag = "ep" + std::to_string(ep);
    const auto trained = run({"--init", base.string(), "--config", (dir / "sgd.json").string(), "--seq", "16", "--batch",
                              "8", "--steps", "4",
                              "--world-size", "4", "--zero-stage", "3", "--router-aux-loss-coef", "0.01",
                              "--expert-parallel", std::to_string(ep), "--metrics", (dir / (tag + ".jsonl")).string(),
                              "--export", (dir / tag).string(), "--sample-every", "4", "--sample-tokens", "6"},
                             dir);
    ASSERT_EQ(trained.code, 0) << trained.output;
    const auto sample = trained.output.find("sample after step 4");
    ASSERT_NE(sample, std::string::npos) << trained.output;
    samples[ep] = trained.output.substr(sample, trained.output.find('\n', sample) - sample);
    if (ep > 1)
      EXPECT_NE(trained.output.find("expert parallel: each layer's experts over " + std::to_string(ep) + " ranks"),
                std::string::npos) << trained.output;
    losses[ep] = losses_in(dir / (tag + ".jsonl"));
  }
  for (const int ep : {2, 4}) {
    EXPECT_EQ(samples[ep], samples[1]);
    ASSERT_EQ(losses[ep].size(), losses[1].size());
    for (std::size_t i = 0; i < losses[1].size(); ++i)
      EXPECT_NEAR(losses[ep][i], losses[1][i], 1e-6 * std::abs(losses[1][i])) << "--expert-parallel " << ep << ", step " << i;
  }
  // A checkpoint at 2 resumed at 4 and at 1: the uninterrupted run's losses.
  const std::vector<std::string> job = {"--init", base.string(), "--config", (dir / "sgd.json").string(), "--seq", "16",
                                        "--batch", "8", "--world-size", "4", "--zero-stage", "3",
                                        "--router-aux-loss-coef", "0.01", "--checkpoint-dir", (dir / "ckpt").string()};
  const auto first = run(with(job, {"--steps", "2", "--checkpoint-every", "2", "--expert-parallel", "2"}), dir);
  ASSERT_EQ(first.code, 0) << first.output;
  for (const int ep : {4, 1}) {
    const fs::path metrics = dir / ("resumed" + std::to_string(ep) + ".jsonl");
    const auto rest = run(with(job, {"--steps", "4", "--resume", "--expert-parallel", std::to_string(ep), "--metrics",
                                     metrics.string()}),
                          dir);
    ASSERT_EQ(rest.code, 0) << rest.output;
    const auto resumed = losses_in(metrics);
    ASSERT_EQ(resumed.size(), 2u);
    for (std::size_t i = 0; i < 2; ++i)
      EXPECT_NEAR(resumed[i], losses[1][i + 2], 1e-6 * std::abs(losses[1][i + 2])) << "resumed at " << ep << ", step " << i + 3;
  }
  // The export at 2 read back at 1 (every expert on every rank) and exported again: the same file.
  const auto read = run({"--init", (dir / "ep2").string(), "--seq", "16", "--batch", "4", "--lr", "1e-30", "--steps",
                         "1", "--world-size", "2", "--quiet", "--export", (dir / "again").string()},
                        dir);
  ASSERT_EQ(read.code, 0) << read.output;
  EXPECT_EQ(slurp(dir / "ep2" / "model.safetensors"), slurp(dir / "again" / "model.safetensors"));
}

TEST(CoshardTrainMoe, ExpertParallelSettingsItCannotTakeAreRefusedByName) {
  const fs::path dir = scratch("moe_expert_parallel_refusals");
  auto refused = [&](std::vector<std::string> args, const std::string& expected) {
    const auto r = run(with({"--model", "llama", "--seq", "16", "--batch", "8", "--steps", "1"}, args), dir);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
  };
  refused({"--preset", "qwen3-moe-tiny", "--world-size", "4", "--expert-parallel", "3"},
          "--expert-parallel 3 does not divide the 4 data-parallel ranks");
  refused({"--preset", "llama-tiny", "--world-size", "2", "--expert-parallel", "2"}, "the model has no experts");
  refused({"--preset", "mixtral-tiny", "--world-size", "8", "--expert-parallel", "8"},
          "expert-parallel size 8 does not divide the experts (4)");
  refused({"--preset", "qwen3-moe-tiny", "--world-size", "4", "--expert-parallel", "2", "--tensor-parallel", "2"},
          "expert and tensor parallelism are not combined yet");
}

// LoRA on every expert and --freeze of every expert's projection under --expert-parallel train as
// without it, the adapter folder holding every expert's adapters; a pattern of some experts is
// refused by name (each expert rank holds other experts in the same places).
TEST(CoshardTrainMoe, ExpertParallelLoraAndFreezeSelectEveryExpertOrNone) {
  const fs::path dir = scratch("moe_expert_parallel_lora");
  const fs::path base = make_folder(dir, "qwen3-moe-tiny");
  std::ofstream(dir / "sgd.json") << R"({"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}})";
  const std::vector<std::string> job = {"--init", base.string(), "--config", (dir / "sgd.json").string(), "--seq", "16",
                                        "--batch", "8", "--steps", "3", "--world-size", "4", "--zero-stage", "3"};
  std::map<int, std::vector<double>> lora, frozen;
  for (const int ep : {1, 2}) {
    const std::string tag = std::to_string(ep);
    const auto adapted = run(with(job, {"--expert-parallel", tag, "--lora-rank", "4", "--lora-targets", "gate_proj",
                                        "down_proj", "--metrics", (dir / ("lora" + tag + ".jsonl")).string(),
                                        "--export-adapter", (dir / ("adapter" + tag)).string()}),
                             dir);
    ASSERT_EQ(adapted.code, 0) << adapted.output;
    lora[ep] = losses_in(dir / ("lora" + tag + ".jsonl"));
    const auto still = run(with(job, {"--expert-parallel", tag, "--freeze", "h*.mlp.moe.experts.*.down.*", "--metrics",
                                      (dir / ("freeze" + tag + ".jsonl")).string()}),
                           dir);
    ASSERT_EQ(still.code, 0) << still.output;
    frozen[ep] = losses_in(dir / ("freeze" + tag + ".jsonl"));
  }
  for (std::size_t i = 0; i < lora[1].size(); ++i) {
    EXPECT_NEAR(lora[2][i], lora[1][i], 1e-6 * std::abs(lora[1][i])) << "LoRA, step " << i + 1;
    EXPECT_NEAR(frozen[2][i], frozen[1][i], 1e-6 * std::abs(frozen[1][i])) << "freeze, step " << i + 1;
  }
  EXPECT_NE(slurp(dir / "adapter2" / "adapter_model.safetensors").find("experts.7.down_proj"), std::string::npos)
      << "the adapter folder lacks the other expert rank's adapters";
  // The expert-parallel run's adapters read back at 1 and at 2.
  for (const char* ep : {"1", "2"}) {
    const auto read = run({"--init", base.string(), "--world-size", "4", "--seq", "16", "--batch", "8", "--steps", "0",
                           "--prompt-ids", "1,2,3", "--sample-tokens", "4", "--expert-parallel", ep, "--adapter",
                           (dir / "adapter2").string()},
                          dir);
    EXPECT_EQ(read.code, 0) << read.output;
  }
  auto refused = [&](std::vector<std::string> args, const std::string& expected) {
    const auto r = run(with(job, args), dir);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
  };
  refused({"--expert-parallel", "2", "--freeze", "h0.mlp.moe.experts.5.*"}, "must select every expert of a layer or none");
  refused({"--expert-parallel", "2", "--lora-rank", "4", "--lora-targets", "model.layers.0.mlp.experts.5.gate_proj"},
          "adapt every expert of a layer or none");
}

TEST(CoshardTrainMoe, AResumeContinuesTheUninterruptedRun) {
  const fs::path dir = scratch("moe_resume");
  const std::vector<std::string> job = {"--model", "llama", "--preset", "qwen3-moe-tiny", "--seq", "16", "--batch", "4",
                                        "--world-size", "2", "--router-aux-loss-coef", "0.01", "--checkpoint-dir",
                                        (dir / "ckpt").string(), "--checkpoint-every", "2"};
  const auto whole = run(with(job, {"--steps", "4", "--metrics", (dir / "whole.jsonl").string()}), dir);
  ASSERT_EQ(whole.code, 0) << whole.output;
  fs::remove_all(dir / "ckpt");
  const auto first = run(with(job, {"--steps", "2", "--metrics", (dir / "first.jsonl").string()}), dir);
  ASSERT_EQ(first.code, 0) << first.output;
  const auto rest = run(with(job, {"--steps", "4", "--resume", "--metrics", (dir / "rest.jsonl").string()}), dir);
  ASSERT_EQ(rest.code, 0) << rest.output;
  auto got = losses_in(dir / "first.jsonl");
  const auto more = losses_in(dir / "rest.jsonl");
  got.insert(got.end(), more.begin(), more.end());
  EXPECT_EQ(got, losses_in(dir / "whole.jsonl"));
  // Another load-balancing weight trains another objective: refused, naming both.
  std::vector<std::string> other = job;
  other[other.size() - 5] = "0.05";  // (--router-aux-loss-coef's value)
  ASSERT_EQ(job[job.size() - 6], "--router-aux-loss-coef");
  const auto changed = run(with(other, {"--steps", "5", "--resume"}), dir);
  EXPECT_NE(changed.code, 0) << changed.output;
  EXPECT_NE(changed.output.find("router_aux_loss_coef 0.01"), std::string::npos) << changed.output;
  EXPECT_NE(changed.output.find("router_aux_loss_coef 0.05"), std::string::npos) << changed.output;
}

// A folder of a vocabulary below the synthetic task's 256 trains on the task within it.
TEST(CoshardTrainMoe, AFolderOfASmallVocabularyTrainsOnTheSyntheticTask) {
  const fs::path dir = scratch("moe_small_vocabulary");
  const auto made = run({"--model", "llama", "--preset", "qwen3-moe-tiny", "--vocab", "32", "--steps", "1", "--quiet",
                         "--export", (dir / "v32").string()},
                        dir);
  ASSERT_EQ(made.code, 0) << made.output;
  const auto trained = run({"--init", (dir / "v32").string(), "--steps", "2", "--seq", "16", "--batch", "2", "--prompt-ids",
                            "1,2", "--sample-tokens", "4"},
                           dir);
  EXPECT_EQ(trained.code, 0) << trained.output;
}

TEST(CoshardTrainMoe, LoraOnTheAttentionLeavesTheExpertsAsTheyWere) {
  const fs::path dir = scratch("moe_lora");
  const fs::path base = make_folder(dir, "mixtral-tiny");
  const auto tuned = run(with(from(base, "3"), {"--lora-rank", "4", "--export", (dir / "merged").string()}), dir);
  ASSERT_EQ(tuned.code, 0) << tuned.output;
  // The merged export: the adapted q and v projections changed, every expert and router kept.
  const auto read = [](const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    std::uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    in.read(header.data(), static_cast<std::streamsize>(n));
    const std::string data{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    std::map<std::string, std::string> out;
    const auto parsed = nlohmann::json::parse(header);  // (named: items() of a temporary dangles)
    for (const auto& [name, t] : parsed.items()) {
      if (name == "__metadata__") continue;
      const auto b = t["data_offsets"][0].get<std::size_t>(), e = t["data_offsets"][1].get<std::size_t>();
      out[name] = data.substr(b, e - b);
    }
    return out;
  };
  const auto before = read(base / "model.safetensors"), after = read(dir / "merged" / "model.safetensors");
  ASSERT_EQ(before.size(), after.size());
  int changed = 0;
  for (const auto& [name, bytes] : before) {
    const bool adapted = name.find("q_proj") != std::string::npos || name.find("v_proj") != std::string::npos;
    EXPECT_EQ(after.at(name) != bytes, adapted) << name;
    changed += after.at(name) != bytes ? 1 : 0;
  }
  EXPECT_EQ(changed, 4);  // q and v of 2 layers
  // Adapters on the experts, by transformers' names (Mixtral's w1) and by path (their down): a PEFT
  // folder names them as transformers does, and --adapter alone reads it back: the merged model
  // it gives is the first run's, bit for bit.
  const auto experts = run(with(from(base, "2"), {"--lora-rank", "4", "--lora-targets", "w1", "--lora-targets",
                                                  "h*.mlp.moe.experts.*.down", "--export-adapter",
                                                  (dir / "experts_adapter").string(), "--export", (dir / "experts_merged").string()}),
                           dir);
  ASSERT_EQ(experts.code, 0) << experts.output;
  const auto adapter_config = nlohmann::json::parse(slurp(dir / "experts_adapter" / "adapter_config.json"));
  EXPECT_EQ(adapter_config["target_modules"], (nlohmann::json{"w1", "w2"})) << adapter_config.dump();
  const auto merged_again = run({"--init", base.string(), "--adapter", (dir / "experts_adapter").string(), "--seq", "16",
                                 "--batch", "2", "--lr", "1e-30", "--steps", "1", "--quiet", "--export",
                                 (dir / "experts_merged_again").string()},
                                dir);
  ASSERT_EQ(merged_again.code, 0) << merged_again.output;
  EXPECT_EQ(slurp(dir / "experts_merged" / "model.safetensors"), slurp(dir / "experts_merged_again" / "model.safetensors"));
  EXPECT_NE(slurp(dir / "experts_merged" / "model.safetensors"), slurp(base / "model.safetensors"));
  // One transformers has no name for (the router, by path): refused before training, writing nothing.
  const auto router = run(with(from(base, "2"), {"--lora-rank", "4", "--lora-targets", "h*.mlp.moe.router",
                                                 "--export-adapter", (dir / "router_adapter").string()}),
                          dir);
  EXPECT_NE(router.code, 0) << router.output;
  EXPECT_NE(router.output.find("h0.mlp.moe.router has no module of transformers'"), std::string::npos) << router.output;
  EXPECT_EQ(router.output.find("step 1"), std::string::npos) << router.output;
  // (the run's output folders are made, empty, when the paths are checked at start)
  EXPECT_TRUE(!fs::exists(dir / "router_adapter") || fs::is_empty(dir / "router_adapter"));
}

TEST(CoshardTrainMoe, BadFoldersAndFlagsAreRefusedByName) {
  const fs::path dir = scratch("moe_refusals");
  const fs::path base = make_folder(dir, "qwen3-moe-tiny");
  const auto config = nlohmann::json::parse(slurp(base / "config.json"));
  auto refused = [&](const std::string& name, nlohmann::json changed, const std::string& expected) {
    const fs::path folder = dir / name;
    fs::create_directories(folder);
    fs::copy_file(base / "model.safetensors", folder / "model.safetensors", fs::copy_options::overwrite_existing);
    std::ofstream(folder / "config.json") << changed.dump();
    const auto r = run(from(folder, "1"), dir);
    EXPECT_NE(r.code, 0) << name << ": " << r.output;
    EXPECT_EQ(r.output.find("step 1"), std::string::npos) << name << ": trained: " << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << name << ": " << r.output;
  };
  auto c = config;
  c["num_experts_per_tok"] = 0;
  refused("top0", c, "top_k=0");
  c = config;
  c["num_experts_per_tok"] = 9;
  refused("top9", c, "top_k=9");
  c = config;
  c["mlp_only_layers"] = {5};
  refused("dense5", c, "layer 5");
  c = config;
  c["num_experts"] = 0;
  refused("experts0", c, "has experts");
  c = config;
  c["num_experts"] = 7;  // the file holds 8 experts: the eighth is extra
  refused("experts7", c, "mlp.gate.weight is [8, 64] (expected [7, 64] for the config's Qwen3-MoE)");
  c = config;
  c["num_experts"] = 9;  // one missing
  refused("experts9", c, "mlp.gate.weight is [8, 64] (expected [9, 64]");
  c = config;
  c["moe_intermediate_size"] = 16;  // the router is right, the experts' matrices are not
  refused("width16", c, "experts.0.gate_proj.weight is [32, 64] (expected [16, 64]");
  c = config;
  c["use_sliding_window"] = true;
  refused("sliding", c, "use_sliding_window");
  c = config;
  c["num_experts"] = 4;
  c.erase("num_experts_per_tok");
  refused("no_top_k", c, "\"num_experts_per_tok\" is missing, and transformers' default 8 exceeds the 4 experts");
  const auto width = run({"--model", "llama", "--preset", "mixtral-tiny", "--expert-width", "16", "--steps", "1"}, dir);
  EXPECT_EQ(width.code, 2);
  EXPECT_NE(width.output.find("a Mixtral's experts have the MLP's width, intermediate=64"), std::string::npos)
      << width.output;
  const auto dense = run({"--model", "llama", "--preset", "llama-tiny", "--router-aux-loss-coef", "0.1", "--steps", "1"}, dir);
  EXPECT_EQ(dense.code, 2);
  EXPECT_NE(dense.output.find("has no experts"), std::string::npos) << dense.output;
  const auto tp = run(with(from(base, "1"), {"--tensor-parallel", "2"}), dir);
  EXPECT_EQ(tp.code, 2);
  EXPECT_NE(tp.output.find("not split over tensor ranks"), std::string::npos) << tp.output;
}

}  // namespace
}  // namespace coshard::testing
