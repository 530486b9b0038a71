// coshard-train as a user runs it: token data, offload and budgets, bad command lines, a
// DeepSpeed config, and SIGKILL in the middle of checkpointing followed by --resume (what a run
// reports, its metrics and trace: report_binary_test.cpp).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "binary_harness.hpp"
#include "support/sanitizers.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

// --data as token ids: llm.c's .bin (a 256-int32 header, uint16 ids) of a learnable sequence
// trains and its loss falls; ids the model cannot embed are refused by name before training.
TEST(CoshardTrain, TokenIdDataTrainsAndIdsPastTheVocabularyAreRefused) {
  const fs::path dir = scratch("token_data");
  constexpr int kVocab = 48;
  std::vector<std::int32_t> header(256, 0);
  std::vector<std::uint16_t> ids;
  for (int i = 0; i < 4000; ++i) ids.push_back(static_cast<std::uint16_t>((i * 7 + i / 97) % kVocab));
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<std::int32_t>(ids.size());
  {
    std::ofstream out(dir / "tokens.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 2));
  }
  // kTiny with another --vocab.
  auto tiny_with_vocab = [](int vocab) {
    auto args = kTiny;
    *(std::find(args.begin(), args.end(), "--vocab") + 1) = std::to_string(vocab);
    return args;
  };
  const auto r = run(with(tiny_with_vocab(kVocab), {"--steps", "40", "--world-size", "2", "--data",
                                  (dir / "tokens.bin").string(), "--metrics", (dir / "m.jsonl").string()}),
                     dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("4000 tokens, uint16, llm.c header, vocab 48"), std::string::npos) << r.output;
  const auto losses = losses_in(dir / "m.jsonl");
  ASSERT_EQ(losses.size(), 40u);
  EXPECT_LT(losses.back(), 0.7 * losses.front());
  const auto small = run(with(tiny_with_vocab(40), {"--steps", "2", "--data", (dir / "tokens.bin").string()}), dir);
  EXPECT_EQ(small.code, 2);
  EXPECT_NE(small.output.find("not below the model's vocabulary of 40 (--vocab)"), std::string::npos) << small.output;
  const auto wrong = run(with(tiny_with_vocab(kVocab), {"--steps", "2", "--data-format", "u32", "--data",
                                      (dir / "tokens.bin").string()}),
                         dir);
  EXPECT_EQ(wrong.code, 2);
  EXPECT_NE(wrong.output.find("--data-format u32 but its llm.c header (version 1)"), std::string::npos) << wrong.output;
}

// --step-in-backward steps each unit on the CPU during backward: the losses of stepping after
// backward, bit for bit (no clipping), with the optimizer state in pinned memory or on NVMe.
TEST(CoshardTrain, StepInBackwardTrainsLikeSteppingAfterBackward) {
  const fs::path dir = scratch("step_in_backward");
  for (const std::string& offload : {std::string("cpu"), "nvme:" + (dir / "state").string()}) {
    SCOPED_TRACE(offload);
    std::vector<std::vector<double>> losses;
    for (const bool early : {false, true}) {
      const fs::path metrics = dir / (early ? "early.jsonl" : "after.jsonl");
      auto args = with(kTiny, {"--steps", "6", "--world-size", "2", "--offload-optimizer", offload, "--clip", "0",
                               "--metrics", metrics.string()});
      if (early) args.push_back("--step-in-backward");
      const auto r = run(args, dir);
      ASSERT_EQ(r.code, 0) << r.output;
      losses.push_back(losses_in(metrics));
    }
    ASSERT_EQ(losses[0].size(), 6u);
    EXPECT_EQ(losses[1], losses[0]);
  }
}

// --dtype bf16 and f16 on the CPU (f32 compute on copies, outputs rounded): the optimizer on NVMe
// and the parameters on NVMe (bf16) or in pinned memory (f16) give the losses of keeping both on
// the device, bit for bit.
TEST(CoshardTrain, HalfPrecisionOffloadedTrainsLikeResident) {
  const fs::path dir = scratch("half_offload");
  for (const std::string dtype : {"bf16", "f16"}) {
    SCOPED_TRACE(dtype);
    std::vector<std::vector<double>> losses;
    for (const bool offload : {false, true}) {
      const fs::path metrics = dir / (offload ? "offloaded.jsonl" : "resident.jsonl");
      auto args = with(kTiny, {"--steps", "6", "--world-size", "2", "--dtype", dtype, "--metrics", metrics.string()});
      if (offload)
        args = with(args, {"--offload-optimizer", "nvme:" + (dir / "state").string(), "--offload-params",
                           dtype == "bf16" ? "nvme" : "cpu"});
      const auto r = run(args, dir);
      ASSERT_EQ(r.code, 0) << r.output;
      losses.push_back(losses_in(metrics));
    }
    ASSERT_EQ(losses[0].size(), 6u);
    EXPECT_EQ(losses[1], losses[0]);
    EXPECT_LT(losses[0].back(), losses[0].front());
  }
}

// --device-memory-budget with --offload-params cpu: --estimate names the split, and a run with part
// of the shards on the device gives the losses of all of them offloaded, bit for bit. With the
// parameters on the device and the optimizer offloaded, the budget keeps the optimizer state of
// some units there (Twin-Flow), with the losses of the optimizer all on the host (--clip 0: with
// clipping the norm is summed in two parts, its last bit may differ).
TEST(CoshardTrain, DeviceMemoryBudgetSplitsTheShardsWithTheSameLosses) {
  const fs::path dir = scratch("device_budget");
  // Rank 0's losses under `flags` with each of `budgets`, one run each.
  auto losses_with = [&](const std::vector<std::string>& flags, const std::vector<std::string>& budgets) {
    std::vector<std::vector<double>> losses;
    for (const std::string& budget : budgets) {
      const fs::path metrics = dir / ("budget" + std::to_string(losses.size()) + budget + ".jsonl");
      const auto r = run(with(with(kTiny, flags), {"--device-memory-budget", budget, "--metrics", metrics.string()}), dir);
      EXPECT_EQ(r.code, 0) << r.output;
      losses.push_back(r.code == 0 ? losses_in(metrics) : std::vector<double>{});
    }
    return losses;
  };
  const std::vector<std::string> offload = {"--steps", "4", "--world-size", "2", "--zero-stage", "3",
                                            "--offload-optimizer", "cpu", "--offload-params", "cpu"};
  const auto estimate = run(with(with(kTiny, offload), {"--device-memory-budget", "1MiB", "--estimate"}), dir);
  ASSERT_EQ(estimate.code, 0) << estimate.output;
  EXPECT_NE(estimate.output.find("(device_memory_budget 1.00 MiB: the parameter shards of "), std::string::npos)
      << estimate.output;
  const auto too_small = run(with(with(kTiny, offload), {"--device-memory-budget", "1KiB"}), dir);
  EXPECT_EQ(too_small.code, 2) << too_small.output;  // (a configuration refused before the run)
  EXPECT_NE(too_small.output.find("device_memory_budget=1024 (1.00 KiB): the plan needs"), std::string::npos)
      << too_small.output;
  const auto shard_losses = losses_with(offload, {"0", "1MiB"});
  ASSERT_EQ(shard_losses[0].size(), 4u);
  EXPECT_EQ(shard_losses[1], shard_losses[0]);

  const std::vector<std::string> state = {"--steps", "4", "--world-size", "2", "--zero-stage", "3",
                                          "--offload-optimizer", "cpu", "--clip", "0"};
  const auto split = run(with(with(kTiny, state), {"--device-memory-budget", "8MiB", "--estimate"}), dir);
  ASSERT_EQ(split.code, 0) << split.output;
  EXPECT_NE(split.output.find("units on the device (stepped there), the rest stepped on the host"), std::string::npos)
      << split.output;
  EXPECT_EQ(split.output.find("the optimizer state of 0 of"), std::string::npos) << split.output;
  EXPECT_NE(split.output.find("optimizer state (2 tensors) of the units stepped on the device"), std::string::npos)
      << split.output;
  const auto state_losses = losses_with(state, {"0", "8MiB"});
  ASSERT_EQ(state_losses[0].size(), 4u);
  EXPECT_EQ(state_losses[1], state_losses[0]);
}

TEST(CoshardTrain, BadCommandLinesAreNamed) {
  const fs::path dir = scratch("bad");
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"--batch", "5", "--world-size", "2"}, "--batch 5 does not split evenly over 2 rank(s)"},
      {{"--max-live", "12parsecs"}, "unknown unit 'parsecs'"},
      {{"--zero-stage", "7"}, "zero_stage=7"},
      {{"--offload-params", "cpu"}, "offload_params=cpu with offload_optimizer=none"},
      {{"--offload-optimizer", "cpu", "--step-in-backward"}, "step_in_backward with max_grad_norm=1"},
      {{"--step-in-backward", "--clip", "0"}, "step_in_backward with offload_optimizer=none"},
      {{"--swap-gradients", "--offload-optimizer", "cpu"}, "swap_gradients with offload_optimizer=cpu"},
      {{"--checkpoint-every", "5"}, "need --checkpoint-dir"},
      {{"--dim", "30", "--heads", "4"}, "--dim 30 is not a multiple of --heads 4"},
      {{"--data", (dir / "absent.txt").string()}, "absent.txt"},
      {{"--max-live", "1KiB", "--steps", "1"}, "max_live_bytes=1024: must be at least the largest fetch unit"},
      {{"--zero-stage", "0", "--offload-optimizer", "cpu", "--steps", "1"}, "offload_optimizer=cpu with zero_stage=0"},
      {{"--zero-stage", "-1"}, "zero_stage=-1: expected 0, 1, 2 or 3"},
      {{"--log-level", "zero=loud"}, "--log-level: COSHARD_LOG / --log-level item 'zero=loud': level 'loud' is not one of"},
      {{"--log-level", "gpu=debug"}, "component 'gpu' is not one of async, collectives"},
      {{"--preset", "Llama-9000"}, "Llama preset \"Llama-9000\": expected one of llama-tiny"},
      {{"--model", "gpt", "--preset", "llama-tiny"}, "the presets are Llama shapes"},
      {{"--kv-heads", "2"}, "--kv-heads is an option of --model llama"},
      {{"--model", "llama", "--heads", "4", "--kv-heads", "3"}, "LlamaConfig.kv_heads=3: expected a divisor of heads=4"},
      {{"--model", "llama", "--dim", "36", "--heads", "4"}, "head_dim=9: expected an even number"},
      {{"--activation-checkpointing", "0"}, "activation checkpointing \"0\": expected none, full, or N"},
      {{"--attention", "flash"}, "--attention: flash not in {fused,materialized,cudnn}"},
      {{"--preset", "llama-tiny", "--vocab", "100", "--data", (dir / "text.txt").string()},
       "--data as bytes (vocabulary 256): more tokens than the model's vocabulary of 100"},
  };
  std::ofstream(dir / "text.txt") << std::string(4096, 'a');
  for (const auto& k : cases) {
    const auto r = run(k.args, dir);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(k.expect), std::string::npos) << r.output;
  }
  // A setting the configuration can refuse is a usage error (exit 2), said once before any rank
  // starts (stage 0 with an offloaded optimizer was each rank's runtime error: exit 1, twice).
  const auto stage0 = run({"--zero-stage", "0", "--offload-optimizer", "cpu", "--steps", "1"}, dir);
  EXPECT_EQ(stage0.code, 2) << stage0.output;
  EXPECT_EQ(stage0.output.find("rank 1"), std::string::npos) << stage0.output;
}

