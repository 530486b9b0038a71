// The quick start's main job (scripts/run.sh): coshard-train learning the text the repository
// ships. Its first 40 steps, with the job's model and settings at half its batch (kept cheap for
// the sanitizer builds): the loss leaves the level of letters drawn by their frequency, and the
// sample continues the prompt.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "binary_harness.hpp"
#include "support/sanitizers.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

// Under a sanitizer the run is 4 steps of a shorter sequence (the same code, a quarter of the
// tokens: it took 65 s under TSan); the learning is checked by the normal build's 40 steps.
TEST(MainJob, LearnsTheTextTheRepositoryShips) {
  const fs::path dir = scratch("main_job");
  const fs::path metrics = dir / "metrics.jsonl";
  const std::string steps = kSanitized ? "4" : "40";
  const auto r = run({"--data", COSHARD_MAIN_JOB_TEXT, "--layers", "2", "--dim", "64", "--heads", "4", "--seq",
                      kSanitized ? "32" : "128", "--batch", kSanitized ? "4" : "16", "--steps", steps, "--lr", "0.01",
                      "--warmup", kSanitized ? "2" : "30", "--sample-every", steps, "--prompt", "The engine ",
                      "--sample-tokens", kSanitized ? "8" : "40", "--temperature", "0.8", "--metrics", metrics.string()},
                     dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("data/coshard_docs.txt (68703 bytes, vocab 256)"), std::string::npos) << r.output;
  const auto losses = losses_in(metrics);
  ASSERT_EQ(losses.size(), static_cast<std::size_t>(std::stoi(steps)));
  // (ln 256 = 5.55 at the start; letters drawn by their frequency in this text: 3.37 nats)
  EXPECT_GT(losses.front(), 5.0);
  if (!kSanitized) EXPECT_LT(*std::min_element(losses.end() - 10, losses.end()), 3.3) << r.output;
  const std::string sample_line = "sample after step " + steps + " (temperature 0.80): \"The engine \" -> \"";
  const auto sample = r.output.find(sample_line);
  ASSERT_NE(sample, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("sample after step " + steps, sample + 1), std::string::npos) << "one sample, not two: " << r.output;
}

}  // namespace
