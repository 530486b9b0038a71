// Deeply nested JSON (issue 33, item 3): every reader of outside JSON refuses more than
// kMaxJsonDepth levels by name before parsing, where printing the bad value in its error used to
// recurse once per level and overflow the stack (a 200 KB file of depth 100,000 killed eight
// readers with SIGSEGV); and a long bad value is echoed cut, not whole.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "coshard/async/json_limits.hpp"
#include "coshard/collectives/flight_recorder.hpp"
#include "coshard/modules/safetensors.hpp"
#include "coshard/modules/safetensors_folder.hpp"
#include "coshard/trainer/config.hpp"
#include "coshard/zero/checkpoint.hpp"
#include "coshard/zero/hf_llama.hpp"

namespace coshard {
namespace {

namespace fs = std::filesystem;

std::string deep(int levels) { return std::string(static_cast<std::size_t>(levels), '[') + std::string(static_cast<std::size_t>(levels), ']'); }
const std::string kDeep = deep(100000);

void expect_depth_refused(const Error& e) {
  EXPECT_NE(e.message().find("JSON nested deeper than 64 levels"), std::string::npos) << e.message().substr(0, 300);
  EXPECT_LT(e.message().size(), 400u) << "the message echoes the value";
}

TEST(DeepJson, TheNestingScanCountsOnlyBracketsOutsideStringsAndComments) {
  EXPECT_TRUE(async::check_json_nesting(deep(64), "x"));
  EXPECT_FALSE(async::check_json_nesting(deep(65), "x"));
  EXPECT_TRUE(async::check_json_nesting("{\"a\": \"" + std::string(1000, '[') + "\\\"[[\"}", "x"));
  EXPECT_TRUE(async::check_json_nesting("// " + std::string(1000, '{') + "\n/* " + std::string(1000, '[') + " */ {}", "x"));
  auto refused = async::check_json_nesting("{\"a\": " + kDeep + "}", "d.json");
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("d.json: JSON nested deeper than 64 levels (at byte 69)"), std::string::npos)
      << refused.error().message();
}

TEST(DeepJson, EveryReaderRefusesItByName) {
  for (const std::string key : {"vocab_size", "hidden_act", "rope_scaling"}) {
    auto r = zero::parse_hf_llama_config("{\"model_type\": \"llama\", \"" + key + "\": " + kDeep + "}", "config.json");
    ASSERT_FALSE(r) << key;
    expect_depth_refused(r.error());
  }
  auto ds = trainer::TrainerConfig::from_json("{\"gradient_clipping\": " + kDeep + "}", {});
  ASSERT_FALSE(ds);
  expect_depth_refused(ds.error());
  auto manifest = zero::parse_checkpoint_manifest("{\"format\": " + kDeep + "}", "manifest.json");
  ASSERT_FALSE(manifest);
  expect_depth_refused(manifest.error());
  auto record = collectives::parse_flight_record("{\"rank\": " + kDeep + "}", "rank0-of2.json");
  ASSERT_FALSE(record);
  expect_depth_refused(record.error());
  // A safetensors header.
  const std::string header = "{\"t\": " + kDeep + "}";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[static_cast<std::size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file += header;
  std::vector<std::byte> bytes(file.size());
  std::memcpy(bytes.data(), file.data(), file.size());
  auto st = modules::SafetensorsFile::parse(std::move(bytes), "deep.safetensors");
  ASSERT_FALSE(st);
  expect_depth_refused(st.error());
  // A shard index's weight_map.
  const fs::path dir = fs::current_path() / "deep_json_scratch";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "model.safetensors.index.json") << "{\"weight_map\": {\"w\": " << kDeep << "}}";
  auto index = modules::SafetensorsFolder::files_of(dir);
  ASSERT_FALSE(index);
  expect_depth_refused(index.error());
}

TEST(DeepJson, ALongBadValueIsEchoedCut) {
  auto r = zero::parse_hf_llama_config("{\"model_type\": \"llama\", \"hidden_act\": \"" + std::string(1 << 20, 'x') + "\"}",
                                       "config.json");
  ASSERT_FALSE(r);
  EXPECT_LT(r.error().message().size(), 400u);
  EXPECT_NE(r.error().message().find("characters)"), std::string::npos) << r.error().message();
  auto ds = trainer::TrainerConfig::from_json("{\"gradient_clipping\": \"" + std::string(1 << 20, 'y') + "\"}", {});
  ASSERT_FALSE(ds);
  EXPECT_LT(ds.error().message().size(), 400u);
}

}  // namespace
}  // namespace coshard
