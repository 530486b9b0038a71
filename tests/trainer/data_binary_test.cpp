// coshard-train's data and samples (#35 items 1 to 3): validation (--val-data, --eval-every, --eval-batches,
// and the config file's eval_every / eval_batches: the validation loss in the progress lines and
// the metrics on the steps that evaluate and after the last one; the synthetic task's held-out
// draws; every misuse named before anything trains), and token data in several files (a glob or
// a list read as one stream; a resume mid-shard exact; changed or missing shards named).
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "binary_harness.hpp"

namespace coshard::testing {
namespace {

// Text for --data and --val-data: the same kind of text, different lines.
void write_text(const fs::path& path, int seed) {
  std::ofstream out(path);
  for (int i = 0; i < 400; ++i) out << "line " << (i * 7 + seed) % 97 << " of the corpus, number " << seed << "\n";
}

// step -> val_loss of every metrics line that has one.
std::map<int, double> val_losses_in(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string line;
  std::map<int, double> out;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) out[j["step"].get<int>()] = j["val_loss"].get<double>();
  }
  return out;
}

const std::vector<std::string> kTextShape = without(kTiny, "--vocab");

TEST(CoshardTrainValidation, EveryNStepsAndAfterTheLastInTheProgressAndTheMetrics) {
  const fs::path dir = scratch("validation_every");
  write_text(dir / "train.txt", 1);
  write_text(dir / "val.txt", 2);
  const auto r = run(with(kTextShape, {"--steps", "5", "--data", (dir / "train.txt").string(), "--val-data",
                                       (dir / "val.txt").string(), "--eval-every", "2", "--eval-batches", "2",
                                       "--metrics", (dir / "m.jsonl").string()}),
                     dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("validation: "), std::string::npos) << r.output;
  for (const char* step : {" after step 2\n", " after step 4\n", " after step 5\n"})
    EXPECT_NE(r.output.find(step), std::string::npos) << step << " in\n" << r.output;
  EXPECT_EQ(r.output.find(" after step 3\n"), std::string::npos) << r.output;
  const auto vals = val_losses_in(dir / "m.jsonl");
  ASSERT_EQ(vals.size(), 3u) << slurp(dir / "m.jsonl");
  for (const int step : {2, 4, 5}) {
    ASSERT_TRUE(vals.contains(step)) << step;
    EXPECT_GT(vals.at(step), 0.0);
    EXPECT_LT(vals.at(step), 10.0);
  }
  EXPECT_EQ(losses_in(dir / "m.jsonl").size(), 5u);

  // The same through a config file's keys, and the same numbers (the same batches, the same weights).
  {
    std::ofstream cfg(dir / "ds.json");
    cfg << R"({"eval_every": 2, "eval_batches": 2})";
  }
  const auto c = run(with(kTextShape, {"--steps", "5", "--data", (dir / "train.txt").string(), "--val-data",
                                       (dir / "val.txt").string(), "--config", (dir / "ds.json").string(),
                                       "--metrics", (dir / "c.jsonl").string(), "--quiet"}),
                     dir);
  ASSERT_EQ(c.code, 0) << c.output;
  EXPECT_EQ(val_losses_in(dir / "c.jsonl"), vals);
  // And at another world size: the same batches, the same mean (within the order of sums).
  const auto w = run(with(kTextShape, {"--steps", "5", "--data", (dir / "train.txt").string(), "--val-data",
                                       (dir / "val.txt").string(), "--eval-every", "2", "--eval-batches", "2",
                                       "--world-size", "3", "--metrics", (dir / "w.jsonl").string(), "--quiet"}),
                     dir);
  ASSERT_EQ(w.code, 0) << w.output;
  const auto at3 = val_losses_in(dir / "w.jsonl");
  ASSERT_EQ(at3.size(), 3u);
  for (const auto& [step, v] : vals) EXPECT_NEAR(at3.at(step), v, 1e-5 * v) << "step " << step;
}

