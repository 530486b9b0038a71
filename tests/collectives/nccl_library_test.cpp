// NCCL opened at run time (issue 60, item 12): candidates that are not NCCL are refused by name,
// and the NCCL this build found opens with every function coshard calls; nccl_library() says
// which. No GPU is needed to open a library and resolve its functions.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "coshard/collectives/nccl.hpp"
#include "nccl_library.hpp"

namespace coshard::collectives::detail::nccl {
namespace {

namespace fs = std::filesystem;

TEST(NcclLibrary, OpensOnceWithEveryFunctionCoshardCalls) {
  auto lib = library();
  ASSERT_TRUE(lib) << lib.error().message();
  const Library& l = **lib;
  for (const void* fn :
       {reinterpret_cast<const void*>(l.get_version), reinterpret_cast<const void*>(l.error_string),
        reinterpret_cast<const void*>(l.last_error), reinterpret_cast<const void*>(l.get_unique_id),
        reinterpret_cast<const void*>(l.comm_init_rank), reinterpret_cast<const void*>(l.comm_split),
        reinterpret_cast<const void*>(l.comm_abort), reinterpret_cast<const void*>(l.comm_destroy),
        reinterpret_cast<const void*>(l.comm_count), reinterpret_cast<const void*>(l.comm_user_rank),
        reinterpret_cast<const void*>(l.comm_get_async_error), reinterpret_cast<const void*>(l.group_start),
        reinterpret_cast<const void*>(l.group_end), reinterpret_cast<const void*>(l.all_gather),
        reinterpret_cast<const void*>(l.reduce_scatter), reinterpret_cast<const void*>(l.all_reduce),
        reinterpret_cast<const void*>(l.broadcast)})
    EXPECT_NE(fn, nullptr);
  EXPECT_GE(l.version, NCCL_VERSION(2, 18, 0));
  EXPECT_EQ(l.version / 10000, NCCL_MAJOR);
  EXPECT_NE(std::string(l.error_string(ncclInvalidArgument)), "");
  EXPECT_TRUE(fs::path(l.path).is_absolute()) << l.path;
  EXPECT_EQ(fs::path(l.path).filename(), "libnccl.so.2");
  // What the run header and the backend's errors say of it.
  EXPECT_TRUE(nccl_compiled());
  auto described = nccl_library();
  ASSERT_TRUE(described) << described.error().message();
  EXPECT_EQ(*described, "NCCL " + version_string(l.version) + " (" + l.path + ")");
}

TEST(NcclLibrary, VersionsReadAsNcclWritesThem) {
  EXPECT_EQ(version_string(22809), "2.28.9");
  EXPECT_EQ(version_string(21800), "2.18.0");
  EXPECT_EQ(version_string(2804), "2.8.4");  // before 2.9: one digit for the minor version
}

// COSHARD_NCCL_LIBRARY naming a missing file or a library that is not NCCL: each named with why,
// and the first that is NCCL taken.
TEST(NcclLibrary, LibrariesThatAreNotNcclAreRefusedByName) {
  auto lib = library();
  ASSERT_TRUE(lib) << lib.error().message();
  const std::vector<std::string> wrong = {"/nonexistent/libnccl.so.2", "libz.so.1"};
  auto none = open_library(wrong);
  ASSERT_FALSE(none);
  const std::string& why = none.error().message();
  EXPECT_NE(why.find("NCCL (libnccl.so.2) could not be used; set COSHARD_NCCL_LIBRARY"), std::string::npos) << why;
  EXPECT_NE(why.find("/nonexistent/libnccl.so.2: "), std::string::npos) << why;
  EXPECT_NE(why.find("libz.so.1: ncclGetVersion is missing: not NCCL"), std::string::npos) << why;
  std::vector<std::string> then_right = wrong;
  then_right.push_back((*lib)->path);
  auto found = open_library(then_right);
  ASSERT_TRUE(found) << found.error().message();
  EXPECT_EQ(found->path, (*lib)->path);
  EXPECT_EQ(found->version, (*lib)->version);
}

}  // namespace
}  // namespace coshard::collectives::detail::nccl