// A Llama preset with its shape flags over it trains with every block checkpointed, the same
// losses as without, less activation memory each step; --help lists the presets with their sizes.
TEST(CoshardTrain, LlamaPresetTrainsWithActivationCheckpointing) {
  const fs::path dir = scratch("llama");
  const std::vector<std::string> llama = {"--preset", "llama-tiny", "--layers", "2", "--dim", "32", "--heads", "4",
                                          "--kv-heads", "2", "--intermediate", "64", "--seq", "16", "--batch", "8",
                                          "--world-size", "2", "--steps", "12", "--lr", "1e-2"};
  std::map<std::string, std::vector<nlohmann::json>> rows;
  for (const std::string policy : {"none", "full", "materialized", "cudnn"}) {
    const fs::path metrics = dir / (policy + ".jsonl");
    // "materialized", "cudnn": the attention option, which the CPU (always materialized) takes and ignores.
    const bool attention = policy == "materialized" || policy == "cudnn";
    const auto r = run(with(llama, attention ? std::vector<std::string>{"--attention", policy, "--metrics", metrics.string()}
                                       : std::vector<std::string>{"--activation-checkpointing", policy, "--metrics",
                                                                  metrics.string()}),
                       dir);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("llama-tiny (changed) (2 layers, dim 32, 4 heads (2 key/value)"), std::string::npos) << r.output;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) rows[policy].push_back(nlohmann::json::parse(line));
  }
  ASSERT_EQ(rows["none"].size(), 12u);
  ASSERT_EQ(rows["full"].size(), 12u);
  for (std::size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(rows["full"][i]["loss"], rows["none"][i]["loss"]) << "step " << i;
    EXPECT_EQ(rows["materialized"][i]["loss"], rows["none"][i]["loss"]) << "step " << i;
    EXPECT_EQ(rows["cudnn"][i]["loss"], rows["none"][i]["loss"]) << "step " << i;
    EXPECT_LT(rows["full"][i]["peak_activation_bytes"].get<double>(), rows["none"][i]["peak_activation_bytes"].get<double>());
  }
  EXPECT_LT(rows["none"][11]["loss"].get<double>(), rows["none"][0]["loss"].get<double>());
  const auto help = run({"--help"}, dir);
  EXPECT_EQ(help.code, 0);
  for (const char* line : {"Llama-3.2-1B (1.24B parameters)", "Llama-3.2-3B (3.21B parameters)",
                           "Llama-3.1-8B (8.03B parameters)", "llama-100m (100.1M parameters)"})
    EXPECT_NE(help.output.find(line), std::string::npos) << line;
}

