// coshard-train with LoRA (--lora-rank): every stage, world size, offload, hybrid sharding,
// activation checkpointing and accumulation against the unsharded single-rank run of the same
// adapted Llama: the losses and the adapters within 1e-6 relative (absolute below 1, as the
// engine's semantics tests), the base bit for bit its initial values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "binary_harness.hpp"
#include "support/sanitizers.hpp"
#include "safetensors_values.hpp"

namespace coshard::testing {
namespace {

// A Llama of 2 blocks with grouped-query attention, adapters on q, v and the MLP's projections
// (q_proj and v_proj on the fused qkv's rows; gate_proj and up_proj on gate_up's; down_proj).
const std::vector<std::string> kLlama = {"--model", "llama", "--layers", "2", "--dim", "32", "--heads", "4",
                                         "--kv-heads", "2", "--seq", "8", "--batch", "12", "--vocab", "48",
                                         "--lr", "0.005", "--clip", "0", "--steps", "12", "--quiet"};
const std::vector<std::string> kLora = {"--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj",
                                        "--lora-targets", "v_proj", "--lora-targets", "*.mlp.*"};

// The same with the synthetic task's vocabulary of 256, which a model read from a Hugging Face folder
// (--init) trains on.
std::vector<std::string> llama_of_vocab_256() {
  std::vector<std::string> args = kLlama;
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--vocab") args[i + 1] = "256";
  return args;
}

bool is_adapter(const std::string& name) { return name.find(".lora_") != std::string::npos; }

TEST(CoshardTrainLora, EveryLayoutTrainsTheAdaptersOfTheUnshardedRunAndLeavesTheBase) {
  const fs::path dir = scratch("lora_layouts");
  // The initial weights: every parameter frozen, no adapters.
  const auto initial = run(with(kLlama, {"--world-size", "1", "--freeze", "*", "--export", (dir / "initial.safetensors").string()}), dir);
  ASSERT_EQ(initial.code, 0) << initial.output;
  auto adapted = [&](std::vector<std::string> args) {
    args.insert(args.begin(), kLora.begin(), kLora.end());
    return with(kLlama, args);
  };
  const auto reference = run(adapted({"--world-size", "1", "--zero-stage", "0", "--metrics", (dir / "ref.jsonl").string(),
                                      "--export", (dir / "ref.safetensors").string()}),
                             dir);
  ASSERT_EQ(reference.code, 0) << reference.output;
  const auto base = tensors_in(dir / "initial.safetensors"), ref = tensors_in(dir / "ref.safetensors");
  const auto ref_losses = losses_in(dir / "ref.jsonl");
  ASSERT_EQ(ref_losses.size(), 12u);
  // (each step draws another batch: the first three steps' mean against the last three's)
  EXPECT_LT(ref_losses[9] + ref_losses[10] + ref_losses[11], ref_losses[0] + ref_losses[1] + ref_losses[2])
      << "the adapters learn";
  int adapters = 0;
  for (const auto& [name, values] : ref) {
    if (is_adapter(name)) {
      ++adapters;
      continue;
    }
    EXPECT_EQ(values, base.at(name)) << name << " moved in the reference";
  }
  EXPECT_EQ(adapters, 2 * 2 * 5) << "A and B of q, v, gate, up and down in each of 2 blocks";

  const std::vector<std::pair<std::string, std::vector<std::string>>> layouts = {
      {"world 2, stage 0", {"--world-size", "2", "--zero-stage", "0"}},
      {"world 2, stage 1", {"--world-size", "2", "--zero-stage", "1"}},
      {"world 2, stage 2", {"--world-size", "2", "--zero-stage", "2"}},
      {"world 3, stage 0", {"--world-size", "3", "--zero-stage", "0"}},
      {"world 3, stage 3", {"--world-size", "3", "--zero-stage", "3"}},
      {"world 2, stage 3, optimizer on cpu", {"--world-size", "2", "--zero-stage", "3", "--offload-optimizer", "cpu"}},
      {"world 2, stage 2, optimizer on nvme, stepped in backward",
       {"--world-size", "2", "--zero-stage", "2", "--offload-optimizer", "nvme:" + (dir / "swap").string(), "--step-in-backward"}},
      {"world 2, stage 3, parameters and optimizer on cpu",
       {"--world-size", "2", "--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu"}},
      {"world 2, stage 3, activation checkpointing", {"--world-size", "2", "--zero-stage", "3", "--activation-checkpointing", "full"}},
      {"world 2, stage 3, 2 micro-batches", {"--world-size", "2", "--zero-stage", "3", "--grad-accum", "2"}},
      {"world 2, stage 3, hybrid sharding", {"--world-size", "2", "--zero-stage", "3", "--shard-group-size", "1"}},
  };
  for (std::size_t n = 0; n < layouts.size(); ++n) {
    const auto& [label, flags] = layouts[n];
    // Under a sanitizer every other layout (each run takes seconds there): the others' paths run
    // under it in the engine's own tests.
    if (kSanitized && n % 2 == 1) continue;
    SCOPED_TRACE(label);
    fs::remove_all(dir / "swap");
    std::vector<std::string> args = flags;
    args.insert(args.end(), {"--metrics", (dir / "run.jsonl").string(), "--export", (dir / "run.safetensors").string()});
    const auto r = run(adapted(args), dir);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto losses = losses_in(dir / "run.jsonl");
    ASSERT_EQ(losses.size(), ref_losses.size());
    for (std::size_t i = 0; i < losses.size(); ++i)
      EXPECT_NEAR(losses[i], ref_losses[i], 1e-6 * std::abs(ref_losses[i])) << "step " << i + 1;
    const auto got = tensors_in(dir / "run.safetensors");
    ASSERT_EQ(got.size(), ref.size());
    for (const auto& [name, values] : got) {
      if (!is_adapter(name)) {
        EXPECT_EQ(values, base.at(name)) << name << " moved although frozen";
        continue;
      }
      const auto& want = ref.at(name);
      ASSERT_EQ(values.size(), want.size()) << name;
      // (as the engine's semantics tests: 1e-6 relative, absolute below 1)
      for (std::size_t i = 0; i < values.size(); ++i)
        if (std::abs(values[i] - want[i]) > 1e-6 * std::max(1.0f, std::abs(want[i]))) {
          ADD_FAILURE() << name << "[" << i << "]: " << values[i] << ", the reference's " << want[i];
          break;
        }
    }
  }
}

// Stage 3 with 4 micro-batches: the frozen base is gathered once a step (kept for the other
// micro-batches and backward), not at each use as --regather-frozen does, with the same bits.
TEST(CoshardTrainLora, TheFrozenBaseIsGatheredOnceAStep) {
  const fs::path dir = scratch("lora_gathers");
  auto gathers = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = kLlama;  // (16 rows, 2 steps)
    for (std::size_t i = 0; i + 1 < args.size(); ++i) {
      if (args[i] == "--batch") args[i + 1] = "16";
      if (args[i] == "--steps") args[i + 1] = "2";
    }
    args.insert(args.end(), kLora.begin(), kLora.end());
    for (const std::string& a : {"--world-size", "2", "--zero-stage", "3", "--grad-accum", "4"}) args.push_back(a);
    args.push_back("--metrics");
    args.push_back((dir / "m.jsonl").string());
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = run(args, dir);
    EXPECT_EQ(r.code, 0) << r.output;
    std::vector<std::pair<double, std::int64_t>> steps;  // loss, gathered bytes
    std::ifstream in(dir / "m.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      steps.emplace_back(j["loss"].get<double>(), j["gathered_bytes"].get<std::int64_t>());
    }
    return steps;
  };
  const auto kept = gathers({}), again = gathers({"--regather-frozen"});
  ASSERT_EQ(kept.size(), 2u);
  ASSERT_EQ(again.size(), 2u);
  for (std::size_t i = 0; i < kept.size(); ++i) {
    EXPECT_EQ(kept[i].first, again[i].first) << "step " << i + 1;
    // Each use of a unit is a gather without keeping: 4 forwards and 4 backwards.
    EXPECT_LT(4 * kept[i].second, again[i].second) << "step " << i + 1;
  }
  RecordProperty("gathered_bytes_per_step", std::to_string(kept[0].second) + " kept, " + std::to_string(again[0].second) +
                                                " regathered");
}

// The adapters as a PEFT folder and the merged model as a Hugging Face folder: the merged q_proj,
// gate_proj, up_proj and down_proj are the initial base plus alpha / r * B A (in double, rounded
// once), the others the base's; the folder read back gives the same adapters, and the model with
// them applied gives the merged model's loss.
TEST(CoshardTrainLora, PeftFoldersRoundTripAndTheMergedExportIsTheBasePlusTheScaledProduct) {
  const fs::path dir = scratch("lora_peft");
  const std::vector<std::string> llama = llama_of_vocab_256();
  const auto base_run = run(with(llama, {"--world-size", "1", "--freeze", "*", "--export", (dir / "base").string()}), dir);
  ASSERT_EQ(base_run.code, 0) << base_run.output;
  std::vector<std::string> tuned = kLora;
  tuned.insert(tuned.end(), {"--world-size", "2", "--export-adapter", (dir / "peft").string(), "--export", (dir / "merged").string()});
  const auto tuned_run = run(with(llama, tuned), dir);
  ASSERT_EQ(tuned_run.code, 0) << tuned_run.output;
  const auto base = tensors_in(dir / "base" / "model.safetensors"), merged = tensors_in(dir / "merged" / "model.safetensors");
  const auto peft = tensors_in(dir / "peft" / "adapter_model.safetensors");
  ASSERT_EQ(peft.size(), 20u);
  ASSERT_EQ(base.size(), merged.size());
  const double scale = 8.0 / 4.0;
  int folded = 0;
  for (const auto& [name, w] : merged) {
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    const auto a = peft.find("base_model.model." + module + ".lora_A.weight");
    if (a == peft.end()) {
      EXPECT_EQ(w, base.at(name)) << name << " has no adapter: the base's";
      continue;
    }
    ++folded;
    const auto& bv = peft.at("base_model.model." + module + ".lora_B.weight");
    const auto& av = a->second;
    const std::size_t r = 4, in = av.size() / r, rows = bv.size() / r;
    ASSERT_EQ(w.size(), rows * in) << name;
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < in; ++j) {
        double delta = 0;
        for (std::size_t k = 0; k < r; ++k) delta += static_cast<double>(bv[i * r + k]) * av[k * in + j];
        const auto want = static_cast<float>(base.at(name)[i * in + j] + scale * delta);
        ASSERT_EQ(w[i * in + j], want) << name << "[" << i << "," << j << "]";
      }
  }
  EXPECT_EQ(folded, 10) << "q, v, gate, up and down in 2 blocks";

