// coshard-train with LoRA (--lora-rank): every stage, world size, offload, hybrid sharding,
// activation checkpointing and accumulation against the unsharded single-rank run of the same
// adapted Llama: the losses and the adapters within 1e-6 relative (absolute below 1, as the
// engine's semantics tests), the base bit for bit its initial values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "coshard/modules/safetensors.hpp"
#include "binary_harness.hpp"

namespace coshard::testing {
namespace {

// Every tensor of a safetensors file, by name, as f32 values.
std::map<std::string, std::vector<float>> tensors_in(const fs::path& path) {
  std::map<std::string, std::vector<float>> out;
  auto file = modules::SafetensorsFile::load(path);
  EXPECT_TRUE(file) << file.error().message();
  if (!file) return out;
  for (const auto& t : file->tensors()) {
    const auto bytes = file->data(t);
    std::vector<float> v(bytes.size() / sizeof(float));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
    out[t.name] = std::move(v);
  }
  return out;
}

// A Llama of 2 blocks with grouped-query attention, adapters on q, v and the MLP's projections
// (q_proj and v_proj on the fused qkv's rows; gate_proj and up_proj on gate_up's; down_proj).
const std::vector<std::string> kLlama = {"--model", "llama", "--layers", "2", "--dim", "32", "--heads", "4",
                                         "--kv-heads", "2", "--seq", "8", "--batch", "12", "--vocab", "48",
                                         "--lr", "0.005", "--clip", "0", "--steps", "12", "--quiet"};
const std::vector<std::string> kLora = {"--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj",
                                        "--lora-targets", "v_proj", "--lora-targets", "*.mlp.*"};

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
  for (const auto& [label, flags] : layouts) {
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