// --cross-entropy chunked (the loss fused with the output layer, issue 52) gives the losses of the
// whole logits' cross-entropy, for a tied Llama head (the embedding's unit fetched for it) under
// ZeRO-3 and a GPT one with a bias under ZeRO-1, with a lower activation peak each step (64 rows of a vocabulary of 8192 in chunks of at
// most 1 MiB: 2 chunks); auto is whole on the CPU, the same bits.
TEST(CoshardTrain, TheChunkedCrossEntropyGivesTheWholeLogitsLossesWithLessMemory) {
  const fs::path dir = scratch("chunked_ce");
  const std::vector<std::string> llama = {"--preset", "llama-tiny", "--layers", "1", "--dim", "32", "--heads", "4",
                                          "--kv-heads", "2", "--intermediate", "64", "--vocab", "8192", "--seq", "16",
                                          "--batch", "8", "--world-size", "2", "--steps", "6", "--lr", "1e-2",
                                          "--tie-embeddings"};
  const std::vector<std::string> gpt = {"--model", "gpt", "--layers", "1", "--dim", "32", "--heads", "4",
                                        "--vocab", "8192", "--seq", "16", "--batch", "8", "--world-size", "2",
                                        "--steps", "6", "--lr", "1e-2", "--zero-stage", "1"};
  // The validation loss (the engine's evaluate: a forward alone) goes the same way; samples need logits.
  const std::vector<std::string> checks = {"--eval-every", "3", "--sample-every", "3", "--sample-tokens", "4"};
  for (const auto& [name, base] : {std::pair{"llama", llama}, std::pair{"gpt", gpt}}) {
    SCOPED_TRACE(name);
    std::map<std::string, std::vector<nlohmann::json>> rows;
    for (const std::string kind : {"whole", "chunked", "auto"}) {
      // auto's choice (whole here, bit for bit) is a selection, no code of its own: not under a
      // sanitizer, where each of these runs takes some seconds.
      if (kSanitized && kind == "auto") continue;
      const fs::path metrics = dir / (std::string(name) + "-" + kind + ".jsonl");
      std::vector<std::string> args = with(base, {"--cross-entropy", kind, "--cross-entropy-chunk-mib", "1", "--metrics",
                                                  metrics.string()});
      args.insert(args.end(), checks.begin(), checks.end());
      const auto r = run(args, dir);
      EXPECT_NE(r.output.find("sample after step 3"), std::string::npos) << r.output;
      ASSERT_EQ(r.code, 0) << r.output;
      EXPECT_EQ(r.output.find("cross-entropy: fused with the output layer, in chunks of at most 1 MiB") != std::string::npos, kind == "chunked")
          << r.output;
      std::ifstream in(metrics);
      for (std::string line; std::getline(in, line);) rows[kind].push_back(nlohmann::json::parse(line));
      ASSERT_EQ(rows[kind].size(), 6u);
    }
    EXPECT_TRUE(rows["chunked"][2].contains("val_loss") && rows["chunked"][5].contains("val_loss"));
    for (std::size_t i = 0; i < 6; ++i) {
      const double whole = rows["whole"][i]["loss"].get<double>(), chunked = rows["chunked"][i]["loss"].get<double>();
      EXPECT_NEAR(chunked, whole, 1e-5 * whole) << "step " << i;
      if (!kSanitized) EXPECT_EQ(rows["auto"][i]["loss"], rows["whole"][i]["loss"]) << "step " << i;
      if (rows["whole"][i].contains("val_loss")) {
        const double v = rows["whole"][i]["val_loss"].get<double>();
        EXPECT_NEAR(rows["chunked"][i]["val_loss"].get<double>(), v, 1e-5 * v) << "step " << i;
      }
      // The whole logits and their gradient are 2 x 64 x 8192 x 4 bytes = 4 MiB; a chunk 1 MiB.
      EXPECT_LT(rows["chunked"][i]["peak_activation_bytes"].get<double>() + (2 << 20),
                rows["whole"][i]["peak_activation_bytes"].get<double>())
          << "step " << i;
    }
  }
  const auto bad = run(with(llama, {"--cross-entropy", "sliced"}), dir);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("--cross-entropy: sliced not in {auto,chunked,whole}"), std::string::npos) << bad.output;
  const auto lora = run(with(gpt, {"--cross-entropy", "chunked", "--lora-rank", "2", "--lora-targets", "head"}), dir);
  EXPECT_NE(lora.code, 0);
  EXPECT_NE(lora.output.find("cross_entropy=chunked"), std::string::npos) << lora.output;
  EXPECT_NE(lora.output.find("LoRA adapter(s)"), std::string::npos) << lora.output;
  const auto split = run(with(llama, {"--cross-entropy", "chunked", "--tensor-parallel", "2"}), dir);
  EXPECT_NE(split.code, 0);
  EXPECT_NE(split.output.find("cross_entropy=chunked with tensor_parallel_size=2"), std::string::npos) << split.output;
}