  // Read back at 1e-30 (an update below every value's last bit): the same adapters, bit for bit.
  std::vector<std::string> again = {"--adapter", (dir / "peft").string(), "--export-adapter", (dir / "peft2").string()};
  std::vector<std::string> tiny_lr = llama;
  for (std::size_t i = 0; i + 1 < tiny_lr.size(); ++i) {
    if (tiny_lr[i] == "--lr") tiny_lr[i + 1] = "1e-30";
    if (tiny_lr[i] == "--steps") tiny_lr[i + 1] = "1";
  }
  tiny_lr.insert(tiny_lr.end(), again.begin(), again.end());
  tiny_lr.insert(tiny_lr.end(), {"--world-size", "2", "--zero-stage", "3", "--metrics", (dir / "adapted.jsonl").string()});
  const auto reread = run(tiny_lr, dir);
  ASSERT_EQ(reread.code, 0) << reread.output;
  EXPECT_EQ(tensors_in(dir / "peft2" / "adapter_model.safetensors"), peft);
  // The merged model alone (nothing training) on the same first batch: the adapted model's loss.
  // (the folder's config.json gives the shape: kLlama's run flags alone)
  const std::vector<std::string> merged_args = {"--init", (dir / "merged").string(), "--seq", "8", "--batch", "12",
                                                "--lr", "0.005", "--clip", "0", "--steps", "1", "--quiet",
                                                "--freeze", "*", "--world-size", "2",
                                                "--metrics", (dir / "merged.jsonl").string()};
  const auto merged_run = run(merged_args, dir);
  ASSERT_EQ(merged_run.code, 0) << merged_run.output;
  const auto adapted_loss = losses_in(dir / "adapted.jsonl"), merged_loss = losses_in(dir / "merged.jsonl");
  ASSERT_EQ(adapted_loss.size(), 1u);
  ASSERT_EQ(merged_loss.size(), 1u);
  EXPECT_NEAR(adapted_loss[0], merged_loss[0], 1e-6 * merged_loss[0]);
}

