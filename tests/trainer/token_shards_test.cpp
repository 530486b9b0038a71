// Token data in several files (#35 item 3): read as one stream (the same batches as one file of
// the same tokens, windows across a file's end included), each file checked when opened, the
// identity following every file's tokens and their order, and --data's globs.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "coshard/trainer/data.hpp"

namespace coshard::trainer {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::current_path() / "token_shards_scratch" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// llm.c's .bin, version 1 (uint16 ids); `count` overrides the header's token count.
void write_llmc(const fs::path& path, const std::vector<std::uint16_t>& ids, std::int32_t count = -1) {
  std::vector<std::int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = count >= 0 ? count : static_cast<std::int32_t>(ids.size());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size() * 4));
  out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 2));
}

std::vector<std::uint16_t> ids_from(std::uint16_t first, std::size_t n) {
  std::vector<std::uint16_t> ids;
  for (std::size_t i = 0; i < n; ++i) ids.push_back(static_cast<std::uint16_t>((first + i * 7) % 1000));
  return ids;
}

TEST(TokenShards, ReadAsOneStreamTheSameBatchesAsOneFileOfTheSameTokens) {
  const fs::path dir = scratch("stream");
  std::vector<std::uint16_t> all;
  std::vector<fs::path> files;
  for (int k = 0; k < 3; ++k) {
    const auto ids = ids_from(static_cast<std::uint16_t>(k * 100 + 1), 40 + 13 * k);  // short: windows cross ends
    all.insert(all.end(), ids.begin(), ids.end());
    files.push_back(dir / ("shard_00" + std::to_string(k) + ".bin"));
    write_llmc(files.back(), ids);
  }
  write_llmc(dir / "whole.bin", all);
  auto shards = open_data(std::span<const fs::path>(files), TokenFormat::automatic, 1000, 16, 7);
  auto whole = open_data(dir / "whole.bin", TokenFormat::automatic, 1000, 16, 7);
  ASSERT_TRUE(shards) << shards.error().message();
  ASSERT_TRUE(whole) << whole.error().message();
  EXPECT_NE((*shards)->describe().find("3 files read as one stream of 159 tokens"), std::string::npos)
      << (*shards)->describe();
  for (std::uint64_t step = 0; step < 20; ++step) {
    const auto a = (*shards)->batch(step, 6, 16), b = (*whole)->batch(step, 6, 16);
    EXPECT_EQ(a.tokens, b.tokens) << "step " << step;
    EXPECT_EQ(a.targets, b.targets) << "step " << step;
  }
  // One file given as a list is that file, as before (its identity unchanged for checkpoints).
  auto one = open_data(std::span<const fs::path>(files.data(), 1), TokenFormat::automatic, 1000, 16, 7);
  auto plain = open_data(files.front(), TokenFormat::automatic, 1000, 16, 7);
  ASSERT_TRUE(one && plain);
  EXPECT_EQ((*one)->identity(), (*plain)->identity());

  // The identity follows every file's tokens and their order.
  const std::string id = (*shards)->identity();
  std::vector<fs::path> reordered{files[1], files[0], files[2]};
  auto swapped = open_data(std::span<const fs::path>(reordered), TokenFormat::automatic, 1000, 16, 7);
  ASSERT_TRUE(swapped);
  EXPECT_NE((*swapped)->identity(), id);
  auto changed_ids = ids_from(201, 66);
  changed_ids[30] = 999;
  write_llmc(files[2], changed_ids);
  auto changed = open_data(std::span<const fs::path>(files), TokenFormat::automatic, 1000, 16, 7);
  ASSERT_TRUE(changed);
  EXPECT_NE((*changed)->identity(), id);
}

TEST(TokenShards, EachFileIsCheckedWhenOpenedAndNamed) {
  const fs::path dir = scratch("checked");
  write_llmc(dir / "a.bin", ids_from(1, 50));
  write_llmc(dir / "b.bin", ids_from(600, 50));  // ids 600 and up
  auto open = [&](std::vector<fs::path> files, std::int64_t vocab = 1000) {
    return open_data(std::span<const fs::path>(files), TokenFormat::automatic, vocab, 16, 7);
  };
  // Damaged: the header counts more tokens than follow.
  write_llmc(dir / "damaged.bin", ids_from(3, 50), 60);
  auto damaged = open({dir / "a.bin", dir / "damaged.bin"});
  ASSERT_FALSE(damaged);
  EXPECT_NE(damaged.error().message().find("damaged.bin: its llm.c header counts 60 tokens"), std::string::npos)
      << damaged.error().message();
  auto missing = open({dir / "a.bin", dir / "gone.bin"});
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message().find("gone.bin"), std::string::npos) << missing.error().message();
  // An id the model cannot embed, in the second file.
  auto big = open({dir / "a.bin", dir / "b.bin"}, 500);
  ASSERT_FALSE(big);
  EXPECT_NE(big.error().message().find("b.bin: token 0 is id 600, not below the model's vocabulary of 500"),
            std::string::npos)
      << big.error().message();
  // Text among token files.
  std::ofstream(dir / "notes.txt") << "some text that is not token ids\n";
  auto text = open({dir / "a.bin", dir / "notes.txt"});
  ASSERT_FALSE(text);
  EXPECT_NE(text.error().message().find("notes.txt (file 2 of 2) would be read as text"), std::string::npos)
      << text.error().message();
  // Too short for the sequence length, all of them together.
  write_llmc(dir / "tiny.bin", ids_from(4, 5));
  write_llmc(dir / "tiny2.bin", ids_from(5, 5));
  auto tiny = open({dir / "tiny.bin", dir / "tiny2.bin"});
  ASSERT_FALSE(tiny);
  EXPECT_NE(tiny.error().message().find("2 files of 10 tokens in all; a sequence length of 16 needs at least 17"),
            std::string::npos)
      << tiny.error().message();
}

TEST(TokenShards, GlobsExpandInNameOrderAndMisuseIsNamed) {
  const fs::path dir = scratch("globs");
  for (const char* name : {"train_002.bin", "train_000.bin", "train_001.bin", "val_000.bin"})
    write_llmc(dir / name, ids_from(1, 30));
  const std::vector<std::string> specs{(dir / "train_*.bin").string()};
  auto files = expand_data_paths(specs);
  ASSERT_TRUE(files) << files.error().message();
  ASSERT_EQ(files->size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ((*files)[i].filename(), "train_00" + std::to_string(i) + ".bin");
  const std::vector<std::string> list{(dir / "val_000.bin").string(), (dir / "train_00[01].bin").string()};
  auto listed = expand_data_paths(list);
  ASSERT_TRUE(listed);
  EXPECT_EQ(listed->size(), 3u);
  EXPECT_EQ(listed->front().filename(), "val_000.bin");

  const std::vector<std::string> none{(dir / "test_*.bin").string()};
  auto nothing = expand_data_paths(none);
  ASSERT_FALSE(nothing);
  EXPECT_NE(nothing.error().message().find("test_*.bin' matches no file"), std::string::npos) << nothing.error().message();
  const std::vector<std::string> twice{(dir / "train_*.bin").string(), (dir / "train_001.bin").string()};
  auto doubled = expand_data_paths(twice);
  ASSERT_FALSE(doubled);
  EXPECT_NE(doubled.error().message().find("train_001.bin is named twice"), std::string::npos)
      << doubled.error().message();
}

}  // namespace
}  // namespace coshard::trainer
