// ReplacingFile: every file coshard replaces is written under a fresh temporary made with O_EXCL,
// so nothing planted beside the target (a link to a victim, a fifo, a stale temporary under the
// old fixed names) is written through, waited on, or removed; a dropped file leaves no trace.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "coshard/async/files.hpp"
#include "coshard/async/replacing_file.hpp"

namespace coshard::async {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::current_path() / "replacing_file_scratch" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(ReplacingFile, APlantedLinkOrFifoUnderATemporaryNameIsNeverOpened) {
  const fs::path dir = scratch("planted");
  const fs::path target = dir / "config.json";
  std::ofstream(dir / "victim") << "precious";
  // The names earlier versions used for their temporaries, and a few more.
  for (const std::string suffix : {".tmp", ".partial", ".tmp.0"}) fs::create_symlink(dir / "victim", target.string() + suffix);
  ASSERT_EQ(::mkfifo((target.string() + ".tmp.1").c_str(), 0644), 0);
  ASSERT_TRUE(write_file_atomic(target, "{\"a\": 1}\n"));
  EXPECT_EQ(slurp(target), "{\"a\": 1}\n");
  EXPECT_EQ(slurp(dir / "victim"), "precious");
  for (const std::string suffix : {".tmp", ".partial", ".tmp.0"})
    EXPECT_TRUE(fs::is_symlink(target.string() + suffix)) << suffix << ": the planted link stays";
  // Nothing else left behind: the planted entries, the victim and the target.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 6);
}

TEST(ReplacingFile, DroppedUncommittedLeavesTheTargetAndNoTemporary) {
  const fs::path dir = scratch("dropped");
  const fs::path target = dir / "model.safetensors";
  std::ofstream(target) << "old";
  fs::path temporary;
  {
    auto file = ReplacingFile::create(target, "--export");
    ASSERT_TRUE(file) << file.error().message();
    temporary = file->temporary();
    ASSERT_TRUE(file->write("new"));
    EXPECT_TRUE(fs::exists(temporary));
  }
  EXPECT_FALSE(fs::exists(temporary));
  EXPECT_EQ(slurp(target), "old");
}

TEST(ReplacingFile, ATargetThatIsNotARegularFileIsRefusedByName) {
  const fs::path dir = scratch("refused");
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
  auto fifo = ReplacingFile::create(dir / "fifo", "--export");
  ASSERT_FALSE(fifo);
  EXPECT_NE(fifo.error().message().find("--export " + (dir / "fifo").string() + ": is a fifo"), std::string::npos)
      << fifo.error().message();
  // A fifo put at the target after the temporary was made: refused at the commit, nothing left.
  auto late = ReplacingFile::create(dir / "late", "trace");
  ASSERT_TRUE(late);
  const fs::path temporary = late->temporary();
  ASSERT_EQ(::mkfifo((dir / "late").c_str(), 0644), 0);
  auto committed = late->commit();
  ASSERT_FALSE(committed);
  EXPECT_NE(committed.error().message().find("is a fifo"), std::string::npos) << committed.error().message();
  EXPECT_FALSE(fs::exists(temporary));
}

TEST(ReplacingFile, CommittedContentIsReadableByOthers) {
  const fs::path dir = scratch("mode");
  ASSERT_TRUE(write_file_atomic(dir / "latest", "step-00000004\n"));
  struct stat st{};
  ASSERT_EQ(::stat((dir / "latest").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

}  // namespace
}  // namespace coshard::async