// --export FOLDER writes a Hugging Face Llama folder; --init FOLDER takes the model's shape from its
// config.json and its weights (an lr of 1e-30 keeps them: the second export holds the same tensors).
TEST(CoshardTrain, HuggingFaceFoldersGoOutAndComeBackIn) {
  const fs::path dir = scratch("hf");
  const auto first = run({"--preset", "llama-tiny", "--layers", "1", "--dim", "32", "--heads", "4", "--seq", "16",
                          "--batch", "4", "--steps", "3", "--world-size", "2", "--quiet", "--export", (dir / "out").string()},
                         dir);
  ASSERT_EQ(first.code, 0) << first.output;
  ASSERT_TRUE(fs::exists(dir / "out" / "config.json"));
  ASSERT_TRUE(fs::exists(dir / "out" / "model.safetensors"));
  const auto second = run({"--init", (dir / "out").string(), "--seq", "16", "--steps", "1", "--lr", "1e-30", "--weight-decay", "0",
                           "--world-size", "3", "--batch", "6", "--zero-stage", "1", "--export", (dir / "again").string()},
                          dir);
  ASSERT_EQ(second.code, 0) << second.output;
  EXPECT_NE(second.output.find("Llama from " + (dir / "out").string() + " (1 layers, dim 32, 4 heads (2 key/value)"),
            std::string::npos) << second.output;
  auto read = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(read(dir / "again" / "config.json"), read(dir / "out" / "config.json"));
  EXPECT_EQ(read(dir / "again" / "model.safetensors"), read(dir / "out" / "model.safetensors"));
  // Mistakes, named before anything runs.
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--init", (dir / "out").string(), "--preset", "llama-tiny"}, "--preset with --init"},
      {{"--init", (dir / "out").string(), "--dim", "64"}, "--dim with --init"},
      {{"--export", dir.string()}, "--export " + dir.string() + ": is a folder"},  // a GPT: a file
      {{"--init", (dir / "out").string(), "--export", (dir / "out").string()}, "lies inside --export"},
      {{"--init", dir.string()}, "config.json"},
  };
  for (const auto& [args, expected] : cases) {
    const auto r = run(with(args, {"--steps", "1"}), dir);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
  }
}

