// cuDNN's fused attention (issue 52, item 1) without a GPU: which shapes coshard sends to it, the
// plan cache, and the forward and backward graphs built into execution plans for an H100 that is
// not here (cuDNN's deviceless build from a device's properties).
//
// cuDNN's heuristics offer an engine configuration only once its support checks pass for the
// graph as it stands (pattern, strides, dtypes, grouped heads) and its kernel is generated and
// compiled (NVRTC). Where no driver is installed, the toolkit's stub libcuda is loaded first: the
// compile then runs, and the plan stops at the one step that needs a card, loading the compiled
// module (cuLibraryLoadData: CUDA_ERROR_STUB_LIBRARY). So the test asks that cuDNN offer at least
// one configuration and that every one of them fail there and nowhere earlier; with a card, that
// the plan builds. The numbers need the card: modules_cuda_attention_test compares cuDNN's
// attention with the materialized kernels there. Skips where cuDNN cannot be opened.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <ostream>

#include "kernels/cuda/cudnn/sdpa.hpp"

namespace coshard::modules::detail::cudnn {

// gtest's printer (found by argument-dependent lookup, so outside the unnamed namespace): shapes by their fields in test names (not their bytes, padding included).
void PrintTo(const SdpaShape& s, std::ostream* os) {
  *os << async::to_string(s.dtype) << " B" << s.B << " T" << s.T << " H" << s.H << " KVH" << s.KVH << " hd" << s.hd
      << (s.deterministic ? "" : " accumulating");
}

namespace {

// An H100 SXM (sm_90, 132 SMs) in cuDNN's JSON form of a device's properties.
constexpr std::string_view kH100 =
    R"({"maxGridSize":[2147483647,65535,65535],"maxBlockSize":[1024,1024,64],"regsPerBlock":65536,)"
    R"("multiProcessorCount":132,"warpSize":32,"maxSharedMemoryPerBlock":49152,)"
    R"("maxSharedMemoryPerBlockOptin":232448,"reservedSharedMemoryPerBlock":1024,"maxRegistersPerSM":65536,)"
    R"("maxCtasPerSM":32,"maxThreadsPerBlock":1024,"maxThreadsPerSM":2048,"pciDeviceId":8992,"isTccDriver":0,)"
    R"("supportCoopLaunch":1,"smClockRateKHz":1980000,"memClockRateKHz":2619000,"l2CacheSize":52428800,)"
    R"("totalGlobalMem":85031714816,"cudaDeviceId":0,"deviceVer":900,"driverVer":13000,)"
    R"("deviceName":"NVIDIA H100 80GB HBM3"})";

enum class Driver { real, stub, none };

// The real driver where one is installed; else the toolkit's stub, loaded under the driver's name
// (none: neither could be loaded, and cuDNN's runtime compile cannot run here).
Driver driver() {
  static const Driver found = [] {
    if (dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL)) return Driver::real;
#ifdef COSHARD_CUDA_TOOLKIT_LIB
    const auto stub = std::filesystem::path(COSHARD_CUDA_TOOLKIT_LIB) / "stubs" / "libcuda.so";
    if (dlopen(stub.c_str(), RTLD_NOW | RTLD_GLOBAL)) return Driver::stub;
#endif
    return Driver::none;
  }();
  return found;
}
bool real_driver() { return driver() == Driver::real; }

// Counts the non-overlapping occurrences of `what` in `text`.
std::size_t count(const std::string& text, std::string_view what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

// The plan built, or (no driver) every configuration cuDNN offered compiled and failed only at
// loading its module. Returns what happened, for the log.
std::string expect_plan_or_only_the_load_failed(const Result<const SdpaPlan*>& plan) {
  if (plan) {
    EXPECT_GE((*plan)->engine, 0);
    return "built: engine " + std::to_string((*plan)->engine) + ", workspace " +
           std::to_string((*plan)->workspace_bytes) + " bytes";
  }
  const std::string& why = plan.error().message();
  EXPECT_FALSE(real_driver()) << why;
  const auto at = why.find("heuristics offered ");
  EXPECT_NE(at, std::string::npos) << why;
  if (at == std::string::npos) return why;
  const long offered = std::stol(why.substr(at + 19));
  EXPECT_GE(offered, 1) << why;
  EXPECT_EQ(count(why, "cuLibraryLoadData"), static_cast<std::size_t>(offered)) << why;
  return std::to_string(offered) + " configurations compiled, each stopped at loading its module";
}

class CudnnAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    if (driver() == Driver::none) GTEST_SKIP() << "no CUDA driver, and no stub driver in the toolkit's lib/stubs";
    auto lib = library();
    if (!lib) GTEST_SKIP() << lib.error().message();
    lib_ = *lib;
    if (lib_->version < 90800) GTEST_SKIP() << "cuDNN " << version_string(lib_->version) << ": no deviceless build";
    auto props = device_properties_from_json(*lib_, kH100);
    ASSERT_TRUE(props) << props.error().message();
    h100_ = std::move(*props);
  }
  PlanTarget h100() const { return {.device_properties = h100_.get()}; }

