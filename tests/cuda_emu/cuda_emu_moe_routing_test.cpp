// The CUDA kernels of mixture-of-experts routing (moe_routing.cu, #62) on the CPU through the
// emulation: the router's bits are the plain reference's (tests/support/moe_routing.hpp, which the
// CPU's kernels also give), its backward within f32's rounding of the f64 Jacobians, the dispatch
// plan a stable sort by expert. f32, bf16 and f16 logits, with and without renormalisation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_emu.hpp"
#include "emu_support.hpp"
#include "kernels.cuh"
#include "support/moe_routing.hpp"

namespace {

namespace cu = coshard::modules::cuda;
using namespace coshard::cuda_emu_test;

class EmulatedMoeRouting : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(EmulatedMoeRouting, TheReferencesBitsAndGradients) {
  const auto [dt, renormalize] = GetParam();
  struct Case {
    std::int64_t tokens, experts, top;
    double scale;
  };
  for (const Case c : {Case{37, 8, 2, 1.0}, Case{20, 64, 8, 2.0}, Case{6, 8, 3, 0.0}}) {
    SCOPED_TRACE(std::to_string(c.tokens) + " tokens, top " + std::to_string(c.top) + " of " + std::to_string(c.experts));
    std::mt19937 rng(static_cast<unsigned>(c.experts));
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> raw(static_cast<std::size_t>(c.tokens * c.experts));
    for (auto& v : raw) v = normal(rng) * c.scale;
    Stored logits(dt, raw);
    const auto held = logits.values();
    const std::vector<float> x(held.begin(), held.end());
    const auto want = coshard::testing::route_reference(x, c.tokens, c.experts, c.top, renormalize);
    std::vector<float> probs(want.probs.size()), weights(want.weights.size());
    std::vector<std::int32_t> chosen(want.chosen.size());
    ASSERT_EQ(cu::moe_route(nullptr, dt, logits.data(), c.tokens, c.experts, c.top, renormalize, probs.data(),
                            chosen.data(), weights.data()),
              0);
    EXPECT_EQ(chosen, want.chosen);
    EXPECT_EQ(0, std::memcmp(probs.data(), want.probs.data(), probs.size() * 4)) << "probabilities";
    EXPECT_EQ(0, std::memcmp(weights.data(), want.weights.data(), weights.size() * 4)) << "weights";

    std::vector<float> dweights(weights.size()), extra(static_cast<std::size_t>(c.experts));
    for (auto& v : dweights) v = static_cast<float>(normal(rng));
    for (auto& v : extra) v = static_cast<float>(normal(rng) * 0.5);
    Stored dlogits(dt, std::vector<double>(raw.size(), 0.0));
    ASSERT_EQ(cu::moe_route_backward(nullptr, probs.data(), chosen.data(), weights.data(), dweights.data(), extra.data(),
                                     c.tokens, c.experts, c.top, renormalize, dt, dlogits.data()),
              0);
    const auto reference = coshard::testing::route_backward_reference(x, chosen, dweights, extra, c.tokens, c.experts,
                                                                      c.top, renormalize);
    const auto got = dlogits.values();
    const double step = dt == kF32 ? 0 : dt == kBF16 ? 0x1p-8 : 0x1p-11;
    for (std::size_t i = 0; i < reference.size(); ++i)
      EXPECT_NEAR(got[i], reference[i], 2e-6 + std::fabs(reference[i]) * (1e-5 + step)) << "dlogit " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, EmulatedMoeRouting, ::testing::Combine(::testing::Values(kF32, kBF16, kF16), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_renormalized" : "_raw");
                         });

TEST(EmulatedMoeRoutingPlan, TheDispatchPlanIsAStableSortByExpert) {
  std::mt19937 rng(3);
  for (const std::int64_t experts : {1, 5, 64}) {
    std::vector<std::int32_t> chosen(301);
    for (auto& c : chosen) c = static_cast<std::int32_t>(rng() % static_cast<unsigned>(experts == 64 ? 7 : experts));
    const auto want = coshard::testing::dispatch_reference(chosen, experts);
    std::vector<std::int32_t> counts(static_cast<std::size_t>(experts), -1), order(chosen.size(), -1),
        inverse(chosen.size(), -1);
    ASSERT_EQ(cu::moe_dispatch_plan(nullptr, chosen.data(), static_cast<std::int64_t>(chosen.size()), experts,
                                    counts.data(), order.data(), inverse.data()),
              0);
    EXPECT_EQ(counts, want.counts);
    EXPECT_EQ(order, want.order);
    EXPECT_EQ(inverse, want.inverse);
  }
}

}  // namespace
