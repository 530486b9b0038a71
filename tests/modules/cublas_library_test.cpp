// cuBLAS and cuBLASLt opened at run time (issue 60, item 12): candidates that are not them are
// refused by name, and the toolkit's pair this build saw opens with every function coshard calls.
// No GPU is needed to open a library and resolve its functions.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kernels/cuda/blas_library.hpp"

namespace coshard::modules::detail::cublas {
namespace {

namespace fs = std::filesystem;

TEST(CublasLibrary, OpensOnceWithEveryFunctionCoshardCalls) {
  auto lib = library();
  ASSERT_TRUE(lib) << lib.error().message();
  const Library& l = **lib;
  for (const void* fn : {reinterpret_cast<const void*>(l.get_property), reinterpret_cast<const void*>(l.status_name),
                         reinterpret_cast<const void*>(l.create), reinterpret_cast<const void*>(l.destroy),
                         reinterpret_cast<const void*>(l.set_stream),
                         reinterpret_cast<const void*>(l.gemm_strided_batched_ex),
                         reinterpret_cast<const void*>(l.lt_get_version), reinterpret_cast<const void*>(l.lt_create),
                         reinterpret_cast<const void*>(l.lt_destroy), reinterpret_cast<const void*>(l.lt_matmul),
                         reinterpret_cast<const void*>(l.lt_matmul_desc_create),
                         reinterpret_cast<const void*>(l.lt_matmul_desc_destroy),
                         reinterpret_cast<const void*>(l.lt_matmul_desc_set_attribute),
                         reinterpret_cast<const void*>(l.lt_matrix_layout_create),
                         reinterpret_cast<const void*>(l.lt_matrix_layout_destroy),
                         reinterpret_cast<const void*>(l.lt_preference_create),
                         reinterpret_cast<const void*>(l.lt_preference_destroy),
                         reinterpret_cast<const void*>(l.lt_preference_set_attribute),
                         reinterpret_cast<const void*>(l.lt_algo_get_heuristic)})
    EXPECT_NE(fn, nullptr);
  EXPECT_STREQ(l.status_name(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_EQ(l.version / 10000, CUBLAS_VER_MAJOR);
  EXPECT_EQ(l.lt_version / 10000, static_cast<std::size_t>(CUBLAS_VER_MAJOR));
  EXPECT_EQ(l.lt_version, l.lt_get_version());
  // The files the loader opened, cuBLASLt beside cuBLAS.
  EXPECT_TRUE(fs::path(l.path).is_absolute()) << l.path;
  EXPECT_EQ(fs::path(l.path).filename(), "libcublas.so.13");
  EXPECT_EQ(fs::path(l.lt_path).filename(), "libcublasLt.so.13");
  EXPECT_EQ(fs::canonical(l.path).parent_path(), fs::canonical(l.lt_path).parent_path());
  EXPECT_EQ(l.describe().rfind("cuBLAS 13.", 0), 0u) << l.describe();
  auto again = library();
  ASSERT_TRUE(again);
  EXPECT_EQ(*again, *lib);
}

// COSHARD_CUBLAS_LIBRARY naming a missing file, a library that is not cuBLAS, or a cuBLAS without
// its cuBLASLt beside it: each named with why, and the first that is cuBLAS taken.
TEST(CublasLibrary, LibrariesThatAreNotCublasAreRefusedByName) {
  auto lib = library();
  ASSERT_TRUE(lib) << lib.error().message();
  const fs::path lone = fs::temp_directory_path() / ("coshard_cublas_alone_" + std::to_string(getpid()));
  fs::create_directories(lone);
  fs::create_symlink((*lib)->path, lone / "libcublas.so.13");  // its cuBLASLt is not beside it

  const std::vector<std::string> wrong = {"/nonexistent/libcublas.so.13", "libz.so.1",
                                          (lone / "libcublas.so.13").string()};
  auto none = open_library(wrong);
  ASSERT_FALSE(none);
  const std::string& why = none.error().message();
  EXPECT_NE(why.find("cuBLAS (libcublas.so.13 and libcublasLt.so.13) could not be used"), std::string::npos) << why;
  EXPECT_NE(why.find("COSHARD_CUBLAS_LIBRARY"), std::string::npos) << why;
  EXPECT_NE(why.find("/nonexistent/libcublas.so.13: its cuBLASLt, /nonexistent/libcublasLt.so.13: "),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("libz.so.1: cublasGetProperty is missing: not cuBLAS"), std::string::npos) << why;
  EXPECT_NE(why.find((lone / "libcublas.so.13").string() + ": its cuBLASLt, " + (lone / "libcublasLt.so.13").string()),
            std::string::npos)
      << why;

  std::vector<std::string> then_right = wrong;
  then_right.push_back((*lib)->path);
  auto found = open_library(then_right);
  fs::remove_all(lone);
  ASSERT_TRUE(found) << found.error().message();
  EXPECT_EQ(found->path, (*lib)->path);
  EXPECT_EQ(found->lt_path, (*lib)->lt_path);
  EXPECT_EQ(found->version, (*lib)->version);
}

}  // namespace
}  // namespace coshard::modules::detail::cublas
