// SharedLibrary and the candidate search every run-time-opened library shares (cuDNN, cuBLAS,
// NCCL), on zlib: a library every build links, so present wherever the tests run.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "coshard/async/detail/shared_library.hpp"

namespace coshard::async::detail {
namespace {

namespace fs = std::filesystem;

TEST(SharedLibrary, BindsWhatItExportsAndNamesTheFirstFunctionItDoesNot) {
  auto zlib = SharedLibrary::open("libz.so.1");
  ASSERT_TRUE(zlib) << zlib.error().message();
  const char* (*version)() = nullptr;
  zlib->bind(version, "zlibVersion");
  ASSERT_NE(version, nullptr);
  EXPECT_EQ(std::string(version()).substr(0, 2), "1.");
  EXPECT_TRUE(zlib->missing().empty());

  void (*absent)() = nullptr, (*also_absent)() = nullptr;
  zlib->bind(absent, "coshard_no_such_function");
  zlib->bind(also_absent, "coshard_nor_this_one");
  EXPECT_EQ(absent, nullptr);
  EXPECT_EQ(also_absent, nullptr);
  EXPECT_EQ(zlib->missing(), "coshard_no_such_function");

  const fs::path file = zlib->file();  // opened by name, reported by where the loader found it
  EXPECT_TRUE(file.is_absolute()) << file;
  EXPECT_TRUE(fs::exists(file)) << file;
}

TEST(SharedLibrary, AFileThatIsNotThereIsRefusedWithTheLoadersReason) {
  auto none = SharedLibrary::open("/nonexistent/libcoshard_test.so");
  ASSERT_FALSE(none);
  EXPECT_NE(none.error().message().find("/nonexistent/libcoshard_test.so"), std::string::npos) << none.error().message();
  EXPECT_NE(none.error().message().find("No such file"), std::string::npos) << none.error().message();
}

TEST(SharedLibrary, CandidatesAreTheVariableThenTheLoadersPathThenTheBuildsFolder) {
  constexpr const char* kVar = "COSHARD_TEST_SHARED_LIBRARY";
  unsetenv(kVar);
  EXPECT_EQ(library_candidates(kVar, "libx.so.1", "/opt/x/lib"),
            (std::vector<std::string>{"libx.so.1", "/opt/x/lib/libx.so.1"}));
  EXPECT_EQ(library_candidates(kVar, "libx.so.1", ""), (std::vector<std::string>{"libx.so.1"}));

  const fs::path folder = fs::temp_directory_path();  // a folder: the file is looked for in it
  setenv(kVar, folder.c_str(), 1);
  EXPECT_EQ(library_candidates(kVar, "libx.so.1", "/opt/x/lib"),
            (std::vector<std::string>{(folder / "libx.so.1").string(), "libx.so.1", "/opt/x/lib/libx.so.1"}));
  setenv(kVar, "/somewhere/libx-custom.so", 1);  // not a folder: the file itself
  EXPECT_EQ(library_candidates(kVar, "libx.so.1", ""),
            (std::vector<std::string>{"/somewhere/libx-custom.so", "libx.so.1"}));
  setenv(kVar, "", 1);  // set but empty: as unset
  EXPECT_EQ(library_candidates(kVar, "libx.so.1", ""), (std::vector<std::string>{"libx.so.1"}));
  unsetenv(kVar);
}

TEST(SharedLibrary, TheFirstCandidateTakenWinsAndARefusalNamesEveryOneWithWhy) {
  const auto take = [](const std::string& candidate) -> Result<int> {
    if (candidate == "good") return 7;
    return fail(ErrorCode::unsupported, "not good: ", candidate.size(), " letters");
  };
  const std::vector<std::string> some = {"bad", "good", "also-bad"};
  auto taken = first_library(some, "X", "COSHARD_X_LIBRARY", take);
  ASSERT_TRUE(taken) << taken.error().message();
  EXPECT_EQ(*taken, 7);

  const std::vector<std::string> none = {"bad", "worse"};
  auto refused = first_library(none, "X (libx.so.1)", "COSHARD_X_LIBRARY", take);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code(), ErrorCode::unsupported);
  EXPECT_EQ(refused.error().message(),
            "X (libx.so.1) could not be used; set COSHARD_X_LIBRARY to it or its folder. Tried:\n"
            "  bad: not good: 3 letters\n"
            "  worse: not good: 5 letters");
}

}  // namespace
}  // namespace coshard::async::detail
