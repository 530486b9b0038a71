// The CPU's native bf16 matrix products (oneDNN, coshard/modules/cpu_half_products.hpp): chosen
// where the CPU has the instructions, within bf16's bound of an f64 product of the same (rounded)
// operands in every transpose, with alpha and an accumulating beta, at shapes from 1 x 1 x 1 to
// a vocabulary's width; and COSHARD_CPU_ISA's cap and its refusal of a name it does not know.
#include "coshard/modules/cpu_half_products.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "coshard/modules/ops.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

// This program asks for the native products wherever the CPU has bf16's instructions (on Intel's
// without AMX they are not the default), before anything reads the variable; the cap tests below
// set theirs.
[[maybe_unused]] const bool kAskForBf16 = [] { return ::setenv("COSHARD_CPU_ISA", "avx512_core_bf16", 0) == 0; }();

bool cpu_has_bf16_instructions() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

TEST(CpuHalfProducts, NativeWhereTheCpuHasTheInstructions) {
  const auto p = cpu_half_products();
  ASSERT_TRUE(p) << p.error().message();
  const std::string bf16 = p->describe(DataType::bf16);
  std::printf("bf16 matrix products: %s\n", bf16.c_str());
  if (!p->built) {
    EXPECT_FALSE(p->bf16);
    EXPECT_NE(bf16.find("this build has no oneDNN"), std::string::npos) << bf16;
    GTEST_SKIP() << "built without oneDNN";
  }
  EXPECT_FALSE(p->isa.empty());
  // AVX512-BF16 (and AMX, which comes with it on every CPU that has AMX) means native bf16.
  EXPECT_EQ(p->bf16, cpu_has_bf16_instructions()) << "oneDNN runs " << p->isa;
  if (p->bf16) {
    EXPECT_EQ(bf16, "oneDNN " + p->isa + " bf16 with f32 accumulation");
  } else {
    EXPECT_NE(bf16.find("bf16 on f32 copies through OpenBLAS"), std::string::npos) << bf16;
  }
  EXPECT_TRUE(p->describe(DataType::f32).empty());
}

class HalfProducts : public testing::ModuleFixture {
 protected:
  std::vector<double> values(const Tensor& t) {
    auto v = rt_.block_on(ctx_->read(t));
    EXPECT_TRUE(v) << v.error().message();
    return v ? *v : std::vector<double>{};
  }
  Tensor input(Shape shape, std::uint64_t seed, DataType dt, double scale = 1.0) {
    auto v = testing::random_values(static_cast<std::size_t>(shape.numel()), seed);
    for (double& x : v) x *= scale;
    // rounded to dt first, so the reference starts from the values the product sees
    return host_tensor(decode_values(encode_values(v, dt), dt), shape, dt);
  }
};

double at(const std::vector<double>& a, std::int64_t cols, bool trans, std::int64_t i, std::int64_t p) {
  return trans ? a[static_cast<std::size_t>(p * cols + i)] : a[static_cast<std::size_t>(i * cols + p)];
}

// bf16's bound for c = alpha * sum_p a_ip b_pj + beta * c0 computed with f32 accumulation and
// rounded once: half a bf16 unit of the result (2^-9 relative), plus f32's rounding over k sums of
// the magnitudes (each product of two bf16 values is exact in f32).
double bound(double result, double magnitudes, std::int64_t k) {
  return std::ldexp(std::abs(result), -8) + static_cast<double>(k + 2) * std::ldexp(magnitudes, -23) + 1e-30;
}