// --zero-stage 0 (plain data parallelism) trains as the sharded stages do, from the command line
// and from a DeepSpeed config's "stage": 0.
TEST(CoshardTrain, StageZeroTrainsLikeTheShardedStages) {
  const fs::path dir = scratch("stage0");
  std::map<std::string, std::vector<double>> losses;
  for (const std::string stage : {"0", "1", "3"}) {
    const fs::path metrics = dir / ("m" + stage + ".jsonl");
    const auto r = run(with(kTiny, {"--steps", "8", "--world-size", "2", "--zero-stage", stage, "--metrics", metrics.string()}), dir);
    ASSERT_EQ(r.code, 0) << r.output;
    losses[stage] = losses_in(metrics);
  }
  ASSERT_EQ(losses["0"].size(), 8u);
  for (const std::string stage : {"1", "3"})
    for (std::size_t i = 0; i < 8; ++i)
      EXPECT_NEAR(losses["0"][i], losses[stage][i], 1e-5 * std::abs(losses[stage][i])) << "stage " << stage << " step " << i;
  std::ofstream(dir / "ds.json") << R"({"zero_optimization": {"stage": 0}})";
  const fs::path metrics = dir / "config.jsonl";
  const auto r = run(with(kTiny, {"--steps", "8", "--world-size", "2", "--config", (dir / "ds.json").string(), "--metrics",
                                  metrics.string()}), dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(losses_in(metrics), losses["0"]);
}

// --log-level and COSHARD_LOG: each rank's debug lines of the component asked for, naming the
// rank; nothing of the components left at warn; a bad COSHARD_LOG is reported and ignored.
TEST(CoshardTrain, LogLevelsWriteEachRanksLines) {
  const fs::path dir = scratch("log_level");
  const auto r = run(with(kTiny, {"--steps", "2", "--world-size", "2", "--log-level", "warn,zero=debug"}), dir);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* rank : {"0", "1"}) {
    EXPECT_NE(r.output.find(std::string(" I zero [rank ") + rank + " reactor] engine: stage 3"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find(std::string(" D zero [rank ") + rank + " reactor] fetch unit "), std::string::npos)
        << r.output;
  }
  EXPECT_EQ(r.output.find(" D collectives "), std::string::npos) << r.output;

  ::setenv("COSHARD_LOG", "collectives=debug", 1);
  const auto from_env = run(with(kTiny, {"--steps", "1", "--world-size", "2"}), dir);
  ::setenv("COSHARD_LOG", "collectives=chatty", 1);
  const auto bad_env = run(with(kTiny, {"--steps", "1", "--world-size", "2"}), dir);
  ::unsetenv("COSHARD_LOG");
  ASSERT_EQ(from_env.code, 0) << from_env.output;
  EXPECT_NE(from_env.output.find(" D collectives [rank 1 reactor] launch #0 on "), std::string::npos) << from_env.output;
  EXPECT_EQ(from_env.output.find(" D zero "), std::string::npos) << from_env.output;
  ASSERT_EQ(bad_env.code, 0) << bad_env.output;
  EXPECT_NE(bad_env.output.find("level 'chatty' is not one of trace, debug, info, warn, error, off (ignored)"),
            std::string::npos)
      << bad_env.output;
  EXPECT_EQ(bad_env.output.find(" D collectives "), std::string::npos) << bad_env.output;
}

// --tensorboard: rank 0's event file in the folder (created), one record per step after the
// version; a folder that is a file is refused before anything runs.
TEST(CoshardTrain, TensorBoardFolderGetsAnEventFile) {
  const fs::path dir = scratch("tensorboard");
  const auto r = run(with(kTiny, {"--steps", "3", "--world-size", "2", "--tensorboard", (dir / "tb" / "run1").string()}), dir);
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir / "tb" / "run1")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].filename().string().rfind("events.out.tfevents.", 0), 0u) << files[0];
  EXPECT_GT(fs::file_size(files[0]), 3u * 16u);

  std::ofstream(dir / "plain.txt") << "keep me";
  const auto bad = run(with(kTiny, {"--steps", "1", "--tensorboard", (dir / "plain.txt").string()}), dir);
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--tensorboard"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("plain.txt"), std::string::npos) << bad.output;
  EXPECT_EQ(slurp(dir / "plain.txt"), "keep me");
}

