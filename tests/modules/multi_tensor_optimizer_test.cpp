// The multi-tensor AdamW (Optimizer::step: every group's statistics and update in as few launches
// as the backend can) against the same optimizer stepped group by group (add_grad_stats and
// apply_one): the same weights, bit for bit, over more groups than one CUDA launch takes and with
// bf16 parameters written back from their fp32 masters. On the CPU (always) and CUDA (with a GPU).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/optimizer.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

using testing::random_values;

struct Stepped {
  std::vector<std::vector<double>> params;
  OptimizerStats stats;
};

// Three AdamW steps over groups of `sizes`, multi-tensor or group by group.
async::Task<Result<Stepped>> step_groups(Context& ctx, DataType dt, const std::vector<std::int64_t>& sizes,
                                         float max_grad_norm, bool multi_tensor) {
  StepControlOptions control;
  control.max_grad_norm = max_grad_norm;
  AdamWOptions adam;
  adam.weight_decay = 0.1f;
  COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw(adam, control));
  std::vector<Tensor> params, grads;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto n = static_cast<std::size_t>(sizes[i]);
    const auto p_bytes = encode_values(random_values(n, 100 + i, 1.0), dt);
    COSHARD_CO_TRY_ASSIGN(Tensor p, ctx.upload(p_bytes, Shape{sizes[i]}, dt));
    const auto g_bytes = encode_values(random_values(n, 500 + i, 0.1), dt);
    COSHARD_CO_TRY_ASSIGN(Tensor g, ctx.upload(g_bytes, Shape{sizes[i]}, dt));
    COSHARD_CO_TRY(opt->add_group(ctx, p, g));
    params.push_back(p);
    grads.push_back(g);
  }
  for (int step = 0; step < 3; ++step) {
    const float lr = 1e-2f * static_cast<float>(step + 1);
    if (multi_tensor) {
      COSHARD_CO_TRY(opt->step(ctx, lr));
    } else {
      COSHARD_CO_TRY(opt->begin_grad_stats(ctx));
      for (std::size_t i = 0; i < sizes.size(); ++i) COSHARD_CO_TRY(opt->add_grad_stats(ctx, i));
      for (std::size_t i = 0; i < sizes.size(); ++i) COSHARD_CO_TRY(opt->apply_one(ctx, i, lr));
      COSHARD_CO_TRY(opt->finish_step(ctx));
    }
  }
  Stepped out;
  for (const Tensor& p : params) {
    COSHARD_CO_TRY_ASSIGN(auto values, co_await ctx.read(p));
    out.params.push_back(std::move(values));
  }
  COSHARD_CO_TRY_ASSIGN(out.stats, co_await opt->read_stats(ctx));
  co_return out;
}

struct Case {
  async::Device device;
  DataType dtype;
  float max_grad_norm;
};

void expect_multi_tensor_matches(const Case& c, const std::vector<std::int64_t>& sizes) {
  async::Runtime rt;
  auto stream = async::Stream::create(c.device, {.name = "optimizer"});
  ASSERT_TRUE(stream) << stream.error().message();
  auto allocator = async::CachingAllocator::create(c.device);
  ASSERT_TRUE(allocator) << allocator.error().message();
  auto ctx = Context::create(*stream, **allocator);
  ASSERT_TRUE(ctx) << ctx.error().message();
  auto multi = rt.block_on(step_groups(*ctx, c.dtype, sizes, c.max_grad_norm, true));
  ASSERT_TRUE(multi) << multi.error().message();
  auto single = rt.block_on(step_groups(*ctx, c.dtype, sizes, c.max_grad_norm, false));
  ASSERT_TRUE(single) << single.error().message();
  ASSERT_EQ(multi->params.size(), single->params.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_EQ(multi->params[i].size(), single->params[i].size());
    EXPECT_EQ(std::memcmp(multi->params[i].data(), single->params[i].data(), multi->params[i].size() * sizeof(double)), 0)
        << "group " << i << " of " << sizes[i] << " elements";
  }
  EXPECT_EQ(multi->stats.steps, 3);
  EXPECT_EQ(multi->stats.steps, single->stats.steps);
  EXPECT_NEAR(multi->stats.grad_norm, single->stats.grad_norm, 1e-5 * single->stats.grad_norm);
  EXPECT_GT(multi->stats.grad_norm, 0.0f);
}

// 40 groups (more than one CUDA launch's 32) of sizes around the 64 Ki-element chunk.
std::vector<std::int64_t> group_sizes() {
  std::vector<std::int64_t> sizes;
  const std::int64_t pattern[] = {1, 7, 1000, 65536, 65537, 130000, 3, 4096};
  for (int i = 0; i < 40; ++i) sizes.push_back(pattern[i % 8]);
  return sizes;
}

TEST(MultiTensorAdamW, MatchesGroupByGroupOnTheCpu) {
  // Clipping on: the CPU adds the statistics in group order either way, so even the clip factor is the same.
  for (const DataType dt : {DataType::f32, DataType::bf16}) {
    SCOPED_TRACE(std::string(async::to_string(dt)));
    expect_multi_tensor_matches({async::Device::cpu(), dt, 1.0f}, group_sizes());
  }
}

