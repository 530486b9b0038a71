// coshard-train with quantized weight gathers (--quantize-weights, --quantize-frozen-weights; #63
// item 1), the user's path: a Llama from a Hugging Face folder (--init) at world 2, with the
// optimizer and parameters offloaded, with tensor parallelism and in bf16, tracking the exact
// gathers' losses step by step while the gathers carry about a quarter (f32) or half (bf16) of the
// bytes; the export exact (lr 1e-30 exports the folder's own weights); a resume under quantization
// the uninterrupted run's losses; LoRA's frozen base quantized alone and never changed; bad flags
// refused by name before anything runs. The secondary partition (--secondary-partition; #63 item
// 3) gives full sharding's losses and export bit for bit on every layout (quantized gathers' with
// them), with fewer bytes over the whole world.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "binary_harness.hpp"
#include "safetensors_values.hpp"
#include "support/sanitizers.hpp"

namespace coshard::testing {
namespace {

// Dim 64: each rank's shard of a projection holds several blocks of 64.
const std::vector<std::string> kLlama = {"--model", "llama", "--layers", "2", "--dim", "64", "--heads", "4",
                                         "--kv-heads", "2", "--seq", "8", "--batch", "12", "--vocab", "256",
                                         "--clip", "0"};

std::vector<double> column(const fs::path& metrics, const std::string& key) {
  std::ifstream in(metrics);
  std::string line;
  std::vector<double> out;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)[key].get<double>());
  return out;
}

// The folder a user starts from: a Llama exported as Hugging Face's, nothing trained.
fs::path make_folder(const fs::path& dir) {
  const auto made = run(with(kLlama, {"--world-size", "1", "--freeze", "*", "--seed", "7", "--steps", "1", "--quiet",
                                      "--export", (dir / "base").string()}),
                        dir);
  EXPECT_EQ(made.code, 0) << made.output;
  return dir / "base";
}

std::vector<std::string> from(const fs::path& folder, const std::string& steps, const std::string& lr = "0.005") {
  return {"--init", folder.string(), "--seq", "8", "--batch", "12", "--clip", "0", "--lr", lr, "--steps", steps};
}

// Every step's loss within `tolerance` of the exact run's, and the gathers' bytes at most `bytes`
// of its.
void expect_tracks(const fs::path& got, const fs::path& exact, double tolerance, double bytes) {
  const auto losses = column(got, "loss"), want = column(exact, "loss");
  ASSERT_EQ(losses.size(), want.size());
  ASSERT_FALSE(want.empty());
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(losses[i], want[i], tolerance * want[i]) << "step " << i + 1;
  EXPECT_NE(losses, want) << "nothing was quantized";
  const auto g = column(got, "gathered_bytes"), e = column(exact, "gathered_bytes");
  const double ratio = std::accumulate(g.begin(), g.end(), 0.0) / std::accumulate(e.begin(), e.end(), 0.0);
  EXPECT_LE(ratio, bytes) << "the gathers carried " << ratio << " of the exact gathers' bytes";
}

