// SwapFolder: one claimant at a time (the second named refusal names the first), the lock gone
// with its holder, and the swap files removed at the end while the user's folders stay.
#include "coshard/offload/swap_folder.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace coshard::offload {
namespace {

namespace fs = std::filesystem;

fs::path fresh(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("coshard_swap_folder_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

TEST(SwapFolder, ASecondClaimIsRefusedNamingTheHolder) {
  const fs::path dir = fresh("second") / "rank0-of-2";
  auto first = SwapFolder::claim(dir, "run A rank 0");
  ASSERT_TRUE(first) << first.error().message();
  auto second = SwapFolder::claim(dir, "run B rank 0");
  ASSERT_FALSE(second);
  EXPECT_NE(second.error().message().find("is in use by run A rank 0 (pid " + std::to_string(::getpid())), std::string::npos)
      << second.error().message();
  // Another process is refused the same way.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(SwapFolder::claim(dir, "child") ? 1 : 0);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  *first = SwapFolder();  // let go: now it can be claimed again
  auto third = SwapFolder::claim(dir, "run C rank 0");
  EXPECT_TRUE(third) << third.error().message();
  fs::remove_all(dir.parent_path());
}

TEST(SwapFolder, ALockDiesWithItsProcess) {
  const fs::path dir = fresh("dies");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    auto held = SwapFolder::claim(dir, "doomed");
    (void)!::write(ready[1], held ? "y" : "n", 1);
    ::pause();
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  EXPECT_FALSE(SwapFolder::claim(dir, "me"));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  auto after = SwapFolder::claim(dir, "me");
  EXPECT_TRUE(after) << after.error().message();
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST(SwapFolder, TheEndRemovesTheSwapFilesOnly) {
  const fs::path dir = fresh("end");
  {
    auto held = SwapFolder::claim(dir, "me");
    ASSERT_TRUE(held);
    std::ofstream(dir / "unit0") << "state";
    std::ofstream(dir / "unit1") << "state";
  }
  EXPECT_FALSE(fs::exists(dir));
  {
    auto held = SwapFolder::claim(dir, "me");
    ASSERT_TRUE(held);
    std::ofstream(dir / "unit0") << "state";
    fs::create_directories(dir / "users");
  }
  EXPECT_FALSE(fs::exists(dir / "unit0"));
  EXPECT_FALSE(fs::exists(dir / SwapFolder::kLockFile));
  EXPECT_TRUE(fs::is_directory(dir / "users"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace coshard::offload