TEST(MultiTensorAdamW, MatchesGroupByGroupOnCuda) {
  if (!async::cuda_compiled() || async::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  // No clipping: the gradient norm's atomics add in another order (last bits); the updates do not read it.
  auto sizes = group_sizes();
  sizes.push_back(21 * 1024 * 1024 + 5);  // more chunks than one launch's 320
  for (const DataType dt : {DataType::f32, DataType::bf16}) {
    SCOPED_TRACE(std::string(async::to_string(dt)));
    expect_multi_tensor_matches({async::Device::cuda(0), dt, 0.0f}, sizes);
  }
}

// #48 item 2: PyTorch keeps a step count per parameter, and AdamW's bias correction follows it. A
// run of elements left out of the first step (set_group_skipped_runs) and told it missed one
// (set_group_steps_missed) takes its first update at the second step as a fresh parameter does:
// against AdamW in double precision, for the multi-tensor step and group by group alike.
TEST(MultiTensorAdamW, ARunLeftOutOfAStepCountsItsOwnSteps) {
  async::Runtime rt;
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "optimizer"});
  auto allocator = async::CachingAllocator::create(async::Device::cpu());
  ASSERT_TRUE(stream && allocator);
  auto ctx = Context::create(*stream, **allocator);
  ASSERT_TRUE(ctx);
  const std::vector<double> w0{0.5, -0.25, 0.75, -1.0}, g{0.1, -0.2, 0.3, 0.05};
  const double lr = 1e-2, decay = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  // AdamW in double: `steps` updates with the same gradient, the first counted as t = 1.
  auto adamw = [&](double w, double gi, int steps) {
    double m = 0, v = 0;
    for (int t = 1; t <= steps; ++t) {
      m = b1 * m + (1 - b1) * gi;
      v = b2 * v + (1 - b2) * gi * gi;
      w = w * (1 - lr * decay) - lr * (m / (1 - std::pow(b1, t))) / (std::sqrt(v / (1 - std::pow(b2, t))) + eps);
    }
    return w;
  };
  for (const bool multi_tensor : {true, false}) {
    SCOPED_TRACE(multi_tensor ? "multi-tensor" : "group by group");
    auto stepped = rt.block_on([&]() -> async::Task<Result<std::vector<double>>> {
      AdamWOptions adam;
      adam.weight_decay = static_cast<float>(decay);
      COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw(adam));
      COSHARD_CO_TRY_ASSIGN(Tensor p, ctx->upload(encode_values(w0, DataType::f32), Shape{4}, DataType::f32));
      COSHARD_CO_TRY_ASSIGN(Tensor grad, ctx->upload(encode_values(g, DataType::f32), Shape{4}, DataType::f32));
      COSHARD_CO_TRY(opt->add_group(*ctx, p, grad));
      auto step = [&]() -> Result<void> {
        if (multi_tensor) return opt->step(*ctx, static_cast<float>(lr));
        COSHARD_TRY(opt->compute_grad_stats(*ctx));
        COSHARD_TRY(opt->apply_one(*ctx, 0, static_cast<float>(lr)));
        return opt->finish_step(*ctx);
      };
      std::vector<std::pair<std::int64_t, std::int64_t>> left_out(1, {2, 4});
      COSHARD_CO_TRY(opt->set_group_skipped_runs(0, left_out));
      COSHARD_CO_TRY(step());
      COSHARD_CO_TRY(opt->set_group_skipped_runs(0, {}));
      std::vector<Optimizer::MissedSteps> missed(1);
      missed[0].begin = 2;
      missed[0].end = 4;
      missed[0].steps = 1;
      COSHARD_CO_TRY(opt->set_group_steps_missed(0, missed));
      COSHARD_CO_TRY(step());
      COSHARD_CO_TRY(step());
      co_return co_await ctx->read(p);
    }());
    ASSERT_TRUE(stepped) << stepped.error().message();
    for (std::size_t i = 0; i < 4; ++i) {
      const double want = adamw(w0[i], g[i], i < 2 ? 3 : 2);
      EXPECT_NEAR((*stepped)[i], want, 2e-6 * std::abs(want)) << "element " << i;
    }
  }
  // Bad runs are refused by name.
  auto opt = Optimizer::adamw({});
  ASSERT_TRUE(opt);
  auto refused = rt.block_on([&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(Tensor p, ctx->zeros(Shape{4}, DataType::f32));
    COSHARD_CO_TRY_ASSIGN(Tensor grad, ctx->zeros(Shape{4}, DataType::f32));
    COSHARD_CO_TRY((*opt)->add_group(*ctx, p, grad));
    std::vector<Optimizer::MissedSteps> past(1);
    past[0].begin = 2;
    past[0].end = 5;
    past[0].steps = 1;
    co_return (*opt)->set_group_steps_missed(0, past);
  }());
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("run [2, 5) of 1 steps: expected sorted, non-empty runs"), std::string::npos)
      << refused.error().message();
  (void)(*stream).synchronize();
}

}  // namespace
}  // namespace coshard::modules
