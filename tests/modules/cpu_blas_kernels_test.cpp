// Which OpenBLAS kernels a CPU should run (#48 item 15): the better core is chosen by the CPU's
// vector instructions against the running core's tier, never one whose instructions it lacks.
#include <gtest/gtest.h>

#include "coshard/modules/cpu_blas_kernels.hpp"

namespace coshard::modules {
namespace {

constexpr CpuVectorSupport kSse{};
constexpr CpuVectorSupport kAvx{.avx = true};
constexpr CpuVectorSupport kAvx2{.avx = true, .avx2_fma = true};
constexpr CpuVectorSupport kAvx512{.avx = true, .avx2_fma = true, .avx512 = true};
constexpr CpuVectorSupport kZen3{.amd = true, .avx = true, .avx2_fma = true};
constexpr CpuVectorSupport kZen4{.amd = true, .avx = true, .avx2_fma = true, .avx512 = true};

TEST(BlasKernels, AGenericCoreOnAModernCpuGetsItsTiersKernels) {
  EXPECT_EQ(better_blas_core("Prescott", kAvx512), "SkylakeX");  // Debian 12's OpenBLAS on Sapphire Rapids
  EXPECT_EQ(better_blas_core("Nehalem", kAvx512), "SkylakeX");
  EXPECT_EQ(better_blas_core("Haswell", kAvx512), "SkylakeX");
  EXPECT_EQ(better_blas_core("Prescott", kAvx2), "Haswell");
  EXPECT_EQ(better_blas_core("Sandybridge", kAvx2), "Haswell");
  EXPECT_EQ(better_blas_core("Prescott", kAvx), "Sandybridge");
  EXPECT_EQ(better_blas_core("Prescott", kZen3), "Zen");
  EXPECT_EQ(better_blas_core("Barcelona", kZen4), "Zen");
}

TEST(BlasKernels, TheBestTierOrBetterIsLeftAsItIs) {
  EXPECT_EQ(better_blas_core("SkylakeX", kAvx512), "");
  EXPECT_EQ(better_blas_core("Cooperlake", kAvx512), "");
  EXPECT_EQ(better_blas_core("SKYLAKEX", kAvx512), "");  // (OPENBLAS_CORETYPE's spelling is free)
  EXPECT_EQ(better_blas_core("Haswell", kAvx2), "");
  EXPECT_EQ(better_blas_core("Zen", kZen3), "");
  EXPECT_EQ(better_blas_core("Zen", kZen4), "");  // AMD's AVX-512 stays on OpenBLAS's Zen kernels
  EXPECT_EQ(better_blas_core("Prescott", kSse), "");
}

TEST(BlasKernels, NeverACoreWhoseInstructionsTheCpuLacks) {
  // A user's or OpenBLAS's stronger choice is not "bettered" downwards, and nothing above the CPU's tier is named.
  EXPECT_EQ(better_blas_core("SkylakeX", kAvx2), "");
  EXPECT_EQ(better_blas_core("Haswell", kAvx), "");
  EXPECT_NE(better_blas_core("Prescott", kAvx2), "SkylakeX");
}

TEST(BlasKernels, TheWarningNamesWhatRunsWhatCouldAndTheFix) {
  CpuBlasKernels k{.running = "Prescott", .better = "SkylakeX"};
  EXPECT_EQ(k.describe(), "OpenBLAS Prescott kernels");
  EXPECT_NE(k.warning().find("OpenBLAS runs its Prescott kernels on this CPU, which runs its SkylakeX kernels"),
            std::string::npos) << k.warning();
  EXPECT_NE(k.warning().find("set OPENBLAS_CORETYPE=SkylakeX before the process starts"), std::string::npos);
  k.user_choice = "Prescott";
  EXPECT_NE(k.warning().find("OPENBLAS_CORETYPE=Prescott asks for them; unset it"), std::string::npos) << k.warning();
  const CpuBlasKernels chosen{.running = "SkylakeX", .replaced = "Prescott"};
  EXPECT_EQ(chosen.warning(), "");
  EXPECT_EQ(chosen.describe(), "OpenBLAS SkylakeX kernels (OpenBLAS chose Prescott for this CPU; coshard set "
                               "OPENBLAS_CORETYPE=SkylakeX)");
}

TEST(BlasKernels, ThisProcessNamesItsKernelsAndWarnsExactlyWhenBetterOnesExist) {
  const CpuBlasKernels k = cpu_blas_kernels();
  EXPECT_FALSE(k.running.empty());
  EXPECT_EQ(k.better, better_blas_core(k.running, cpu_vector_support()));
  EXPECT_EQ(k.warning().empty(), k.better.empty()) << k.warning();
}

}  // namespace
}  // namespace coshard::modules
