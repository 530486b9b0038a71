#include "coshard/modules/safetensors.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace coshard::modules {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  fs::path dir = fs::path(::testing::TempDir()) / ("safetensors_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

// A file built by hand from the format's definition (what PyTorch's safetensors writes).
std::vector<std::byte> file_of(const std::string& header, const std::vector<std::uint8_t>& data) {
  std::vector<std::byte> out(8);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::byte>(n >> (8 * i));
  for (char c : header) out.push_back(static_cast<std::byte>(c));
  for (std::uint8_t b : data) out.push_back(static_cast<std::byte>(b));
  return out;
}

std::vector<std::uint8_t> bytes(std::size_t n, std::uint8_t seed = 1) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(seed + i * 7);
  return v;
}

TEST(Safetensors, ReadsAFileWrittenToTheSpecification) {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}})";
  auto file = SafetensorsFile::parse(file_of(header, bytes(22)), "hand-made");
  ASSERT_TRUE(file.has_value()) << file.error().message();
  ASSERT_EQ(file->tensors().size(), 2u);
  const SafeTensorInfo* w = file->find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, SafeDType::f32);
  EXPECT_EQ(w->shape, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(file->data(*w).size(), 16u);
  EXPECT_EQ(static_cast<std::uint8_t>(file->data(*file->find("b"))[0]), bytes(22)[16]);
  EXPECT_EQ(file->metadata().at("format"), "pt");
}

TEST(Safetensors, RoundTripsThroughDiskBitExact) {
  const fs::path path = temp_dir() / "model.safetensors";
  std::vector<float> w(1001);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.37f - 5.0f;
  std::vector<std::uint16_t> h(17, 0x3C00);
  std::vector<std::int64_t> ids{1, -2, 3};
  std::vector<SafeTensorView> views{
      {"layer.0.weight", SafeDType::f32, {7, 143}, std::as_bytes(std::span(w))},
      {"layer.0.bias", SafeDType::f16, {17}, std::as_bytes(std::span(h))},
      {"ids", SafeDType::i64, {3}, std::as_bytes(std::span(ids))},
      {"empty", SafeDType::bf16, {0, 4}, {}},
  };
  ASSERT_TRUE(save_safetensors(path, views, {{"producer", "coshard"}}));
  EXPECT_FALSE(fs::exists(path.string() + ".tmp." + std::to_string(::getpid()))) << "temporary file left behind";
  auto file = SafetensorsFile::load(path);
  ASSERT_TRUE(file.has_value()) << file.error().message();
  EXPECT_EQ(file->metadata().at("producer"), "coshard");
  for (const auto& v : views) {
    const SafeTensorInfo* t = file->find(v.name);
    ASSERT_NE(t, nullptr) << v.name;
    EXPECT_EQ(t->dtype, v.dtype);
    EXPECT_EQ(t->shape, v.shape);
    auto d = file->data(*t);
    ASSERT_EQ(d.size(), v.data.size());
    if (!d.empty()) EXPECT_EQ(std::memcmp(d.data(), v.data.data(), d.size()), 0) << v.name;  // memcmp(null, ...) is UB
  }
  // The header is padded so the data section starts 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  std::uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
}

void expect_refused(const std::string& header, const std::vector<std::uint8_t>& data, const std::string& needle) {
  auto file = SafetensorsFile::parse(file_of(header, data), "bad.safetensors");
  ASSERT_FALSE(file.has_value()) << "accepted: " << header;
  EXPECT_EQ(file.error().code(), ErrorCode::invalid_argument);
  EXPECT_NE(file.error().message().find(needle), std::string::npos) << file.error().message();
  EXPECT_NE(file.error().message().find("bad.safetensors"), std::string::npos);
}

TEST(Safetensors, RefusesUnknownDtypes) {
  expect_refused(R"({"x":{"dtype":"F17","shape":[1],"data_offsets":[0,4]}})", bytes(4), "unknown dtype 'F17'");
}

TEST(Safetensors, RefusesTruncatedData) {
  expect_refused(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", bytes(10), "outside the data section of 10 bytes");
}

TEST(Safetensors, RefusesAHeaderLengthPastTheEnd) {
  auto f = file_of(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", bytes(1));
  f[0] = std::byte{0xFF};  // header length now far past the end
  f[1] = std::byte{0xFF};
  auto file = SafetensorsFile::parse(f, "bad.safetensors");
  ASSERT_FALSE(file.has_value());
  EXPECT_NE(file.error().message().find("runs past the end of the file"), std::string::npos) << file.error().message();
  auto tiny = SafetensorsFile::parse(std::vector<std::byte>(5), "tiny");
  ASSERT_FALSE(tiny.has_value());
  EXPECT_NE(tiny.error().message().find("too short"), std::string::npos);
}

TEST(Safetensors, RefusesOverlappingOffsets) {
  expect_refused(R"({"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                 bytes(8), "overlaps tensor 'a'");
}

TEST(Safetensors, RefusesEverythingElseThatIsMalformed) {
  expect_refused(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", bytes(8), "12 bytes by its shape");
  expect_refused(R"({"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", bytes(4), "belong to no tensor");
  expect_refused(R"({"x":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", {}, "negative dimension");
  expect_refused(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", bytes(1), "outside the data section");
  expect_refused(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", bytes(1), "unknown field 'extra'");
  expect_refused(R"({"x":{"dtype":"U8","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,1]}})", bytes(1), "overflows");
  expect_refused(R"({"__metadata__":{"k":1}})", {}, "is not a string");
  expect_refused(R"([1,2,3])", {}, "not a JSON object");
  expect_refused(R"({"x": )", {}, "not a JSON object");
}

TEST(Safetensors, WriterRefusesInconsistentTensorsAndLeavesNoFile) {
  const fs::path path = temp_dir() / "refused.safetensors";
  std::vector<float> w(3);
  std::vector<SafeTensorView> views{{"w", SafeDType::f32, {4}, std::as_bytes(std::span(w))}};
  auto r = save_safetensors(path, views);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message().find("12 bytes of data but its shape needs 16"), std::string::npos) << r.error().message();
  EXPECT_FALSE(fs::exists(path));
  auto missing = SafetensorsFile::load(temp_dir() / "does-not-exist.safetensors");
  ASSERT_FALSE(missing.has_value());
  EXPECT_EQ(missing.error().code(), ErrorCode::io);
  EXPECT_NE(missing.error().message().find("does-not-exist.safetensors"), std::string::npos);
}

}  // namespace
}  // namespace coshard::modules
