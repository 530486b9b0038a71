// The fused (flash-style) CUDA attention against the materialized CUDA attention, through the
// public layer and Context options: output and qkv gradient within the dtype's tolerance, for
// multi-head and grouped-query heads, every served head size, and sequences that end inside a
// tile; the fused backward is deterministic; and the fused form never holds a T x T matrix (the
// layer's activation peak). cuDNN's fused attention (AttentionKernels::cudnn) against the same
// reference: cuDNN must take every shape here (the test names its version and engine), give the
// output and gradient within tolerance, and the same bits run to run. Skips without a GPU (these
// machines compile the kernels, CI included); the cuDNN cases skip where cuDNN cannot be opened
// (COSHARD_CUDNN_LIBRARY names it: scripts/device_check.sh points it at PyTorch's).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <ostream>
#include <sstream>
#include <tuple>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/layers.hpp"
#ifdef COSHARD_TEST_CUDNN
#include "kernels/cuda/cudnn/attention.hpp"
#endif
#include "attention_shape.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

using testing::normwise_error;
using testing::random_values;

using testing::AttentionShape;

struct AttentionRun {
  std::vector<double> out, dqkv;
  std::size_t peak_bytes = 0;
};

// One forward and backward of a CausalSelfAttention on cuda:0 with the given attention kernels,
// from inputs fixed by the shape (the same for every call).
Result<AttentionRun> run_attention(async::Runtime& rt, AttentionKernels kernels, DataType dt, const AttentionShape& s) {
  COSHARD_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cuda(0), {.name = "attention"}));
  COSHARD_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cuda(0)));
  COSHARD_TRY_ASSIGN(Context ctx, Context::create(stream, *allocator, ContextOptions{.attention = kernels}));
  CausalSelfAttention layer(AttentionHeads{s.H, s.KVH, s.hd});
  const Shape qkv_shape{s.B, s.T, (s.H + 2 * s.KVH) * s.hd};
  const auto x = random_values(static_cast<std::size_t>(qkv_shape.numel()), 11, 1.0);
  const auto seed_values = random_values(static_cast<std::size_t>(s.B * s.T * s.H * s.hd), 12, 1.0);
  auto body = [&]() -> async::Task<Result<AttentionRun>> {
    const auto x_bytes = encode_values(x, dt);
    COSHARD_CO_TRY_ASSIGN(Tensor qkv, ctx.upload(x_bytes, qkv_shape, dt));
    const auto seed_bytes = encode_values(seed_values, dt);
    COSHARD_CO_TRY_ASSIGN(Tensor seed, ctx.upload(seed_bytes, Shape{s.B, s.T, s.H * s.hd}, dt));
    ctx.reset_activation_peak();
    const std::size_t before = ctx.activation_memory().live_bytes;
    COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(layer, qkv));
    COSHARD_CO_TRY_ASSIGN(Tensor dqkv, co_await ctx.backward(layer, seed));
    AttentionRun run;
    run.peak_bytes = ctx.activation_memory().peak_bytes - before;
    COSHARD_CO_TRY_ASSIGN(run.out, co_await ctx.read(out));
    COSHARD_CO_TRY_ASSIGN(run.dqkv, co_await ctx.read(dqkv));
    co_return run;
  };
  return rt.block_on(body());
}

class FusedAttention : public ::testing::TestWithParam<std::tuple<DataType, AttentionShape>> {
 protected:
  void SetUp() override {
    COSHARD_SKIP_WITHOUT_CUDA();
  }
  async::Runtime rt_;
};

TEST_P(FusedAttention, MatchesTheMaterializedKernelsAndIsDeterministic) {
  const auto [dt, shape] = GetParam();
  auto fused = run_attention(rt_, AttentionKernels::fused, dt, shape);
  ASSERT_TRUE(fused.has_value()) << fused.error().message();
  auto reference = run_attention(rt_, AttentionKernels::materialized, dt, shape);
  ASSERT_TRUE(reference.has_value()) << reference.error().message();
  const double tol = testing::dtype_tolerance(dt);
  EXPECT_LT(normwise_error(fused->out, reference->out), tol) << "output";
  EXPECT_LT(normwise_error(fused->dqkv, reference->dqkv), tol) << "qkv gradient";
  auto again = run_attention(rt_, AttentionKernels::fused, dt, shape);
  ASSERT_TRUE(again.has_value()) << again.error().message();
  EXPECT_EQ(again->out, fused->out) << "the fused forward gives the same bits run to run";
  EXPECT_EQ(again->dqkv, fused->dqkv) << "the fused backward gives the same bits run to run (no atomics)";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FusedAttention,
    ::testing::Combine(::testing::Values(DataType::bf16, DataType::f16),
                       ::testing::Values(AttentionShape{1, 1, 2, 2, 64},     // one row
                                         AttentionShape{1, 64, 4, 4, 64},    // one whole tile
                                         AttentionShape{2, 100, 4, 2, 64},   // grouped, ends inside a tile
                                         AttentionShape{2, 130, 2, 1, 32},   // one key/value head
                                         AttentionShape{1, 77, 3, 3, 96},    // odd head count
                                         AttentionShape{1, 200, 8, 2, 128})),  // Llama-3's head size
    [](const auto& info) {
      std::ostringstream name;
      name << async::to_string(std::get<0>(info.param)) << "_" << std::get<1>(info.param);
      return name.str();
    });