TEST(CoshardTrainQuantizedGathers, AFolderTrainsCloseToExactGathersOnEveryLayout) {
  const fs::path dir = scratch("quantized_gathers");
  const fs::path base = make_folder(dir);
  auto train = [&](std::vector<std::string> flags, const std::string& name, const std::string& steps = "10") {
    flags.insert(flags.end(), {"--metrics", (dir / (name + ".jsonl")).string()});
    return run(with(from(base, steps), flags), dir);
  };
  struct Layout {
    std::string name;
    std::vector<std::string> flags;
    double bytes;
  };
  std::vector<Layout> layouts = {
      {"world2", {"--world-size", "2"}, 0.3},
      {"offload", {"--world-size", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu"}, 0.3},
      {"tensor", {"--world-size", "4", "--tensor-parallel", "2"}, 0.3},
      {"bf16", {"--world-size", "2", "--dtype", "bf16"}, 0.6},
  };
  if (kSanitized) layouts.resize(2);
  // The gradients' reduction quantized (#63 item 2), alone and with the weights' gathers.
  std::vector<Layout> gradient_layouts = {
      {"grads_world2", {"--world-size", "2"}, 0.3},
      {"grads_stage2_offload", {"--world-size", "3", "--zero-stage", "2", "--offload-optimizer", "cpu"}, 0.3},
      {"grads_tensor", {"--world-size", "4", "--tensor-parallel", "2"}, 0.3},
      {"grads_bf16", {"--world-size", "2", "--dtype", "bf16"}, 0.6},
  };
  if (kSanitized) gradient_layouts.resize(1);
  for (const auto& layout : gradient_layouts) {
    SCOPED_TRACE(layout.name);
    const auto exact = train(with(layout.flags, {"--quiet"}), layout.name + "_exact");
    ASSERT_EQ(exact.code, 0) << exact.output;
    const auto quantized = train(with(layout.flags, {"--quantize-gradients", "int8", "--quantize-gradients-block", "64"}),
                                 layout.name);
    ASSERT_EQ(quantized.code, 0) << quantized.output;
    EXPECT_NE(quantized.output.find("quantized gradient reduction: int8 blocks of 64"), std::string::npos)
        << quantized.output;
    const auto losses = column(dir / (layout.name + ".jsonl"), "loss");
    const auto want = column(dir / (layout.name + "_exact.jsonl"), "loss");
    ASSERT_EQ(losses.size(), want.size());
    EXPECT_EQ(losses.front(), want.front()) << "the first forward came before any reduction";
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(losses[i], want[i], 0.03 * want[i]) << "step " << i + 1;
    EXPECT_NE(losses, want) << "nothing was quantized";
    const auto g = column(dir / (layout.name + ".jsonl"), "reduce_scattered_bytes");
    const auto e = column(dir / (layout.name + "_exact.jsonl"), "reduce_scattered_bytes");
    EXPECT_LE(std::accumulate(g.begin(), g.end(), 0.0) / std::accumulate(e.begin(), e.end(), 0.0), layout.bytes);
  }
  // int4 (DeepSpeed's format for zero_quantized_gradients), from the folder at world 2 and data 2 x
  // tensor 2: the first step exact's, the rest close, the reduction carrying about an eighth of
  // f32's bytes.
  std::vector<Layout> int4_layouts = {{"int4_world2", {"--world-size", "2"}, 0.17},
                                      {"int4_tensor", {"--world-size", "4", "--tensor-parallel", "2"}, 0.17}};
  if (kSanitized) int4_layouts.resize(1);  // (grads_tensor_exact ran only unsanitized)
  for (const auto& layout : int4_layouts) {
    SCOPED_TRACE(layout.name);
    const auto quantized = train(with(layout.flags, {"--quantize-gradients", "int4", "--quantize-gradients-block", "64"}),
                                 layout.name);
    ASSERT_EQ(quantized.code, 0) << quantized.output;
    EXPECT_NE(quantized.output.find("quantized gradient reduction: int4 blocks of 64"), std::string::npos)
        << quantized.output;
    const std::string exact = layout.name == "int4_world2" ? "grads_world2_exact" : "grads_tensor_exact";
    const auto losses = column(dir / (layout.name + ".jsonl"), "loss"), want = column(dir / (exact + ".jsonl"), "loss");
    ASSERT_EQ(losses.size(), want.size());
    EXPECT_EQ(losses.front(), want.front()) << "the first forward came before any reduction";
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(losses[i], want[i], 0.05 * want[i]) << "step " << i + 1;
    const auto g = column(dir / (layout.name + ".jsonl"), "reduce_scattered_bytes");
    const auto e = column(dir / (exact + ".jsonl"), "reduce_scattered_bytes");
    EXPECT_LE(std::accumulate(g.begin(), g.end(), 0.0) / std::accumulate(e.begin(), e.end(), 0.0), layout.bytes);
  }
  {  // all together: both tracked against exact, both byte counts down
    const auto both = train({"--world-size", "2", "--quantize-weights", "int8", "--quantize-gradients", "int8", "--quiet"},
                            "both");
    ASSERT_EQ(both.code, 0) << both.output;
    expect_tracks(dir / "both.jsonl", dir / "grads_world2_exact.jsonl", 0.03, 0.3);
  }
  for (const auto& layout : layouts) {
    SCOPED_TRACE(layout.name);
    const auto exact = train(with(layout.flags, {"--quiet"}), layout.name + "_exact");
    ASSERT_EQ(exact.code, 0) << exact.output;
    const auto quantized =
        train(with(layout.flags, {"--quantize-weights", "int8", "--quantize-weights-block", "64"}), layout.name);
    ASSERT_EQ(quantized.code, 0) << quantized.output;
    EXPECT_NE(quantized.output.find("quantized weight gathers: int8 blocks of 64"), std::string::npos) << quantized.output;
    expect_tracks(dir / (layout.name + ".jsonl"), dir / (layout.name + "_exact.jsonl"),
                  layout.name == "bf16" ? 0.03 : 0.02, layout.bytes);
  }

  // The export is the shards' own values: at lr 1e-30 nothing moves, and the folder written under
  // quantization is the folder read, bit for bit.
  const auto still = run(with(from(base, "2", "1e-30"), {"--world-size", "2", "--quantize-weights", "int8", "--quiet",
                                                         "--export", (dir / "still").string()}),
                         dir);
  ASSERT_EQ(still.code, 0) << still.output;
  EXPECT_EQ(tensors_in(dir / "still" / "model.safetensors"), tensors_in(base / "model.safetensors"));

  // A resume under quantization continues as the run that was not stopped: the dequantized weights
  // follow the shards alone.
  const auto whole = train({"--world-size", "2", "--quantize-weights", "int8", "--quiet"}, "whole", "8");
  ASSERT_EQ(whole.code, 0) << whole.output;
  const std::vector<std::string> checkpointed = {"--world-size", "2", "--quantize-weights", "int8", "--quiet",
                                                 "--checkpoint-dir", (dir / "ck").string(), "--checkpoint-every", "4"};
  const auto first = train(checkpointed, "first", "4");
  ASSERT_EQ(first.code, 0) << first.output;
  const auto resumed = train(with(checkpointed, {"--resume"}), "resumed", "8");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  const auto all = column(dir / "whole.jsonl", "loss"), rest = column(dir / "resumed.jsonl", "loss");
  ASSERT_EQ(all.size(), 8u);
  ASSERT_EQ(rest.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(rest[i], all[4 + i]) << "step " << 5 + i;
}

TEST(CoshardTrainQuantizedGathers, LorasFrozenBaseAloneIsQuantizedAndNeverChanges) {
  const fs::path dir = scratch("quantized_gathers_lora");
  const fs::path base = make_folder(dir);
  const std::vector<std::string> lora = {"--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj",
                                         "--lora-targets", "v_proj"};
  std::vector<std::pair<std::string, std::vector<std::string>>> layouts = {
      {"world2", {"--world-size", "2"}},
      {"tensor", {"--world-size", "4", "--tensor-parallel", "2", "--offload-optimizer", "cpu"}},
  };
  if (kSanitized) layouts.resize(1);
  for (const auto& [name, flags] : layouts) {
    SCOPED_TRACE(name);
    auto train = [&, name = name, flags = flags](std::vector<std::string> more, const std::string& label) {
      more.insert(more.end(), {"--metrics", (dir / (name + label + ".jsonl")).string(), "--export",
                               (dir / (name + label + ".safetensors")).string()});
      return run(with(with(with(from(base, "10"), lora), flags), more), dir);
    };
    const auto exact = train({"--quiet"}, "_exact");
    ASSERT_EQ(exact.code, 0) << exact.output;
    const auto quantized = train({"--quantize-frozen-weights", "int8", "--quantize-weights-block", "64"}, "");
    ASSERT_EQ(quantized.code, 0) << quantized.output;
    EXPECT_NE(quantized.output.find("(the frozen ones sharded over more than one rank)"), std::string::npos) << quantized.output;
    expect_tracks(dir / (name + ".jsonl"), dir / (name + "_exact.jsonl"), 0.02, 0.4);
    // The base as the folder gave it; the adapters trained.
    const auto got = tensors_in(dir / (name + ".safetensors")), want = tensors_in(dir / (name + "_exact.safetensors"));
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [tensor, values] : got) {
      if (tensor.find(".lora_") == std::string::npos)
        EXPECT_EQ(values, want.at(tensor)) << tensor << ": the frozen base changed";
      else if (tensor.ends_with(".B"))
        EXPECT_TRUE(std::any_of(values.begin(), values.end(), [](float v) { return v != 0; })) << tensor << " did not train";
    }
  }
}

// The secondary partition changes where the step's later gathers go, never what they give: the
// losses and the export are full sharding's, bit for bit, while the gathers over the whole world
// carry less (forward's alone) and the rest go within the groups of N.
TEST(CoshardTrainQuantizedGathers, TheSecondaryPartitionGivesFullShardingsBits) {
  const fs::path dir = scratch("secondary_partition");
  const fs::path base = make_folder(dir);
  auto train = [&](std::vector<std::string> flags, const std::string& name) {
    flags.insert(flags.end(), {"--metrics", (dir / (name + ".jsonl")).string(), "--export",
                               (dir / (name + ".safetensors")).string()});
    return run(with(from(base, "6"), flags), dir);
  };
  struct Layout {
    std::string name;
    std::vector<std::string> flags;
  };
  std::vector<Layout> layouts = {
      {"world4", {"--world-size", "4"}},
      {"quantized", {"--world-size", "4", "--quantize-weights", "int8", "--quantize-gradients", "int8"}},
      {"offload_checkpointing", {"--world-size", "4", "--offload-optimizer", "cpu", "--offload-params", "cpu",
                                 "--activation-checkpointing", "full", "--grad-accum", "3"}},
      {"tensor", {"--world-size", "8", "--tensor-parallel", "2"}},
      {"lora_bf16", {"--world-size", "4", "--dtype", "bf16", "--lora-rank", "4", "--lora-targets", "q_proj"}},
  };
  if (kSanitized) layouts.resize(2);
  for (const auto& layout : layouts) {
    SCOPED_TRACE(layout.name);
    const auto full = train(with(layout.flags, {"--quiet"}), layout.name + "_full");
    ASSERT_EQ(full.code, 0) << full.output;
    const auto secondary = train(with(layout.flags, {"--secondary-partition", "2"}), layout.name);
    ASSERT_EQ(secondary.code, 0) << secondary.output;
    EXPECT_NE(secondary.output.find("secondary partition: groups of 2 consecutive"), std::string::npos) << secondary.output;
    EXPECT_EQ(column(dir / (layout.name + ".jsonl"), "loss"), column(dir / (layout.name + "_full.jsonl"), "loss"));
    EXPECT_EQ(tensors_in(dir / (layout.name + ".safetensors")), tensors_in(dir / (layout.name + "_full.safetensors")));
    const auto g = column(dir / (layout.name + ".jsonl"), "gathered_bytes");
    const auto f = column(dir / (layout.name + "_full.jsonl"), "gathered_bytes");
    const auto within = column(dir / (layout.name + ".jsonl"), "secondary_gathered_bytes");
    // (LoRA: its frozen base stays gathered through the step anyway; the adapters' gathers move)
    const double most = layout.name.starts_with("lora") ? 1.0 : 0.75;
    EXPECT_LT(std::accumulate(g.begin(), g.end(), 0.0), most * std::accumulate(f.begin(), f.end(), 0.0));
    EXPECT_GT(std::accumulate(within.begin(), within.end(), 0.0), 0.0);
  }
  // local: the ranks of one node, and threads share one machine: every rank, so no unit is
  // sharded over more: it gathers as it did, and says so.
  const auto local = train({"--world-size", "4", "--secondary-partition", "local"}, "local");
  ASSERT_EQ(local.code, 0) << local.output;
  EXPECT_NE(local.output.find("secondary partition: groups of 4 (local: the ranks of a node): none"), std::string::npos)
      << local.output;
  EXPECT_EQ(column(dir / "local.jsonl", "loss"), column(dir / "world4_full.jsonl", "loss"));
  // Shard groups of one rank: nothing crosses a wire, and the header says so instead of a format.
  const auto alone = train({"--world-size", "2", "--shard-group-size", "1", "--quantize-gradients", "int4"}, "alone");
  ASSERT_EQ(alone.code, 0) << alone.output;
  EXPECT_NE(alone.output.find("quantized gradient reduction: none (every trained unit sharded over one rank"),
            std::string::npos)
      << alone.output;
}

TEST(CoshardTrainQuantizedGathers, BadFlagsAreRefusedByName) {
  const fs::path dir = scratch("quantized_gathers_bad");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--zero-stage", "2", "--quantize-weights", "int8"}, "quantize_weights=int8 with zero_stage=2"},
      {{"--quantize-frozen-weights", "int8", "--zero-stage", "0"}, "quantize_frozen_weights=int8 with zero_stage=0"},
      {{"--quantize-weights", "int8", "--fetch-mode", "all_reduce"}, "fetch_mode=all_reduce"},
      {{"--quantize-weights", "int4"}, "--quantize-weights"},
      {{"--quantize-weights-block", "4"}, "--quantize-weights-block"},
      {{"--zero-stage", "1", "--quantize-gradients", "int8"}, "quantize_gradients=int8 with zero_stage=1"},
      {{"--quantize-gradients", "int2"}, "--quantize-gradients"},
      {{"--quantize-gradients", "int4", "--quantize-gradients-block", "63"},
       "quantize_gradients_block=63 with quantize_gradients=int4: expected an even count"},
      {{"--quantize-gradients-block", "0"}, "--quantize-gradients-block"},
      {{"--world-size", "4", "--secondary-partition", "3"},
       "secondary_partition_ranks=3: expected a divisor of the world size 4"},
      {{"--world-size", "4", "--zero-stage", "2", "--secondary-partition", "2"},
       "secondary_partition_ranks=2 with zero_stage=2"},
      {{"--zero-stage", "1", "--secondary-partition", "local"}, "secondary_partition_ranks=local with zero_stage=1"},
      {{"--secondary-partition", "0"}, "--secondary-partition"},
      {{"--secondary-partition", "two"}, "(given 'two')"},
      {{"--world-size", "8", "--shard-group-size", "4", "--secondary-partition", "3"},
       "secondary_partition_ranks=3 with shard_group_size=4: expected a divisor of the shard group size"},
      {{"--world-size", "8", "--tensor-parallel", "2", "--secondary-partition", "8"},
       "secondary_partition_ranks=8: expected a divisor of the data ranks 4 (world 8 / tensor 2)"},
      // (--print-config's output is one the run takes)
      {{"--world-size", "4", "--secondary-partition", "3", "--print-config"},
       "secondary_partition_ranks=3: expected a divisor of the world size 4"},
  };
  for (const auto& [flags, message] : cases) {
    const auto r = run(with(with(kLlama, {"--steps", "1"}), flags), dir);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step 1"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace coshard::testing