  const Library* lib_ = nullptr;
  Descriptor h100_;
};

SdpaShape shape(DataType dt, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH, std::int64_t hd,
                bool deterministic = true) {
  return {.dtype = dt, .B = B, .T = T, .H = H, .KVH = KVH, .hd = hd, .deterministic = deterministic};
}

TEST(CudnnAttentionShapes, NamesWhatItDoesNotTake) {
  EXPECT_EQ(sdpa_unsupported(shape(DataType::bf16, 2, 1024, 32, 8, 64)), "");
  EXPECT_EQ(sdpa_unsupported(shape(DataType::f16, 1, 2048, 25, 25, 128)), "");
  EXPECT_NE(sdpa_unsupported(shape(DataType::f32, 1, 64, 4, 4, 64)).find("dtype f32"), std::string::npos);
  EXPECT_NE(sdpa_unsupported(shape(DataType::bf16, 1, 64, 4, 4, 256)).find("head size 256"), std::string::npos);
  EXPECT_NE(sdpa_unsupported(shape(DataType::bf16, 1, 64, 4, 4, 60)).find("head size 60"), std::string::npos);
  EXPECT_NE(sdpa_unsupported(shape(DataType::bf16, 1, 64, 6, 4, 64)).find("H=6 KVH=4"), std::string::npos);
  EXPECT_NE(sdpa_unsupported(shape(DataType::bf16, 0, 64, 4, 4, 64)).find("B=0"), std::string::npos);
}

TEST(CudnnAttentionShapes, ShapesAreKeysByEveryField) {
  const SdpaShape a = shape(DataType::bf16, 2, 1024, 32, 8, 64);
  for (SdpaShape b : {shape(DataType::f16, 2, 1024, 32, 8, 64), shape(DataType::bf16, 3, 1024, 32, 8, 64),
                      shape(DataType::bf16, 2, 1025, 32, 8, 64), shape(DataType::bf16, 2, 1024, 16, 8, 64),
                      shape(DataType::bf16, 2, 1024, 32, 4, 64), shape(DataType::bf16, 2, 1024, 32, 8, 128),
                      shape(DataType::bf16, 2, 1024, 32, 8, 64, false)}) {
    EXPECT_NE(a, b);
    EXPECT_TRUE(a < b || b < a);
  }
  EXPECT_EQ(a, shape(DataType::bf16, 2, 1024, 32, 8, 64));
}

// COSHARD_CUDNN_LIBRARY naming a missing file or a library that is not cuDNN's: each named with
// why, and the first that is cuDNN's taken.
TEST_F(CudnnAttention, LibrariesThatAreNotCudnnAreRefusedByName) {
  const std::vector<std::string> wrong = {"/nonexistent/libcudnn_graph.so.9", "libz.so.1"};
  auto none = open_library(wrong);
  ASSERT_FALSE(none);
  const std::string& why = none.error().message();
  EXPECT_NE(why.find("COSHARD_CUDNN_LIBRARY"), std::string::npos) << why;
  EXPECT_NE(why.find("/nonexistent/libcudnn_graph.so.9: "), std::string::npos) << why;
  EXPECT_NE(why.find("libz.so.1: a graph-API function is missing"), std::string::npos) << why;
  std::vector<std::string> then_right = wrong;
  then_right.push_back(lib_->path);
  auto found = open_library(then_right);
  ASSERT_TRUE(found) << found.error().message();
  EXPECT_EQ(found->path, lib_->path);
  EXPECT_EQ(found->version, lib_->version);
}

TEST_F(CudnnAttention, DevicePropertiesThatAreNotJsonAreRefusedByName) {
  auto bad = device_properties_from_json(*lib_, R"({"maxGridSize":[1,1,1]})");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("cuDNN device properties"), std::string::npos) << bad.error().message();
}