TEST(CoshardTrainValidation, TheSyntheticTaskValidatesOnHeldOutDraws) {
  const fs::path dir = scratch("validation_synthetic");
  const auto r = run(with(kTiny, {"--steps", "4", "--eval-every", "2", "--metrics", (dir / "m.jsonl").string()}), dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("validation: held-out draws of the same task"), std::string::npos) << r.output;
  const auto vals = val_losses_in(dir / "m.jsonl");
  EXPECT_EQ(vals.size(), 2u);
  EXPECT_TRUE(vals.contains(2) && vals.contains(4));
}

TEST(CoshardTrainValidation, MisuseIsNamedBeforeAnythingTrains) {
  const fs::path dir = scratch("validation_misuse");
  write_text(dir / "train.txt", 1);
  const std::string train = (dir / "train.txt").string();
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  {
    std::ofstream ids(dir / "val.bin", std::ios::binary);
    for (std::uint16_t i = 0; i < 200; ++i) ids.write(reinterpret_cast<const char*>(&i), 2);
  }
  ASSERT_EQ(::mkfifo((dir / "val.fifo").c_str(), 0600), 0);
  const std::vector<Case> cases = {
      {{"--data", train, "--eval-every", "2"}, "--eval-every without --val-data"},
      {{"--data", train, "--eval-batches", "3"}, "--eval-batches without --val-data"},
      {{"--val-data", train}, "--val-data without --data"},
      {{"--data", train, "--val-data", (dir / "val.bin").string()}, "is read as token ids and --data"},
      {{"--data", train, "--val-data", (dir / "missing.txt").string()}, "--val-data"},
      {{"--data", train, "--val-data", (dir / "val.fifo").string()}, "--val-data"},
      {{"--data", train, "--val-data", train, "--eval-batches", "0"}, "--eval-batches"},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.args.back());
    const auto r = run(with(with(kTextShape, {"--steps", "2", "--metrics", (dir / "m.jsonl").string()}), k.args), dir);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(k.says), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "m.jsonl")) << "trained although refused";
  }
  std::ofstream(dir / "bad.json") << R"({"eval_batches": 0})";
  const auto r = run(with(kTextShape, {"--steps", "2", "--data", train, "--val-data", train, "--config",
                                       (dir / "bad.json").string()}),
                     dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("eval_batches=0"), std::string::npos) << r.output;
}