// --flight-recorder: SIGUSR1 in the middle of a run makes both ranks write their rings and prints
// the diagnosis, and the run goes on; --flight-report reads the folder back.
TEST(CoshardTrain, FlightRecorderAnswersSigusr1AndReportsAFolder) {
  const fs::path dir = scratch("flight_sigusr1");
  const fs::path dumps = dir / "dumps";
  const fs::path out = dir / "out.txt";
  const pid_t pid = start(with(kTiny, {"--steps", "1000000", "--world-size", "2", "--flight-recorder", dumps.string(),
                                       "--metrics", (dir / "m.jsonl").string()}),
                          out);
  ASSERT_GT(pid, 0);
  // Once it trains (a metrics line), ask for the dump, and wait for both files.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline && (!fs::exists(dir / "m.jsonl") || fs::file_size(dir / "m.jsonl") == 0))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ::kill(pid, SIGUSR1);
  while (std::chrono::steady_clock::now() < deadline &&
         !(fs::exists(dumps / "rank0-of2.json") && fs::exists(dumps / "rank1-of2.json") &&
           slurp(out).find("diagnosis: ") != std::string::npos))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ::kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  const std::string output = slurp(out);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << "the dump did not end the run: " << output;
  EXPECT_NE(output.find("flight recorder: 2 ranks, records from 2\n"), std::string::npos) << output;
  EXPECT_NE(output.find("(SIGUSR1)\n"), std::string::npos) << output;
  EXPECT_NE(output.find("diagnosis: "), std::string::npos) << output;

  const auto report = run({"--flight-report", dumps.string()}, dir);
  EXPECT_EQ(report.code, 0) << report.output;
  EXPECT_NE(report.output.find("flight recorder: 2 ranks, records from 2"), std::string::npos) << report.output;
  fs::create_directories(dir / "empty");
  const auto empty = run({"--flight-report", (dir / "empty").string()}, dir);
  EXPECT_EQ(empty.code, 1) << empty.output;
  EXPECT_NE(empty.output.find("holds no rank's record"), std::string::npos) << empty.output;
  std::ofstream(dir / "plain.txt") << "keep me";
  const auto bad = run(with(kTiny, {"--steps", "1", "--flight-recorder", (dir / "plain.txt").string()}), dir);
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--flight-recorder"), std::string::npos) << bad.output;
  EXPECT_EQ(slurp(dir / "plain.txt"), "keep me");
}

