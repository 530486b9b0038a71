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

// Dispatch, combine and their backward: the reference's bits (which the CPU's kernels give).
class EmulatedMoeRows : public ::testing::TestWithParam<int> {};

TEST_P(EmulatedMoeRows, DispatchAndCombineGiveTheReferencesBits) {
  const int dt = GetParam();
  const std::int64_t tokens = 13, experts = 5, top = 3, width = 7, slots = tokens * top;
  const auto chosen = coshard::testing::distinct_choices(tokens, experts, top, 11);
  const auto plan = coshard::testing::dispatch_reference(chosen, experts);
  std::mt19937 rng(1);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto values = [&](std::int64_t n) {
    std::vector<double> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = normal(rng);
    return v;
  };
  auto round = [dt](float v) { return static_cast<float>(Stored(dt, {v}).values()[0]); };
  Stored x(dt, values(tokens * width)), rows(dt, values(slots * width)), dy(dt, values(tokens * width));
  std::vector<float> weights(static_cast<std::size_t>(slots));
  for (auto& w : weights) w = static_cast<float>(normal(rng) * 0.5);
  Stored gathered(dt, std::vector<double>(static_cast<std::size_t>(slots * width), 0.0));
  Stored combined(dt, std::vector<double>(static_cast<std::size_t>(tokens * width), 0.0));
  Stored summed(dt, std::vector<double>(static_cast<std::size_t>(tokens * width), 0.0));
  Stored d_rows(dt, std::vector<double>(static_cast<std::size_t>(slots * width), 0.0));
  std::vector<float> dweights(static_cast<std::size_t>(slots));
  ASSERT_EQ(cu::moe_gather_rows(nullptr, dt, x.data(), plan.order.data(), slots, top, width, gathered.data()), 0);
  ASSERT_EQ(cu::moe_combine_rows(nullptr, dt, rows.data(), plan.inverse.data(), weights.data(), tokens, top, width,
                                 combined.data()),
            0);
  ASSERT_EQ(cu::moe_combine_rows(nullptr, dt, rows.data(), plan.inverse.data(), nullptr, tokens, top, width,
                                 summed.data()),
            0);
  ASSERT_EQ(cu::moe_combine_backward(nullptr, dt, dy.data(), rows.data(), plan.inverse.data(), weights.data(), tokens,
                                     top, width, d_rows.data(), dweights.data()),
            0);
  const auto xs = x.values(), got = gathered.values();
  for (std::int64_t i = 0; i < slots; ++i)
    for (std::int64_t c = 0; c < width; ++c)
      EXPECT_EQ(got[static_cast<std::size_t>(i * width + c)],
                xs[static_cast<std::size_t>(plan.order[static_cast<std::size_t>(i)] / top * width + c)]);
  const auto held = rows.values();
  const std::vector<float> rows_f(held.begin(), held.end());
  auto stored = [dt](const std::vector<float>& v) { return Stored(dt, std::vector<double>(v.begin(), v.end())).values(); };
  EXPECT_EQ(combined.values(),
            stored(coshard::testing::combine_reference(rows_f, plan.inverse, &weights, tokens, top, width, round)));
  EXPECT_EQ(summed.values(),
            stored(coshard::testing::combine_reference(rows_f, plan.inverse, nullptr, tokens, top, width, round)));
  const auto g = dy.values();
  std::vector<float> want_d(static_cast<std::size_t>(slots * width));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < top; ++j) {
      const std::int64_t place = plan.inverse[static_cast<std::size_t>(t * top + j)];
      float dot = 0;
      for (std::int64_t c = 0; c < width; ++c) {
        const auto gv = static_cast<float>(g[static_cast<std::size_t>(t * width + c)]);
        dot += gv * rows_f[static_cast<std::size_t>(place * width + c)];
        want_d[static_cast<std::size_t>(place * width + c)] = round(weights[static_cast<std::size_t>(t * top + j)]) * gv;
      }
      EXPECT_EQ(dweights[static_cast<std::size_t>(t * top + j)], dot);
    }
  EXPECT_EQ(d_rows.values(), stored(want_d));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmulatedMoeRows, ::testing::Values(kF32, kBF16, kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

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
