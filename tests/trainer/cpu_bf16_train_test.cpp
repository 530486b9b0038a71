// --dtype bf16 on the CPU with its native products (oneDNN, where the CPU has AVX512-BF16 or AMX;
// the f32 copies elsewhere): the run header names what multiplies, and the losses track the f32
// run's. The main job's model on the text the repository ships and a small grouped-query Llama,
// 200 steps each: the mean of the last 50 losses within 3% of f32's, at world 1 stage 0 and world 2 stage 3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "binary_harness.hpp"
#include "coshard/modules/cpu_half_products.hpp"
#include "support/sanitizers.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

// The mean of the last 50 losses (each step draws another batch of 8 x 64 tokens: a single step's
// loss moves by a few percent from batch to batch).
double last_ten(const std::vector<double>& losses) {
  const std::size_t n = std::min<std::size_t>(50, losses.size());
  return std::accumulate(losses.end() - static_cast<std::ptrdiff_t>(n), losses.end(), 0.0) / static_cast<double>(n);
}

// Under a sanitizer 6 steps of one layout (the same code; the tracking is the normal build's).
TEST(CpuBf16, TheMainJobAndASmallLlamaTrackTheirF32Runs) {
  const auto half = coshard::modules::cpu_half_products();
  ASSERT_TRUE(half) << half.error().message();
  const fs::path dir = scratch("cpu_bf16");
  const std::string steps = kSanitized ? "6" : "200";
  const std::vector<std::string> data = {"--data", COSHARD_MAIN_JOB_TEXT, "--seq", "64", "--batch", "8", "--steps", steps,
                                         "--lr", "0.01", "--warmup", "20"};
  const std::vector<std::pair<std::string, std::vector<std::string>>> models = {
      {"main job", {"--layers", "2", "--dim", "64", "--heads", "4"}},
      {"llama", {"--preset", "llama-tiny", "--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", "2",
                 "--intermediate", "128"}},
  };
  struct Layout {
    std::string world, stage;
  };
  // (stages 1 and 2 at world 2 gave stage 3's bits here: the products and the reductions are the same)
  std::vector<Layout> layouts = {{"1", "0"}, {"2", "3"}};
  if (kSanitized) layouts = {{"2", "3"}};
  const std::string products = half->describe(coshard::modules::DataType::bf16);
  for (const auto& [name, model] : models) {
    SCOPED_TRACE(name);
    const fs::path f32_metrics = dir / "f32.jsonl";
    const auto f32 = run(with(with(model, data), {"--metrics", f32_metrics.string()}), dir);
    ASSERT_EQ(f32.code, 0) << f32.output;
    const auto reference = losses_in(f32_metrics);
    ASSERT_EQ(reference.size(), static_cast<std::size_t>(std::stoi(steps)));
    for (const Layout& l : layouts) {
      SCOPED_TRACE("world " + l.world + ", stage " + l.stage);
      const fs::path metrics = dir / "bf16.jsonl";
      const auto bf16 = run(with(with(model, data), {"--dtype", "bf16", "--world-size", l.world, "--zero-stage", l.stage,
                                                     "--metrics", metrics.string()}),
                            dir);
      ASSERT_EQ(bf16.code, 0) << bf16.output;
      EXPECT_NE(bf16.output.find("  matrix products: " + products), std::string::npos) << bf16.output;
      // One rank on several cores multiplying natively: restarted with OpenMP's threads waiting
      // passively (where the environment does not say otherwise).
      if (half->native(coshard::modules::DataType::bf16) && l.world == "1" && std::getenv("OMP_WAIT_POLICY") == nullptr &&
          std::thread::hardware_concurrency() > 1)
        EXPECT_NE(bf16.output.find(products + " (OpenMP's idle threads wait passively)"), std::string::npos) << bf16.output;
      const auto losses = losses_in(metrics);
      ASSERT_EQ(losses.size(), reference.size());
      if (kSanitized) continue;
      const double got = last_ten(losses), want = last_ten(reference);
      std::printf("%s, world %s, stage %s: the last 50 steps' mean loss %.4f in bf16, %.4f in f32 (%+.2f%%)\n",
                  name.c_str(), l.world.c_str(), l.stage.c_str(), got, want, 100.0 * (got - want) / want);
      // Within 3%: at this size bf16's rounding moves the trajectory by up to about 2% either way
      // (measured on a Zen 5 EPYC with the native products and kernels of #64: -0.01% to +0.89%,
      // inside the 1%; with the first native products -1.7% to +1.3%; the f32 copies
      // -1.6% on the main job), where a wrong product would not learn at all. The bound leaves room
      // for the other CPUs CI runs on (AMX's products, the copies), whose trajectories differ.
      EXPECT_LT(std::abs(got - want), 0.03 * want);
      EXPECT_LT(got, 0.8 * reference.front()) << "it learns";
    }
  }
}

// A COSHARD_CPU_ISA that names no instructions is refused by name before anything runs, --estimate
// included (which makes no engine, and reported on a run that could not start), and the run
// header names the compute dtype.
TEST(CpuBf16, ABadIsaCapIsRefusedEvenByTheEstimate) {
  const fs::path dir = scratch("cpu_bf16_bad_isa");
  for (const auto& flags : {std::vector<std::string>{"--estimate"}, std::vector<std::string>{"--steps", "1"}}) {
    auto args = std::vector<std::string>{"--model", "llama", "--preset", "llama-tiny", "--world-size", "1", "--dtype",
                                         "bf16"};
    args.insert(args.end(), flags.begin(), flags.end());
    const auto r = run_with_env(args, dir, "COSHARD_CPU_ISA", "avx1024");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("COSHARD_CPU_ISA=avx1024: expected one of"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("fits"), std::string::npos) << r.output;
  }
  const auto header = run({"--model", "llama", "--preset", "llama-tiny", "--world-size", "1", "--dtype", "bf16",
                           "--steps", "1"},
                          dir);
  ASSERT_EQ(header.code, 0) << header.output;
  EXPECT_NE(header.output.find("ZeRO-3, bf16, 1 rank(s) on cpu"), std::string::npos) << header.output;
}

// The header names a rank's math threads, and warns where --blas-threads asks more than the cores
// (a new user's 1000 on 2 cores: 1075 threads, steps a hundred times slower, and no word of it).
TEST(CpuBf16, TheHeaderNamesTheMathThreadsAndWarnsOfTooMany) {
  const fs::path dir = scratch("cpu_bf16_threads");
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const auto plain = run({"--model", "llama", "--preset", "llama-tiny", "--world-size", "1", "--steps", "1"}, dir);
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_NE(plain.output.find("  math threads: " + std::to_string(cores) + " a rank (products, element-wise kernels, "
                              "optimizer), 1 rank(s) on this machine's " + std::to_string(cores) + " cores\n"),
            std::string::npos)
      << plain.output;
  const std::string many = std::to_string(2 * cores);
  const auto over = run({"--model", "llama", "--preset", "llama-tiny", "--world-size", "2", "--steps", "1",
                         "--blas-threads", many},
                        dir);
  ASSERT_EQ(over.code, 0) << over.output;
  EXPECT_NE(over.output.find("--blas-threads " + many + " puts " + std::to_string(4 * cores) + " threads on " +
                             std::to_string(cores) + " cores, which slows every step"),
            std::string::npos)
      << over.output;
}

}  // namespace
