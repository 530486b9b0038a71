// coshard-train for fine-tuning: --freeze keeps the matched parameters bit for bit, the rest
// trains; --no-decay-vectors is accepted; a pattern that matches nothing is named.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "coshard/modules/safetensors.hpp"
#include "binary_harness.hpp"

namespace coshard::testing {
namespace {

// Every tensor of a safetensors file, by name, as its raw bytes.
std::map<std::string, std::vector<std::byte>> tensors_in(const fs::path& path) {
  std::map<std::string, std::vector<std::byte>> out;
  auto file = modules::SafetensorsFile::load(path);
  EXPECT_TRUE(file) << file.error().message();
  if (!file) return out;
  for (const auto& t : file->tensors()) {
    const auto bytes = file->data(t);
    out[t.name] = std::vector<std::byte>(bytes.begin(), bytes.end());
  }
  return out;
}

// kTiny's shape without its learning rate.
const std::vector<std::string> kShape(kTiny.begin(), kTiny.end() - 2);

TEST(CoshardTrainFineTuning, FrozenParametersKeepTheirInitialBitsAndTheRestTrains) {
  const fs::path dir = scratch("freeze");
  // The initial weights: a run with every parameter frozen.
  const auto initial = run(with(kTiny, {"--steps", "2", "--world-size", "2", "--freeze", "*", "--quiet", "--export",
                                        (dir / "initial.safetensors").string()}),
                           dir);
  ASSERT_EQ(initial.code, 0) << initial.output;
  for (const std::string stage : {"0", "2", "3"}) {
    SCOPED_TRACE("stage " + stage);
    const fs::path out = dir / ("tuned" + stage + ".safetensors");
    const auto tuned = run(with(kShape, {"--lr", "0.01", "--steps", "4", "--world-size", "2", "--zero-stage", stage, "--quiet",
                                        "--freeze", "embed.*", "--freeze", "h0.attn.*", "--no-decay-vectors",
                                        "--export", out.string()}),
                           dir);
    ASSERT_EQ(tuned.code, 0) << tuned.output;
    const auto before = tensors_in(dir / "initial.safetensors"), after = tensors_in(out);
    ASSERT_EQ(before.size(), after.size());
    int frozen = 0, trained = 0;
    for (const auto& [name, bytes] : before) {
      const bool is_frozen = name.starts_with("embed.") || name.starts_with("h0.attn.");
      if (is_frozen) {
        ++frozen;
        EXPECT_EQ(after.at(name), bytes) << name << " moved although frozen";
      } else if (after.at(name) != bytes) {
        ++trained;
      }
    }
    EXPECT_GT(frozen, 0);
    EXPECT_GT(trained, 0) << "nothing trained";
  }
}

// --estimate with --freeze counts the frozen units' parameters alone and says so.
TEST(CoshardTrainFineTuning, TheEstimateCountsFrozenUnitsWithoutGradientsOrOptimizerState) {
  const fs::path dir = scratch("freeze_estimate");
  auto device_total = [](const std::string& output) -> std::string {
    const auto at = output.find("  device");
    return at == std::string::npos ? std::string() : output.substr(at, output.find('\n', at) - at);
  };
  const auto all = run(with(kTiny, {"--estimate"}), dir);
  const auto half = run(with(kTiny, {"--estimate", "--freeze", "embed.*", "--freeze", "h0.*"}), dir);
  ASSERT_EQ(all.code, 0) << all.output;
  ASSERT_EQ(half.code, 0) << half.output;
  EXPECT_EQ(all.output.find("frozen:"), std::string::npos) << all.output;
  EXPECT_NE(half.output.find("frozen:"), std::string::npos) << half.output;
  EXPECT_NE(device_total(all.output), device_total(half.output)) << all.output << half.output;
  const auto typo = run(with(kTiny, {"--estimate", "--freeze", "encoder.*"}), dir);
  EXPECT_GT(typo.code, 0) << typo.output;
  EXPECT_LT(typo.code, 128) << typo.output;
  EXPECT_NE(typo.output.find("'encoder.*' matches no parameter"), std::string::npos) << typo.output;
}

TEST(CoshardTrainFineTuning, APatternThatMatchesNothingIsNamed) {
  const fs::path dir = scratch("freeze_typo");
  const auto r = run(with(kTiny, {"--steps", "2", "--quiet", "--freeze", "encoder.*"}), dir);
  EXPECT_GT(r.code, 0) << r.output;
  EXPECT_LT(r.code, 128) << r.output;
  EXPECT_NE(r.output.find("'encoder.*' matches no parameter"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace coshard::testing