#ifdef COSHARD_TEST_CUDNN
class CudnnAttentionOnCuda : public FusedAttention {};

TEST_P(CudnnAttentionOnCuda, MatchesTheMaterializedKernelsAndIsDeterministic) {
  const auto [dt, shape] = GetParam();
  auto lib = cudnn_attention_library();
  if (!lib) GTEST_SKIP() << lib.error().message();
  auto plans = detail::cudnn::attention_plans(
      0, {.dtype = dt, .B = shape.B, .T = shape.T, .H = shape.H, .KVH = shape.KVH, .hd = shape.hd});
  ASSERT_TRUE(plans) << *lib << ": " << plans.error().message();
  std::printf("%s: engines %lld forward, %lld backward\n", lib->c_str(), static_cast<long long>(plans->forward->engine),
              static_cast<long long>(plans->backward->engine));
  auto cudnn = run_attention(rt_, AttentionKernels::cudnn, dt, shape);
  ASSERT_TRUE(cudnn.has_value()) << cudnn.error().message();
  auto reference = run_attention(rt_, AttentionKernels::materialized, dt, shape);
  ASSERT_TRUE(reference.has_value()) << reference.error().message();
  const double tol = testing::dtype_tolerance(dt);
  EXPECT_LT(normwise_error(cudnn->out, reference->out), tol) << "output";
  EXPECT_LT(normwise_error(cudnn->dqkv, reference->dqkv), tol) << "qkv gradient";
  auto again = run_attention(rt_, AttentionKernels::cudnn, dt, shape);
  ASSERT_TRUE(again.has_value()) << again.error().message();
  EXPECT_EQ(again->out, cudnn->out) << "cuDNN's forward gives the same bits run to run";
  EXPECT_EQ(again->dqkv, cudnn->dqkv) << "cuDNN's deterministic backward gives the same bits run to run";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudnnAttentionOnCuda,
    ::testing::Combine(::testing::Values(DataType::bf16, DataType::f16),
                       ::testing::Values(AttentionShape{1, 1, 2, 2, 64},     // one row
                                         AttentionShape{2, 100, 4, 2, 64},   // grouped, ends inside a tile
                                         AttentionShape{2, 130, 2, 1, 32},   // one key/value head
                                         AttentionShape{1, 77, 3, 3, 96},    // odd head count
                                         AttentionShape{1, 200, 8, 2, 128},  // Llama-3's head size
                                         AttentionShape{2, 1024, 16, 4, 64})),  // a training length
    [](const auto& info) {
      std::ostringstream name;
      name << async::to_string(std::get<0>(info.param)) << "_" << std::get<1>(info.param);
      return name.str();
    });
#endif  // COSHARD_TEST_CUDNN

TEST(FusedAttentionMemory, KeepsNoTimesTMatrix) {
  COSHARD_SKIP_WITHOUT_CUDA();
  async::Runtime rt_;
  const AttentionShape shape{1, 512, 8, 4, 64};
  const std::size_t probabilities = static_cast<std::size_t>(shape.B * shape.H * shape.T * shape.T) * 2;
  auto fused = run_attention(rt_, AttentionKernels::fused, DataType::bf16, shape);
  ASSERT_TRUE(fused.has_value()) << fused.error().message();
  auto materialized = run_attention(rt_, AttentionKernels::materialized, DataType::bf16, shape);
  ASSERT_TRUE(materialized.has_value()) << materialized.error().message();
  EXPECT_GE(materialized->peak_bytes, probabilities);
  EXPECT_LT(fused->peak_bytes, probabilities / 2) << "materialized peak " << materialized->peak_bytes;
  std::printf("attention B1 T512 H8 KVH4 hd64 bf16: activation peak %zu bytes fused, %zu materialized\n",
              fused->peak_bytes, materialized->peak_bytes);
}

}  // namespace
}  // namespace coshard::modules
