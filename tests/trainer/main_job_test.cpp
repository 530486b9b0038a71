// The quick start's main job (scripts/run.sh): coshard-train learning the text the repository
// ships. Its first 40 steps, with the job's model and settings at half its batch (kept cheap for
// the sanitizer builds): the loss leaves the level of letters drawn by their frequency, and the
// sample continues the prompt.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "binary_harness.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

TEST(MainJob, LearnsTheTextTheRepositoryShips) {
  const fs::path dir = scratch("main_job");
  const fs::path metrics = dir / "metrics.jsonl";
  const auto r = run({"--data", COSHARD_MAIN_JOB_TEXT, "--layers", "2", "--dim", "64", "--heads", "4", "--seq", "128",
                      "--batch", "16", "--steps", "40", "--lr", "0.01", "--warmup", "30", "--sample-every", "40",
                      "--prompt", "The engine ", "--sample-tokens", "40", "--temperature", "0.8", "--metrics",
                      metrics.string()},
                     dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("data/coshard_docs.txt (68703 bytes, vocab 256)"), std::string::npos) << r.output;
  const auto losses = losses_in(metrics);
  ASSERT_EQ(losses.size(), 40u);
  // (ln 256 = 5.55 at the start; letters drawn by their frequency in this text: 3.37 nats)
  EXPECT_GT(losses.front(), 5.0);
  EXPECT_LT(*std::min_element(losses.end() - 10, losses.end()), 3.3) << r.output;
  const auto sample = r.output.find("sample after step 40 (temperature 0.80): \"The engine \" -> \"");
  ASSERT_NE(sample, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("sample after step 40", sample + 1), std::string::npos) << "one sample, not two: " << r.output;
}

}  // namespace
