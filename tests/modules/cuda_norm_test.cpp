// LayerNorm and RMSNorm on CUDA at the sizes that choose each backward: the fused one (one pass
// over dout and x, per-block partial sums) with one row per block, several rows per block with a
// remainder, and GPT-2 1.5B's width; and rows too wide for a block's shared memory (the two-kernel
// form). Output, input gradient and parameter gradients against the CPU's f32 kernels within the
// dtype's tolerance, and the same bits run to run (no atomics). Skips without a GPU; the harness
// itself runs on the CPU (f32 against f64).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <ostream>
#include <sstream>
#include <tuple>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/llama_layers.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

using testing::normwise_error;
using testing::random_values;

enum class Norm { layer, rms };

struct NormShape {
  Norm norm;
  std::int64_t rows, dim;
  friend std::ostream& operator<<(std::ostream& os, const NormShape& s) {
    return os << (s.norm == Norm::layer ? "LayerNorm" : "RmsNorm") << "_rows" << s.rows << "_dim" << s.dim;
  }
};

struct NormRun {
  std::vector<double> out, dx, dparams;
};

// One forward and backward of the norm on `device` in `dt`, from inputs, weights and output
// gradient fixed by the shape. The parameters' gradients start at a nonzero value, so that the
// kernels must add to them (gradient accumulation), not overwrite them.
Result<NormRun> run_norm(async::Runtime& rt, async::Device device, DataType dt, const NormShape& s) {
  COSHARD_TRY_ASSIGN(auto stream, async::Stream::create(device, {.name = "norm"}));
  COSHARD_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(device));
  COSHARD_TRY_ASSIGN(Context ctx, Context::create(stream, *allocator));
  std::unique_ptr<Module> layer;
  if (s.norm == Norm::layer)
    layer = std::make_unique<LayerNorm>(s.dim);
  else
    layer = std::make_unique<RmsNorm>(s.dim);
  const Shape shape{s.rows, s.dim};
  auto body = [&]() -> async::Task<Result<NormRun>> {
    COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(ctx, *layer, dt));
    const auto weights = random_values(static_cast<std::size_t>(store.numel()), 21, 1.0);
    COSHARD_CO_TRY(ctx.copy_from_host(store.values(), encode_values(weights, dt)));
    const auto grads = random_values(static_cast<std::size_t>(store.numel()), 22, 0.5);
    COSHARD_CO_TRY(ctx.copy_from_host(store.grads(), encode_values(grads, dt)));
    // rows of different scales and offsets, as activations have
    auto x = random_values(static_cast<std::size_t>(shape.numel()), 23, 1.0);
    for (std::int64_t r = 0; r < s.rows; ++r)
      for (std::int64_t j = 0; j < s.dim; ++j) {
        auto& v = x[static_cast<std::size_t>(r * s.dim + j)];
        v = v * (1.0 + static_cast<double>(r % 7)) + 0.1 * static_cast<double>(r % 5);
      }
    const auto x_bytes = encode_values(x, dt);
    COSHARD_CO_TRY_ASSIGN(Tensor input, ctx.upload(x_bytes, shape, dt));
    const auto seed_bytes = encode_values(random_values(static_cast<std::size_t>(shape.numel()), 24, 1.0), dt);
    COSHARD_CO_TRY_ASSIGN(Tensor seed, ctx.upload(seed_bytes, shape, dt));
    COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(*layer, input));
    COSHARD_CO_TRY_ASSIGN(Tensor dx, co_await ctx.backward(*layer, seed));
    NormRun run;
    COSHARD_CO_TRY_ASSIGN(run.out, co_await ctx.read(out));
    COSHARD_CO_TRY_ASSIGN(run.dx, co_await ctx.read(dx));
    COSHARD_CO_TRY_ASSIGN(run.dparams, co_await ctx.read(store.grads()));
    co_return run;
  };
  return rt.block_on(body());
}

void expect_close(const NormRun& got, const NormRun& want, double tol) {
  EXPECT_FALSE(want.out.empty());
  EXPECT_LT(normwise_error(got.out, want.out), tol) << "output";
  EXPECT_LT(normwise_error(got.dx, want.dx), tol) << "input gradient";
  EXPECT_LT(normwise_error(got.dparams, want.dparams), tol) << "parameter gradients";
}

const auto kShapes = ::testing::Values(NormShape{Norm::layer, 5, 96},      // a row per block
                                       NormShape{Norm::rms, 5, 96},        //
                                       NormShape{Norm::layer, 1200, 520},  // two rows per block,
                                       NormShape{Norm::rms, 1200, 520},    // a partial thread stride
                                       NormShape{Norm::layer, 3000, 1600},  // GPT-2 1.5B's width,
                                       NormShape{Norm::rms, 3001, 2048},    // Llama-3.2-1B's; a remainder
                                       NormShape{Norm::rms, 40, 6200},      // fused RMSNorm, 24 KiB of sums
                                       NormShape{Norm::layer, 40, 6200},    // too wide: two kernels
                                       NormShape{Norm::rms, 9, 12300});     // too wide: two kernels

std::string shape_name(DataType dt, const NormShape& s) {
  std::ostringstream name;
  name << async::to_string(dt) << "_" << s;
  return name.str();
}

class CudaNorm : public ::testing::TestWithParam<std::tuple<DataType, NormShape>> {
 protected:
  void SetUp() override {
    COSHARD_SKIP_WITHOUT_CUDA();
  }
  async::Runtime rt_;
};

TEST_P(CudaNorm, MatchesTheCpuAndIsDeterministic) {
  const auto [dt, shape] = GetParam();
  auto want = run_norm(rt_, async::Device::cpu(), DataType::f32, shape);
  ASSERT_TRUE(want.has_value()) << want.error().message();
  auto got = run_norm(rt_, async::Device::cuda(0), dt, shape);
  ASSERT_TRUE(got.has_value()) << got.error().message();
  expect_close(*got, *want, testing::dtype_tolerance(dt));
  auto again = run_norm(rt_, async::Device::cuda(0), dt, shape);
  ASSERT_TRUE(again.has_value()) << again.error().message();
  EXPECT_EQ(again->dx, got->dx) << "the input gradient has the same bits run to run";
  EXPECT_EQ(again->dparams, got->dparams) << "the parameter gradients have the same bits run to run";
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaNorm,
                         ::testing::Combine(::testing::Values(DataType::f32, DataType::bf16, DataType::f16), kShapes),
                         [](const auto& info) { return shape_name(std::get<0>(info.param), std::get<1>(info.param)); });

// The harness on the CPU alone: f32 against f64 at every shape.
class CpuNorm : public ::testing::TestWithParam<NormShape> {
 protected:
  async::Runtime rt_;
};

TEST_P(CpuNorm, F32MatchesF64) {
  auto want = run_norm(rt_, async::Device::cpu(), DataType::f64, GetParam());
  ASSERT_TRUE(want.has_value()) << want.error().message();
  auto got = run_norm(rt_, async::Device::cpu(), DataType::f32, GetParam());
  ASSERT_TRUE(got.has_value()) << got.error().message();
  expect_close(*got, *want, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuNorm, kShapes,
                         [](const auto& info) { return shape_name(DataType::f32, info.param).substr(4); });

}  // namespace
}  // namespace coshard::modules