class CudnnAttentionShapesForAnH100 : public CudnnAttention, public ::testing::WithParamInterface<SdpaShape> {};

// Each shape's two passes through one cache: both built (or compiled up to the module load),
// then asked again: the same plans (or the same errors), nothing built.
TEST_P(CudnnAttentionShapesForAnH100, ForwardAndBackwardBuild) {
  const SdpaShape s = GetParam();
  SdpaPlanCache cache(h100());
  for (SdpaPass pass : {SdpaPass::forward, SdpaPass::backward}) {
    const auto start = std::chrono::steady_clock::now();
    auto plan = cache.get(*lib_, s, pass);
    const std::string what = expect_plan_or_only_the_load_failed(plan);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("%s T=%lld H=%lld KVH=%lld hd=%lld %s: %s (%.0f ms)\n", std::string(async::to_string(s.dtype)).c_str(),
                static_cast<long long>(s.T), static_cast<long long>(s.H), static_cast<long long>(s.KVH),
                static_cast<long long>(s.hd), pass == SdpaPass::forward ? "forward" : "backward", what.c_str(), ms);
    if (plan && pass == SdpaPass::backward) {
      EXPECT_EQ((*plan)->softmax_sum_bytes, s.B * s.H * s.T * 4);
      EXPECT_EQ((*plan)->dq_accum_bytes, 0);  // deterministic: no accumulator
      EXPECT_GE((*plan)->scratch_bytes(), (*plan)->softmax_sum_bytes + (*plan)->workspace_bytes);
    }
  }
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.builds(), 2u);
  for (SdpaPass pass : {SdpaPass::forward, SdpaPass::backward}) {
    auto first = cache.get(*lib_, s, pass);
    auto again = cache.get(*lib_, s, pass);
    ASSERT_EQ(bool(first), bool(again));
    if (first)
      EXPECT_EQ(*first, *again);
    else
      EXPECT_EQ(first.error().message(), again.error().message());
  }
  EXPECT_EQ(cache.builds(), 2u);
}

// The shapes of docs/performance.md's attention table, and grouped heads with the larger head.
INSTANTIATE_TEST_SUITE_P(Shapes, CudnnAttentionShapesForAnH100,
                         ::testing::Values(shape(DataType::bf16, 1, 2048, 32, 8, 64),   // Llama-3.2-1B: 4 heads a group
                                           shape(DataType::bf16, 1, 1024, 25, 25, 64),  // GPT-2 XL: multi-head
                                           shape(DataType::f16, 2, 512, 8, 2, 128)),    // head size 128 in f16
                         [](const auto& info) {
                           const SdpaShape& s = info.param;
                           return std::string(async::to_string(s.dtype)) + "_T" + std::to_string(s.T) + "_H" +
                                  std::to_string(s.H) + "_KVH" + std::to_string(s.KVH) + "_hd" + std::to_string(s.hd);
                         });

TEST_F(CudnnAttention, TheAccumulatingBackwardBuildsWithItsBuffer) {
  SdpaPlanCache cache(h100());
  const SdpaShape s = shape(DataType::bf16, 1, 1024, 16, 4, 64, false);
  auto plan = cache.get(*lib_, s, SdpaPass::backward);
  std::printf("accumulating backward: %s\n", expect_plan_or_only_the_load_failed(plan).c_str());
  if (!plan) return;
  EXPECT_EQ((*plan)->dq_accum_bytes, s.B * s.H * s.T * s.hd * 4);
  EXPECT_GE((*plan)->scratch_bytes(), (*plan)->softmax_sum_bytes + (*plan)->dq_accum_bytes);
}

TEST_F(CudnnAttention, AShapeItDoesNotTakeIsKeptAsItsErrorAndNotBuiltAgain) {
  SdpaPlanCache cache(h100());
  const SdpaShape f32 = shape(DataType::f32, 1, 128, 4, 4, 64);
  auto first = cache.get(*lib_, f32, SdpaPass::forward);
  ASSERT_FALSE(first);
  EXPECT_NE(first.error().message().find("dtype f32"), std::string::npos) << first.error().message();
  EXPECT_NE(first.error().message().find("cuDNN attention forward"), std::string::npos);
  auto second = cache.get(*lib_, f32, SdpaPass::forward);
  ASSERT_FALSE(second);
  EXPECT_EQ(second.error().message(), first.error().message());
  EXPECT_EQ(cache.builds(), 1u);
}

}  // namespace
}  // namespace coshard::modules::detail::cudnn
