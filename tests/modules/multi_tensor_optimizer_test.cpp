// The multi-tensor AdamW (Optimizer::step: every group's statistics and update in as few launches
// as the backend can) against the same optimizer stepped group by group (add_grad_stats and
// apply_one): the same weights, bit for bit, over more groups than one CUDA launch takes and with
// bf16 parameters written back from their fp32 masters. On the CPU (always) and CUDA (with a GPU).
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace coshard::modules