// A rank that fails (rank 0 cannot write its metrics: a file-size limit) makes every rank's
// communicator write its ring as it fails, and the diagnosis follows the errors.
TEST(CoshardTrain, FlightRecorderDiagnosesAFailedRun) {
  const fs::path dir = scratch("flight_failed");
  const fs::path dumps = dir / "dumps";
  const auto r = run_with_file_limit(with(kTiny, {"--steps", "1000000", "--quiet", "--world-size", "2", "--metrics",
                                                  (dir / "m.jsonl").string(), "--flight-recorder", dumps.string()}),
                                     dir, 256 << 10);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("flight recorder: 2 ranks, records from 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(this rank failed: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("diagnosis: "), std::string::npos) << r.output;
  EXPECT_NE(slurp(dumps / "rank0-of2.json").find("\"reason\": \"this rank failed: --metrics"), std::string::npos);
  EXPECT_NE(slurp(dumps / "rank1-of2.json").find("\"reason\": \"rank 0 of Local group of 2 failed: --metrics"),
            std::string::npos)
      << slurp(dumps / "rank1-of2.json");
}

TEST(CoshardTrain, TakesADeepSpeedConfig) {
  const fs::path dir = scratch("config");
  std::ofstream(dir / "ds.json") << R"({"gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_bucket_size": 5e8}})";
  auto r = run(with(kTiny, {"--steps", "3", "--config", (dir / "ds.json").string()}), dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("ZeRO-2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("config note: zero_optimization.reduce_bucket_size"), std::string::npos) << r.output;
  std::ofstream(dir / "bad.json") << R"({"zero_optimization": {"stage": 3, "stage3_warp_drive": true}})";
  r = run(with(kTiny, {"--config", (dir / "bad.json").string()}), dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("stage3_warp_drive"), std::string::npos) << r.output;
}

// SIGKILL at random moments of a run that checkpoints every step; each time, --resume loads the
// last published checkpoint and trains on from it.
TEST(CoshardTrain, SurvivesSigkillDuringCheckpoints) {
  const fs::path dir = scratch("kill");
  const fs::path ck = dir / "ck";
  const auto base = with(kTiny, {"--world-size", "2", "--checkpoint-dir", ck.string(), "--checkpoint-every", "1",
                                 "--quiet"});
  // A first checkpoint to resume from.
  auto first = run(with(base, {"--steps", "2"}), dir);
  ASSERT_EQ(first.code, 0) << first.output;
  ASSERT_EQ(latest_step(ck), 2);

  std::mt19937 rng(12345);
  int killed_mid_run = 0;
  for (int round = 0; round < 6; ++round) {
    const pid_t pid = start(with(base, {"--steps", "100000", "--resume"}), dir / "killed.txt");
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng() % 400));
    ::kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    killed_mid_run += WIFSIGNALED(status) ? 1 : 0;
    const std::int64_t at = latest_step(ck);
    ASSERT_GE(at, 2) << "round " << round;
    // The checkpoint `latest` names loads, and training goes on from it.
    auto resumed = run(with(base, {"--steps", std::to_string(at + 1), "--resume"}), dir);
    ASSERT_EQ(resumed.code, 0) << "round " << round << ", latest step " << at << ": " << resumed.output;
    EXPECT_EQ(latest_step(ck), at + 1);
  }
  EXPECT_EQ(killed_mid_run, 6);
}

// A save that hits a full disk fails the run with an error naming the file, and the previous
// checkpoint stays the one `latest` names, and loads.
TEST(CoshardTrain, FullDiskDuringSaveKeepsThePreviousCheckpoint) {
  const fs::path dir = scratch("full");
  const fs::path ck = dir / "ck";
  const auto base = with(kTiny, {"--world-size", "2", "--checkpoint-dir", ck.string(), "--checkpoint-every", "2"});
  auto first = run(with(base, {"--steps", "2"}), dir);
  ASSERT_EQ(first.code, 0) << first.output;
  ASSERT_EQ(latest_step(ck), 2);
  const auto rank_file_bytes = fs::file_size(ck / "step-00000002" / "rank-00000.safetensors");
  // Room for small files (the manifest, output), not for a rank file.
  auto full = run_with_file_limit(with(base, {"--steps", "4", "--resume"}), dir, rank_file_bytes / 2 / 4096 * 4096);
  EXPECT_NE(full.code, 0) << full.output;
  EXPECT_NE(full.output.find("rank-0000"), std::string::npos) << full.output;
  EXPECT_NE(full.output.find("File too large"), std::string::npos) << full.output;
  EXPECT_EQ(latest_step(ck), 2);
  auto resumed = run(with(base, {"--steps", "4", "--resume"}), dir);
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_EQ(latest_step(ck), 4);
}

}  // namespace
