// The CPU's mixture-of-experts routing kernels (#62's router, as transformers' Qwen3-MoE and
// Mixtral compute it): the forward's bits equal the plain reference's (tests/support/moe_routing.hpp,
// which the emulated CUDA kernels also match) for f32, bf16 and f16 logits, with and without the
// renormalisation, k from 1 to every expert, ties to the lower expert; the backward within f32's
// rounding of the f64 Jacobians, an auxiliary loss's per-expert term included, and against central
// differences; the dispatch plan a stable sort by expert; bad sizes refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "coshard/async/dtype.hpp"
#include "coshard/async/stream.hpp"
#include "kernels/kernels.hpp"
#include "support/moe_routing.hpp"

namespace coshard::modules::detail {
namespace {

// Logits held in dt: their bytes, and the values they hold as f32.
std::pair<std::vector<std::byte>, std::vector<float>> hold(DataType dt, const std::vector<float>& x) {
  std::vector<std::byte> bytes(x.size() * size_of(dt));
  std::vector<float> held;
  for (std::size_t i = 0; i < x.size(); ++i) {
    float v = x[i];
    if (dt == DataType::f32) {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else {
      const std::uint16_t h = dt == DataType::bf16 ? async::float_to_bf16(v) : async::float_to_f16(v);
      v = dt == DataType::bf16 ? async::bf16_to_float(h) : async::f16_to_float(h);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
    held.push_back(v);
  }
  return {bytes, held};
}

std::vector<float> random_logits(std::int64_t n, unsigned seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (auto& v : x) v = normal(rng);
  return x;
}

class MoeRoutingCpu : public ::testing::TestWithParam<std::tuple<DataType, bool>> {};

TEST_P(MoeRoutingCpu, TheReferencesBitsAndGradients) {
  const auto [dt, renormalize] = GetParam();
  const Kernels& k = cpu_kernels();
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "moe"});
  ASSERT_TRUE(stream);
  struct Case {
    std::int64_t tokens, experts, top;
    float scale;
  };
  for (const Case c : {Case{37, 8, 2, 1.0f}, Case{20, 64, 8, 2.0f}, Case{5, 4, 4, 0.5f}, Case{9, 16, 1, 3.0f},
                       Case{6, 8, 3, 0.0f}}) {  // (scale 0: every logit equal, every pick a tie)
    SCOPED_TRACE(std::to_string(c.tokens) + " tokens, top " + std::to_string(c.top) + " of " + std::to_string(c.experts));
    auto [bytes, x] = hold(dt, random_logits(c.tokens * c.experts, static_cast<unsigned>(c.experts), c.scale));
    const auto want = testing::route_reference(x, c.tokens, c.experts, c.top, renormalize);
    std::vector<float> probs(want.probs.size()), weights(want.weights.size());
    std::vector<std::int32_t> chosen(want.chosen.size());
    ASSERT_TRUE(k.moe_route(*stream, dt, bytes.data(), c.tokens, c.experts, c.top, renormalize, probs.data(),
                            chosen.data(), weights.data()));
    ASSERT_TRUE(stream->synchronize());
    EXPECT_EQ(chosen, want.chosen);
    EXPECT_EQ(0, std::memcmp(probs.data(), want.probs.data(), probs.size() * 4)) << "probabilities";
    EXPECT_EQ(0, std::memcmp(weights.data(), want.weights.data(), weights.size() * 4)) << "weights";
    if (c.scale == 0.0f)
      for (std::int64_t j = 0; j < c.top; ++j) EXPECT_EQ(chosen[static_cast<std::size_t>(j)], j) << "ties: the lower expert";

    // Backward: some loss's gradients on the weights, and an auxiliary loss's on every probability.
    const auto dweights = random_logits(c.tokens * c.top, 99, 1.0f);
    const auto extra = random_logits(c.experts, 98, 0.5f);
    std::vector<std::byte> dlogits(bytes.size());
    ASSERT_TRUE(k.moe_route_backward(*stream, probs.data(), chosen.data(), weights.data(), dweights.data(), extra.data(),
                                     c.tokens, c.experts, c.top, renormalize, dt, dlogits.data()));
    ASSERT_TRUE(stream->synchronize());
    const auto reference =
        testing::route_backward_reference(x, chosen, dweights, extra, c.tokens, c.experts, c.top, renormalize);
    const double step = dt == DataType::f32 ? 0 : dt == DataType::bf16 ? 0x1p-8 : 0x1p-11;
    for (std::size_t i = 0; i < reference.size(); ++i) {
      float got;
      if (dt == DataType::f32) {
        std::memcpy(&got, dlogits.data() + 4 * i, 4);
      } else {
        std::uint16_t h;
        std::memcpy(&h, dlogits.data() + 2 * i, 2);
        got = dt == DataType::bf16 ? async::bf16_to_float(h) : async::f16_to_float(h);
      }
      EXPECT_NEAR(got, reference[i], 2e-6 + std::fabs(reference[i]) * (1e-5 + step)) << "dlogit " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, MoeRoutingCpu,
                         ::testing::Combine(::testing::Values(DataType::f32, DataType::bf16, DataType::f16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(async::to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_renormalized" : "_raw");
                         });

// The f64 Jacobians themselves against central differences of the f64 forward (the experts held).
TEST(MoeRouting, TheReferenceGradientIsTheForwardsDerivative) {
  const std::int64_t tokens = 3, experts = 6, top = 2;
  const auto x = random_logits(tokens * experts, 5, 1.0f);
  const auto dweights = random_logits(tokens * top, 6, 1.0f);
  const auto extra = random_logits(experts, 7, 1.0f);
  for (const bool renormalize : {false, true}) {
    const auto held = testing::route_reference(x, tokens, experts, top, renormalize).chosen;
    auto loss = [&](const std::vector<double>& at) {
      double l = 0;
      for (std::int64_t t = 0; t < tokens; ++t) {
        double top_logit = -INFINITY, sum = 0, picked = 0;
        for (std::int64_t e = 0; e < experts; ++e) top_logit = std::max(top_logit, at[static_cast<std::size_t>(t * experts + e)]);
        std::vector<double> p(static_cast<std::size_t>(experts));
        for (std::int64_t e = 0; e < experts; ++e) sum += (p[static_cast<std::size_t>(e)] = std::exp(at[static_cast<std::size_t>(t * experts + e)] - top_logit));
        for (auto& v : p) v /= sum;
        for (std::int64_t j = 0; j < top; ++j) picked += p[static_cast<std::size_t>(held[static_cast<std::size_t>(t * top + j)])];
        for (std::int64_t j = 0; j < top; ++j) {
          const double pj = p[static_cast<std::size_t>(held[static_cast<std::size_t>(t * top + j)])];
          l += dweights[static_cast<std::size_t>(t * top + j)] * (renormalize ? pj / picked : pj);
        }
        for (std::int64_t e = 0; e < experts; ++e) l += extra[static_cast<std::size_t>(e)] * p[static_cast<std::size_t>(e)];
      }
      return l;
    };
    const auto analytic = testing::route_backward_reference(x, held, dweights, extra, tokens, experts, top, renormalize);
    std::vector<double> at(x.begin(), x.end());
    for (std::size_t i = 0; i < at.size(); ++i) {
      const double h = 1e-6, keep = at[i];
      at[i] = keep + h;
      const double up = loss(at);
      at[i] = keep - h;
      const double down = loss(at);
      at[i] = keep;
      EXPECT_NEAR(analytic[i], (up - down) / (2 * h), 1e-7) << "logit " << i << (renormalize ? " renormalized" : "");
    }
  }
}

TEST(MoeRouting, TheDispatchPlanIsAStableSortByExpert) {
  const Kernels& k = cpu_kernels();
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "moe"});
  ASSERT_TRUE(stream);
  std::mt19937 rng(3);
  for (const std::int64_t experts : {1, 5, 64}) {
    std::vector<std::int32_t> chosen(301);
    for (auto& c : chosen) c = static_cast<std::int32_t>(rng() % static_cast<unsigned>(experts == 64 ? 7 : experts));  // (experts unused too)
    const auto want = testing::dispatch_reference(chosen, experts);
    std::vector<std::int32_t> counts(static_cast<std::size_t>(experts), -1), order(chosen.size(), -1), inverse(chosen.size(), -1);
    ASSERT_TRUE(k.moe_dispatch_plan(*stream, chosen.data(), static_cast<std::int64_t>(chosen.size()), experts,
                                    counts.data(), order.data(), inverse.data()));
    ASSERT_TRUE(stream->synchronize());
    EXPECT_EQ(counts, want.counts);
    EXPECT_EQ(order, want.order);
    EXPECT_EQ(inverse, want.inverse);
  }
}

// Dispatch, combine and their backward: the reference's bits in every dtype (rows held in dt,
// the weights rounded to it, f32 sums in the experts' order, rounded once).
TEST_P(MoeRoutingCpu, DispatchAndCombineGiveTheReferencesBits) {
  const auto [dt, unused] = GetParam();
  (void)unused;
  const Kernels& k = cpu_kernels();
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "moe"});
  ASSERT_TRUE(stream);
  const std::int64_t tokens = 13, experts = 5, top = 3, width = 7, slots = tokens * top;
  const auto chosen = testing::distinct_choices(tokens, experts, top, 11);
  const auto plan = testing::dispatch_reference(chosen, experts);
  auto [x_bytes, x] = hold(dt, random_logits(tokens * width, 1, 1.0f));
  auto round = [dt = dt](float v) { return hold(dt, {v}).second[0]; };
  // Dispatch: each token's row at each of its places.
  std::vector<std::byte> gathered(static_cast<std::size_t>(slots * width) * size_of(dt));
  ASSERT_TRUE(k.moe_gather_rows(*stream, dt, x_bytes.data(), plan.order.data(), slots, top, width, gathered.data()));
  // The experts' rows (some values), combined with weights, and dispatch's backward (no weights).
  auto [rows_bytes, rows] = hold(dt, random_logits(slots * width, 2, 1.0f));
  const auto weights = random_logits(slots, 3, 0.5f);
  std::vector<std::byte> combined(x_bytes.size()), summed(x_bytes.size());
  ASSERT_TRUE(k.moe_combine_rows(*stream, dt, rows_bytes.data(), plan.inverse.data(), weights.data(), tokens, top, width,
                                 combined.data()));
  ASSERT_TRUE(k.moe_combine_rows(*stream, dt, rows_bytes.data(), plan.inverse.data(), nullptr, tokens, top, width,
                                 summed.data()));
  auto [dy_bytes, dy] = hold(dt, random_logits(tokens * width, 4, 1.0f));
  std::vector<std::byte> d_rows(rows_bytes.size());
  std::vector<float> dweights(static_cast<std::size_t>(slots));
  ASSERT_TRUE(k.moe_combine_backward(*stream, dt, dy_bytes.data(), rows_bytes.data(), plan.inverse.data(),
                                     weights.data(), tokens, top, width, d_rows.data(), dweights.data()));
  ASSERT_TRUE(stream->synchronize());
  const std::size_t e = size_of(dt);
  for (std::int64_t i = 0; i < slots; ++i)
    EXPECT_EQ(0, std::memcmp(gathered.data() + static_cast<std::size_t>(i * width) * e,
                             x_bytes.data() + static_cast<std::size_t>(plan.order[static_cast<std::size_t>(i)] / top * width) * e,
                             static_cast<std::size_t>(width) * e))
        << "dispatched row " << i;
  const auto want = testing::combine_reference(rows, plan.inverse, &weights, tokens, top, width, round);
  const auto want_sum = testing::combine_reference(rows, plan.inverse, nullptr, tokens, top, width, round);
  EXPECT_EQ(combined, hold(dt, want).first);
  EXPECT_EQ(summed, hold(dt, want_sum).first);
  std::vector<float> want_d_rows(static_cast<std::size_t>(slots * width));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < top; ++j) {
      const std::int64_t place = plan.inverse[static_cast<std::size_t>(t * top + j)];
      float dot = 0;
      for (std::int64_t c = 0; c < width; ++c) {
        const float g = dy[static_cast<std::size_t>(t * width + c)];
        dot += g * rows[static_cast<std::size_t>(place * width + c)];
        want_d_rows[static_cast<std::size_t>(place * width + c)] = round(weights[static_cast<std::size_t>(t * top + j)]) * g;
      }
      EXPECT_EQ(dweights[static_cast<std::size_t>(t * top + j)], dot) << "dweight " << t << ", " << j;
    }
  EXPECT_EQ(d_rows, hold(dt, want_d_rows).first);
}

TEST(MoeRouting, BadSizesAreRefusedByName) {
  const Kernels& k = cpu_kernels();
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "moe"});
  ASSERT_TRUE(stream);
  float x[8] = {}, p[8], w[8];
  std::int32_t c[8];
  auto zero_k = k.moe_route(*stream, DataType::f32, x, 2, 4, 0, true, p, c, w);
  ASSERT_FALSE(zero_k);
  EXPECT_NE(zero_k.error().message().find("routing to the top 0 of 4 experts: expected 1 to 4"), std::string::npos)
      << zero_k.error().message();
  auto too_many = k.moe_route(*stream, DataType::f32, x, 2, 4, 5, true, p, c, w);
  ASSERT_FALSE(too_many);
  EXPECT_NE(too_many.error().message().find("top 5 of 4"), std::string::npos) << too_many.error().message();
  auto no_experts = k.moe_route(*stream, DataType::f32, x, 2, 0, 1, true, p, c, w);
  ASSERT_FALSE(no_experts);
  EXPECT_NE(no_experts.error().message().find("routing over 0 experts"), std::string::npos) << no_experts.error().message();
  EXPECT_FALSE(k.moe_route(*stream, DataType::i32, x, 2, 4, 2, true, p, c, w));
  EXPECT_FALSE(k.moe_dispatch_plan(*stream, c, -1, 4, c, c, c));
  auto no_k = k.moe_gather_rows(*stream, DataType::f32, x, c, 2, 0, 4, p);
  ASSERT_FALSE(no_k);
  EXPECT_NE(no_k.error().message().find("expert rows: 2 rows of 4 for 0 experts a token"), std::string::npos)
      << no_k.error().message();
}

}  // namespace
}  // namespace coshard::modules::detail
