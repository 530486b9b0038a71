// coshard-train against a hostile user, round three (issue 33): each case as the report gave it,
// asserting the named error, an exit status below 128, the inputs unchanged, and a time bound.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "binary_harness.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

const std::vector<std::string> kQuick = with(kTiny, {"--steps", "2", "--quiet"});
const std::vector<std::string> kLlama = {"--preset", "llama-tiny", "--layers", "1", "--dim", "32", "--heads", "4",
                                         "--seq", "16", "--batch", "4", "--steps", "2", "--quiet"};

// Item 2: a link planted under the name the export's temporary once had is not written through,
// and a fifo of that name does not block the export.
TEST(HardeningThree, ExportNeverWritesThroughAPlantedTemporary) {
  const fs::path dir = scratch("h3_planted");
  const fs::path out = dir / "ex";
  fs::create_directories(out);
  std::ofstream(dir / "victim") << "precious";
  fs::create_symlink(dir / "victim", out / "config.json.tmp");
  ASSERT_EQ(::mkfifo((out / "model.safetensors.tmp").c_str(), 0644), 0);
  const auto start = std::chrono::steady_clock::now();
  const auto r = run(with(kLlama, {"--export", out.string()}), dir);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_LT(seconds, 60.0);
  EXPECT_EQ(slurp(dir / "victim"), "precious");
  EXPECT_TRUE(fs::is_symlink(out / "config.json.tmp"));
  EXPECT_TRUE(fs::is_fifo(out / "model.safetensors.tmp"));
  EXPECT_NE(slurp(out / "config.json").find("hidden_size"), std::string::npos);
}

}  // namespace