// The way almost everyone fine-tunes: a base model given with --init (a Hugging Face folder or a
// safetensors file, neither with adapters), LoRA over it. At stages 0-3 and worlds 1-3 the runs
// train the adapters of the single-rank run, every base tensor stays the file's bit for bit, and
// the file's weights are what trains (not the seed's: the base was made with another seed); the
// PEFT folder they write loads over the same base (--adapter) to train on or to sample.
TEST(CoshardTrainLora, ABaseGivenWithInitTrainsItsAdapters) {
  const fs::path dir = scratch("lora_init");
  const std::vector<std::string> llama = llama_of_vocab_256();
  const auto made = run(with(llama, {"--world-size", "1", "--freeze", "*", "--seed", "7", "--export", (dir / "base").string()}), dir);
  ASSERT_EQ(made.code, 0) << made.output;
  const auto base = tensors_in(dir / "base" / "model.safetensors");
  ASSERT_FALSE(base.empty());
  // (the folder's config.json gives the shape: the run's flags alone)
  const std::vector<std::string> from_folder = {"--init", (dir / "base").string(), "--seq", "8", "--batch", "12", "--lr",
                                                "0.005", "--clip", "0", "--steps", "12", "--quiet"};
  std::vector<std::string> lora = kLora;
  auto tuned = [&](const std::vector<std::string>& init, std::vector<std::string> flags, const std::string& name) {
    flags.insert(flags.end(), {"--metrics", (dir / (name + ".jsonl")).string(), "--export", (dir / (name + ".safetensors")).string()});
    return run(with(with(init, lora), flags), dir);
  };
  const auto reference = tuned(from_folder, {"--world-size", "1", "--zero-stage", "0", "--export-adapter", (dir / "peft").string()}, "ref");
  ASSERT_EQ(reference.code, 0) << reference.output;
  const auto ref_losses = losses_in(dir / "ref.jsonl");
  ASSERT_EQ(ref_losses.size(), 12u);
  EXPECT_LT(ref_losses[9] + ref_losses[10] + ref_losses[11], ref_losses[0] + ref_losses[1] + ref_losses[2]) << "the adapters learn";
  const auto ref = tensors_in(dir / "ref.safetensors");
  // A base file of coshard's names (the folder's weights under them; the .safetensors export keeps
  // the adapters apart): every base tensor of it, no adapter.
  std::map<std::string, std::vector<float>> base_by_coshard_name;
  int adapters = 0;
  for (const auto& [name, values] : ref) {
    if (is_adapter(name)) {
      ++adapters;
      if (name.ends_with(".B")) EXPECT_TRUE(std::any_of(values.begin(), values.end(), [](float v) { return v != 0; })) << name << " did not train";
      continue;
    }
    base_by_coshard_name[name] = values;
  }
  EXPECT_EQ(adapters, 20);
  // The base came from the folder: the seed's own weights (a plain run, nothing trained) differ.
  ASSERT_EQ(run(with(llama, {"--world-size", "1", "--freeze", "*", "--export", (dir / "seeded.safetensors").string()}), dir).code, 0);
  const auto seeded = tensors_in(dir / "seeded.safetensors");
  ASSERT_EQ(seeded.size(), base_by_coshard_name.size());
  EXPECT_NE(seeded, base_by_coshard_name) << "the run trained over the seed's base, not the folder's";
  // The same base as one safetensors file of coshard's names (the same seed's weights, frozen):
  // the reference's base tensors are its, bit for bit.
  ASSERT_EQ(run(with(llama, {"--world-size", "1", "--freeze", "*", "--seed", "7", "--export", (dir / "base.safetensors").string()}), dir).code, 0);
  EXPECT_EQ(tensors_in(dir / "base.safetensors"), base_by_coshard_name) << "the folder's base did not stay as it was";

  std::vector<std::pair<std::string, std::vector<std::string>>> layouts = {
      {"world 1, stage 3", {"--world-size", "1", "--zero-stage", "3"}},
      {"world 2, stage 1", {"--world-size", "2", "--zero-stage", "1"}},
      {"world 2, stage 2", {"--world-size", "2", "--zero-stage", "2"}},
      {"world 3, stage 3", {"--world-size", "3", "--zero-stage", "3"}},
      {"world 2, stage 3, parameters and optimizer on cpu",
       {"--world-size", "2", "--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu"}},
  };
  std::vector<std::string> from_file = llama;
  from_file.insert(from_file.end(), {"--init", (dir / "base.safetensors").string()});
  auto check = [&](const std::string& label, const Exit& r, const std::string& name) {
    SCOPED_TRACE(label);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto losses = losses_in(dir / (name + ".jsonl"));
    ASSERT_EQ(losses.size(), ref_losses.size());
    for (std::size_t i = 0; i < losses.size(); ++i)
      EXPECT_NEAR(losses[i], ref_losses[i], 1e-6 * std::abs(ref_losses[i])) << "step " << i + 1;
    const auto got = tensors_in(dir / (name + ".safetensors"));
    ASSERT_EQ(got.size(), ref.size());
    for (const auto& [n, values] : got) {
      if (!is_adapter(n)) {
        EXPECT_EQ(values, base_by_coshard_name.at(n)) << n << ": not the file's";
        continue;
      }
      const auto& want = ref.at(n);
      ASSERT_EQ(values.size(), want.size()) << n;
      for (std::size_t i = 0; i < values.size(); ++i)
        if (std::abs(values[i] - want[i]) > 1e-6 * std::max(1.0f, std::abs(want[i]))) {
          ADD_FAILURE() << n << "[" << i << "]: " << values[i] << ", the reference's " << want[i];
          break;
        }
    }
  };
  for (const auto& [label, flags] : layouts) check("folder, " + label, tuned(from_folder, flags, "run"), "run");
  check("file, world 2, stage 3", tuned(from_file, {"--world-size", "2", "--zero-stage", "3"}, "file"), "file");
  check("file, world 3, stage 0", tuned(from_file, {"--world-size", "3", "--zero-stage", "0"}, "file"), "file");

  // The PEFT folder over the same base: trained on (at 1e-30 the adapters stay its own, bit for
  // bit) and sampled from.
  std::vector<std::string> again = from_folder;
  for (std::size_t i = 0; i + 1 < again.size(); ++i) {
    if (again[i] == "--lr") again[i + 1] = "1e-30";
    if (again[i] == "--steps") again[i + 1] = "1";
  }
  again.insert(again.end(), {"--adapter", (dir / "peft").string(), "--world-size", "2", "--zero-stage", "3",
                             "--export-adapter", (dir / "peft2").string()});
  const auto reread = run(again, dir);
  ASSERT_EQ(reread.code, 0) << reread.output;
  EXPECT_EQ(tensors_in(dir / "peft2" / "adapter_model.safetensors"), tensors_in(dir / "peft" / "adapter_model.safetensors"));
  const auto sampled = run({"--init", (dir / "base").string(), "--adapter", (dir / "peft").string(), "--steps", "0", "--prompt",
                            "The engine ", "--sample-tokens", "8"},
                           dir);
  EXPECT_EQ(sampled.code, 0) << sampled.output;
  EXPECT_NE(sampled.output.find("The engine "), std::string::npos) << sampled.output;
}