TEST_F(HalfProducts, Bf16ProductsAreWithinBf16sBoundOfTheF64Product) {
  struct Case {
    std::int64_t m, n, k;
  };
  // 1 x 1 x 1; odd sizes off every vector width; a layer's product; a vocabulary-wide output layer
  for (const Case c : {Case{1, 1, 1}, Case{3, 5, 7}, Case{17, 33, 300}, Case{64, 64, 64}, Case{128, 96, 512},
                       Case{8, 4096, 64}}) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        SCOPED_TRACE(std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k) + (ta ? " a^T" : "") +
                     (tb ? " b^T" : ""));
        const DataType dt = DataType::bf16;
        Tensor a = input(ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, 11, dt, 3.0);
        Tensor b = input(tb ? Shape{c.n, c.k} : Shape{c.k, c.n}, 12, dt, 0.5);
        Tensor acc = input(Shape{c.m, c.n}, 13, dt);
        const auto av = values(a), bv = values(b), before = values(acc);
        auto product = ops::matmul(*ctx_, a, b, {.trans_a = ta, .trans_b = tb});
        ASSERT_TRUE(product) << product.error().message();
        ASSERT_TRUE(ops::matmul_into(*ctx_, a, b, acc, {.trans_a = ta, .trans_b = tb, .alpha = 0.5f, .beta = 1.0f}));
        const auto got = values(*product), after = values(acc);
        int wrong = 0;
        for (std::int64_t i = 0; i < c.m; ++i)
          for (std::int64_t j = 0; j < c.n; ++j) {
            double want = 0, magnitudes = 0;
            for (std::int64_t p = 0; p < c.k; ++p) {
              const double x = at(av, ta ? c.m : c.k, ta, i, p) * at(bv, tb ? c.k : c.n, tb, p, j);
              want += x;
              magnitudes += std::abs(x);
            }
            const auto ij = static_cast<std::size_t>(i * c.n + j);
            const double accumulated = before[ij] + 0.5 * want;
            if (std::abs(got[ij] - want) > bound(want, magnitudes, c.k) ||
                std::abs(after[ij] - accumulated) > bound(accumulated, 0.5 * magnitudes + std::abs(before[ij]), c.k)) {
              if (++wrong <= 3)
                ADD_FAILURE() << "[" << i << ", " << j << "]: " << got[ij] << " and " << after[ij] << ", want " << want
                              << " and " << accumulated;
            }
          }
        EXPECT_EQ(wrong, 0);
      }
    }
  }
}

// COSHARD_CPU_ISA is read once a process: each case runs in a process of its own (gtest's
// threadsafe death-test style starts this program again for it).
class CpuIsaCap : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(CpuIsaCap, AnUnknownNameIsRefusedNamingTheChoices) {
  EXPECT_EXIT(
      {
        ::setenv("COSHARD_CPU_ISA", "avx1024", 1);
        const auto p = cpu_half_products();
        std::fprintf(stderr, "%s\n", p ? "accepted" : p.error().message().c_str());
        std::exit(p ? 1 : 0);
      },
      ::testing::ExitedWithCode(0),
      "COSHARD_CPU_ISA=avx1024: expected one of all, avx2, avx512_core, avx512_core_bf16, avx512_core_amx");
}

// Unset, the rule by CPU: bf16 native with AMX and on AMD's AVX512-BF16 (about four times
// OpenBLAS's f32 there), copies on Intel's AVX512-BF16 without AMX (slower there), the header's
// line saying which; the vendor as the CPU names it.
TEST_F(CpuIsaCap, UnsetTheCpusRuleChoosesNativeBf16) {
  EXPECT_EXIT(
      {
        ::unsetenv("COSHARD_CPU_ISA");
        const auto p = cpu_half_products();
        if (!p) std::exit(2);
        if (!p->built) {
          std::fprintf(stderr, "rule kept\n");
          std::exit(0);
        }
#if defined(__x86_64__)
        __builtin_cpu_init();
        if (p->amd != static_cast<bool>(__builtin_cpu_is("amd"))) std::exit(3);
#endif
        const bool bf16_isa = p->isa.starts_with("avx512_core_bf16") || p->amx;
        const bool want = bf16_isa && (p->amx || p->amd);
        if (p->bf16 != want) std::exit(4);
        const std::string line = p->describe(DataType::bf16);
        if (want != line.starts_with("oneDNN ")) std::exit(5);
        if (bf16_isa && !want && line.find("Intel CPUs without AMX") == std::string::npos) std::exit(6);
        std::fprintf(stderr, "rule kept\n");
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "rule kept");
}

// The header names the cap, not the CPU, as the reason (a build without oneDNN says so instead,
// with or without the cap).
TEST_F(CpuIsaCap, AvxTwoMultipliesBf16OnF32CopiesAndSaysSo) {
  EXPECT_EXIT(
      {
        ::setenv("COSHARD_CPU_ISA", "avx2", 1);
        const auto p = cpu_half_products();
        if (!p) std::exit(2);
        std::fprintf(stderr, "%s|%s\n", p->describe(DataType::bf16).c_str(), p->bf16 ? "native" : "copies");
        std::exit(0);
      },
      ::testing::ExitedWithCode(0),
      "bf16 on f32 copies through OpenBLAS \\((oneDNN runs avx2 under COSHARD_CPU_ISA=avx2, without native bf16 products|this build has no "
      "oneDNN)\\)\\|copies");
}

}  // namespace
}  // namespace coshard::modules