TEST(CoshardTrainShards, AResumeMidShardIsExactAndChangedOrMissingShardsAreNamed) {
  const fs::path dir = scratch("shards");
  // Three shards of a task with structure (each id followed by a fixed next one, mostly).
  for (int k = 0; k < 3; ++k) {
    std::vector<std::uint16_t> ids;
    std::uint16_t id = static_cast<std::uint16_t>(k + 1);
    for (int i = 0; i < 300; ++i) {
      ids.push_back(id);
      id = static_cast<std::uint16_t>(i % 11 == 0 ? (id * 5 + k) % 32 : (id * 7 + 3) % 32);
    }
    write_llmc(dir / ("train_00" + std::to_string(k) + ".bin"), ids);
  }
  const std::string glob = (dir / "train_*.bin").string();
  const auto straight = run(with(kTiny, {"--steps", "6", "--data", glob, "--metrics", (dir / "straight.jsonl").string()}),
                            dir);
  ASSERT_EQ(straight.code, 0) << straight.output;
  EXPECT_NE(straight.output.find("3 files read as one stream of 900 tokens"), std::string::npos) << straight.output;
  const std::string ck = (dir / "ck").string();
  const auto first = run(with(kTiny, {"--steps", "3", "--data", glob, "--checkpoint-dir", ck, "--checkpoint-every", "3",
                                      "--metrics", (dir / "resumed.jsonl").string(), "--quiet"}),
                         dir);
  ASSERT_EQ(first.code, 0) << first.output;
  // The same files as a list: the same data.
  const auto second = run(with(kTiny, {"--steps", "6", "--data", (dir / "train_000.bin").string(),
                                       (dir / "train_001.bin").string(), (dir / "train_002.bin").string(),
                                       "--checkpoint-dir", ck, "--resume", "--metrics", (dir / "resumed.jsonl").string(),
                                       "--quiet"}),
                          dir);
  ASSERT_EQ(second.code, 0) << second.output;
  EXPECT_EQ(losses_in(dir / "resumed.jsonl"), losses_in(dir / "straight.jsonl"));

  // A shard changed since the checkpoint: a different run, named.
  {
    std::fstream f(dir / "train_001.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1024 + 100);
    const std::uint16_t other = 31;
    f.write(reinterpret_cast<const char*>(&other), 2);
  }
  const auto changed = run(with(kTiny, {"--steps", "8", "--data", glob, "--checkpoint-dir", ck, "--resume", "--quiet"}),
                           dir);
  EXPECT_GT(changed.code, 0) << changed.output;
  EXPECT_LT(changed.code, 128) << changed.output;
  EXPECT_NE(changed.output.find("a different run (data"), std::string::npos) << changed.output;
  // A shard gone: the glob now matches two, a different run; named as a file when listed.
  fs::remove(dir / "train_002.bin");
  const auto gone = run(with(kTiny, {"--steps", "8", "--data", (dir / "train_000.bin").string(),
                                     (dir / "train_002.bin").string(), "--quiet"}),
                        dir);
  EXPECT_EQ(gone.code, 2) << gone.output;
  EXPECT_NE(gone.output.find("train_002.bin"), std::string::npos) << gone.output;
  const auto none = run(with(kTiny, {"--steps", "2", "--data", (dir / "nothing_*.bin").string(), "--quiet"}), dir);
  EXPECT_EQ(none.code, 2) << none.output;
  EXPECT_NE(none.output.find("matches no file"), std::string::npos) << none.output;
}

// #48 item 8: 3,000 shards (the data's identity listed every file and passed what a checkpoint's
// run identity may hold, so every checkpoint was written and then refused by --resume): the
// checkpoint resumes exactly, and a shard changed in the middle of the list is still a different run.
TEST(CoshardTrainShards, ThreeThousandShardsResumeAndAChangedOneIsStillNamed) {
  const fs::path dir = scratch("many_shards");
  for (int k = 0; k < 3000; ++k) {
    std::vector<std::uint16_t> ids;
    for (int i = 0; i < 40; ++i) ids.push_back(static_cast<std::uint16_t>((k * 13 + i * 7) % 32));
    char name[32];
    std::snprintf(name, sizeof name, "train_%05d.bin", k);
    write_llmc(dir / name, ids);
  }
  const std::string glob = (dir / "train_*.bin").string();
  const auto straight = run(with(kTiny, {"--steps", "4", "--data", glob, "--metrics", (dir / "straight.jsonl").string(),
                                         "--quiet"}),
                            dir);
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::string ck = (dir / "ck").string();
  const auto first = run(with(kTiny, {"--steps", "2", "--data", glob, "--checkpoint-dir", ck, "--checkpoint-every", "2",
                                      "--metrics", (dir / "resumed.jsonl").string(), "--quiet"}),
                         dir);
  ASSERT_EQ(first.code, 0) << first.output;
  const auto second = run(with(kTiny, {"--steps", "4", "--data", glob, "--checkpoint-dir", ck, "--resume", "--metrics",
                                       (dir / "resumed.jsonl").string(), "--quiet"}),
                          dir);
  ASSERT_EQ(second.code, 0) << second.output;
  EXPECT_EQ(losses_in(dir / "resumed.jsonl"), losses_in(dir / "straight.jsonl"));
  {
    std::fstream f(dir / "train_01500.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1024 + 10);
    const std::uint16_t other = 31;
    f.write(reinterpret_cast<const char*>(&other), 2);
  }
  const auto changed = run(with(kTiny, {"--steps", "6", "--data", glob, "--checkpoint-dir", ck, "--resume", "--quiet"}),
                           dir);
  EXPECT_GT(changed.code, 0) << changed.output;
  EXPECT_LT(changed.code, 128) << changed.output;
  EXPECT_NE(changed.output.find("a different run (data"), std::string::npos) << changed.output;
  fs::remove_all(dir);
}

// Samples: every N steps and after the last, greedy the same at another world size and stage,
// --steps 0 from --init; misuse named.
TEST(CoshardTrainSamples, EveryNStepsAfterTheLastAndFromInitWithStepsZero) {
  const fs::path dir = scratch("samples");
  write_text(dir / "train.txt", 1);
  const std::string model = (dir / "model.safetensors").string();
  const auto r = run(with(kTextShape, {"--steps", "4", "--data", (dir / "train.txt").string(),
                                       "--sample-every", "2", "--prompt", "li", "--sample-tokens", "6",
                                       "--temperature", "0", "--export", model}),
                     dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("sample after step 2 (greedy): \"li\" -> \""), std::string::npos) << r.output;
  const auto last = r.output.find("sample after step 4 (greedy): ");
  ASSERT_NE(last, std::string::npos) << r.output;
  const std::string line = r.output.substr(last, r.output.find('\n', last) - last);
  // From the exported weights, at another world size and stage: the same greedy text.
  const auto again = run(with(kTextShape, {"--steps", "0", "--data", (dir / "train.txt").string(),
                                           "--init", model, "--prompt", "li", "--sample-tokens", "6",
                                           "--temperature", "0", "--world-size", "3", "--zero-stage", "2", "--quiet"}),
                         dir);
  ASSERT_EQ(again.code, 0) << again.output;
  const auto at = again.output.find("sample after step 0 (greedy): ");
  ASSERT_NE(at, std::string::npos) << again.output;
  EXPECT_EQ(again.output.substr(at + 20, again.output.find('\n', at) - at - 20), line.substr(20)) << again.output;
  // Token ids on the synthetic task, sampled at a temperature with top-k.
  const auto ids = run(with(kTiny, {"--steps", "2", "--prompt-ids", "1,2,3", "--sample-tokens", "5", "--temperature", "0.8", "--top-k", "5"}), dir);
  ASSERT_EQ(ids.code, 0) << ids.output;
  EXPECT_NE(ids.output.find("sample after step 2 (temperature 0.80, top-k 5): [1 2 3] -> "), std::string::npos)
      << ids.output;
}

TEST(CoshardTrainSamples, MisuseIsNamed) {
  const fs::path dir = scratch("samples_misuse");
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--steps", "0"}, "--steps 0 trains nothing"},
      {{"--steps", "1", "--prompt", "a", "--prompt-ids", "1"}, "--prompt and --prompt-ids: give one"},
      {{"--steps", "1", "--prompt-ids", "1,x"}, "'x' is not a token id"},
      {{"--steps", "1", "--prompt-ids", "1,,2"}, "'' is not a token id"},
      {{"--steps", "1", "--prompt-ids", "40"}, "--prompt-ids: token 0 is id 40, not below the model's vocabulary of 32"},
      {{"--steps", "1", "--prompt", "a"}, "--prompt: token 0 is byte 97, not below the model's vocabulary of 32"},
      {{"--steps", "1", "--prompt", ""}, "an empty prompt"},
      {{"--steps", "1", "--prompt-ids", "1", "--temperature", "-1"}, "--temperature"},
      {{"--steps", "1", "--prompt-ids", "1", "--sample-tokens", "0"}, "--sample-tokens"},
      {{"--steps", "1", "--prompt-ids", "1", "--top-k", "-3"}, "--top-k"},
      {{"--steps", "1", "--prompt-ids", "1,2,3", "--sample-tokens", "6"},
       "a sample of 3 prompt tokens and --sample-tokens 6 needs 9 positions, and the GPT has 8 (--seq)"},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.args.back());
    const auto r = run(with(with(kTiny, {"--quiet", "--metrics", (dir / "m.jsonl").string()}), k.args), dir);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_FALSE(fs::exists(dir / "m.jsonl")) << "trained although refused";
    EXPECT_NE(r.output.find(k.says), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace coshard::testing