// A PEFT folder that is not this model's adapters is refused by name, nothing loaded.
TEST(CoshardTrainLora, AForeignPeftFolderIsRefusedByName) {
  const fs::path dir = scratch("lora_peft_refusals");
  std::vector<std::string> args = kLora;
  args.insert(args.end(), {"--world-size", "1", "--export-adapter", (dir / "peft").string()});
  ASSERT_EQ(run(with(kLlama, args), dir).code, 0);
  // Another rank: refused naming both.
  const auto wrong_rank = run(with(kLlama, {"--world-size", "1", "--adapter", (dir / "peft").string(), "--lora-rank", "8",
                                            "--lora-targets", "q_proj", "--lora-targets", "v_proj", "--lora-targets", "*.mlp.*"}),
                              dir);
  EXPECT_EQ(wrong_rank.code, 2);
  EXPECT_NE(wrong_rank.output.find("--lora-rank 8 with --adapter " + (dir / "peft").string() +
                                   ", whose adapter_config.json says r=4"),
            std::string::npos)
      << wrong_rank.output;
  // Fewer targets than the folder holds: its extra tensors are named.
  const auto fewer = run(with(kLlama, {"--world-size", "1", "--adapter", (dir / "peft").string(), "--lora-rank", "4",
                                       "--lora-targets", "q_proj"}),
                         dir);
  EXPECT_NE(fewer.code, 0);
  EXPECT_NE(fewer.output.find("is no adapter of this model"), std::string::npos) << fewer.output;
  // --export-adapter without LoRA.
  const auto none = run(with(kLlama, {"--export-adapter", (dir / "x").string()}), dir);
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.output.find("--export-adapter needs LoRA (--lora-rank)"), std::string::npos) << none.output;
}

// A LoRA run checkpointed at step 6 of 12 and resumed, at another world size and stage: the
// uninterrupted run's losses (within 1e-6: another world sums in another order).
TEST(CoshardTrainLora, ACheckpointResumesAtAnotherWorldSize) {
  const fs::path dir = scratch("lora_resume");
  std::vector<std::string> whole = kLora;
  whole.insert(whole.end(), {"--world-size", "2", "--zero-stage", "3", "--metrics", (dir / "whole.jsonl").string()});
  ASSERT_EQ(run(with(kLlama, whole), dir).code, 0);
  std::vector<std::string> first = kLlama;  // 6 steps (a constant learning rate: the same schedule)
  for (std::size_t i = 0; i + 1 < first.size(); ++i)
    if (first[i] == "--steps") first[i + 1] = "6";
  first.insert(first.end(), kLora.begin(), kLora.end());
  first.insert(first.end(), {"--world-size", "2", "--zero-stage", "3", "--checkpoint-every", "6", "--checkpoint-dir",
                             (dir / "ckpt").string()});
  const auto half = run(first, dir);
  ASSERT_EQ(half.code, 0) << half.output;
  std::vector<std::string> rest = kLora;
  rest.insert(rest.end(), {"--world-size", "3", "--zero-stage", "2", "--resume", "--checkpoint-dir", (dir / "ckpt").string(),
                           "--metrics", (dir / "rest.jsonl").string()});
  const auto resumed = run(with(kLlama, rest), dir);
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  const auto want = losses_in(dir / "whole.jsonl"), got = losses_in(dir / "rest.jsonl");
  ASSERT_EQ(want.size(), 12u);
  ASSERT_EQ(got.size(), 6u);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[6 + i], 1e-6 * want[6 + i]) << "step " << 7 + i;

  // The checkpoint holds the adapters and their state alone: every frozen unit left out, the
  // files a fraction of a full run's checkpoint of the same model.
  const fs::path saved = dir / "ckpt" / "step-00000006";
  std::ifstream manifest(saved / "manifest.json");
  ASSERT_TRUE(manifest) << saved;
  const auto m = nlohmann::json::parse(manifest);
  int left_out = 0;
  for (const auto& u : m["units"]) {
    EXPECT_EQ(u["saved"].get<bool>(), !u["frozen"].get<bool>()) << u["name"];
    left_out += u["saved"].get<bool>() ? 0 : 1;
  }
  EXPECT_GT(left_out, 0);
  auto file_bytes = [](const fs::path& folder) {
    std::uintmax_t total = 0;
    for (const auto& e : fs::directory_iterator(folder))
      if (e.path().extension() == ".safetensors") total += fs::file_size(e.path());
    return total;
  };
  std::vector<std::string> full = first;
  full.erase(full.begin() + static_cast<std::ptrdiff_t>(kLlama.size()),
             full.begin() + static_cast<std::ptrdiff_t>(kLlama.size() + kLora.size()));
  for (auto& a : full)
    if (a == (dir / "ckpt").string()) a = (dir / "full").string();
  ASSERT_EQ(run(full, dir).code, 0);
  const auto lora_bytes = file_bytes(saved), full_bytes = file_bytes(dir / "full" / "step-00000006");
  EXPECT_LT(4 * lora_bytes, full_bytes) << lora_bytes << " bytes against a full run's " << full_bytes;
  RecordProperty("checkpoint_bytes", std::to_string(lora_bytes) + " with LoRA, " + std::to_string(full_bytes) + " full");

  // Another base (another seed) is another run: refused by name, nothing loaded.
  std::vector<std::string> other = rest;
  other.insert(other.end(), {"--seed", "2"});
  const auto refused = run(with(kLlama, other), dir);
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.output.find("seed"), std::string::npos) << refused.output;
}

// A rank of 0 is full training; a target that matches nothing, a dropout of 1 and LoRA on a model
// without defaults for it are refused by name before anything trains.
TEST(CoshardTrainLora, BadSettingsAreRefusedByName) {
  const fs::path dir = scratch("lora_refusals");
  const auto typo = run(with(kLlama, {"--lora-rank", "4", "--lora-targets", "q_prj"}), dir);
  EXPECT_EQ(typo.code, 2) << typo.output;
  EXPECT_NE(typo.output.find("\"q_prj\" matches no linear layer"), std::string::npos) << typo.output;
  const auto dropout = run(with(kLlama, {"--lora-rank", "4", "--lora-dropout", "1"}), dir);
  EXPECT_EQ(dropout.code, 2) << dropout.output;
  EXPECT_NE(dropout.output.find("lora_dropout=1"), std::string::npos) << dropout.output;
  const auto rank = run(with(kLlama, {"--lora-rank", "-1"}), dir);
  EXPECT_EQ(rank.code, 2) << rank.output;
  EXPECT_NE(rank.output.find("lora"), std::string::npos) << rank.output;
}

}  // namespace
}  // namespace coshard::testing
