// Causal self-attention on the CPU's native bf16 products (kernels/cpu/attention_half.cpp):
// the output and the qkv gradient of a CausalSelfAttention in bf16 against the same layer in f64
// on the same (rounded) inputs, grouped-query included, at shapes off every vector width; and
// the same bits run to run; f16 (on f32 copies) to its own bound. bf16 skips where the CPU multiplies
// it on f32 copies.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <sstream>
#include <tuple>

#include "coshard/modules/cpu_half_products.hpp"
#include "coshard/modules/layers.hpp"
#include "attention_shape.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

// Native products wherever the CPU has bf16's instructions (on Intel's without AMX they are not
// the default), set before anything reads the variable.
[[maybe_unused]] const bool kAskForBf16 = [] { return ::setenv("COSHARD_CPU_ISA", "avx512_core_bf16", 0) == 0; }();

using testing::AttentionShape;

struct AttentionRun {
  std::vector<double> out, dqkv;
};

class CpuHalfAttention : public testing::ModuleFixture,
                         public ::testing::WithParamInterface<std::tuple<DataType, AttentionShape>> {
 protected:
  // One forward and backward in `dt` from inputs rounded to `rounded` (the half type under test).
  AttentionRun run(DataType dt, DataType rounded, const AttentionShape& s) {
    CausalSelfAttention layer(AttentionHeads{s.H, s.KVH, s.hd});
    const Shape qkv_shape{s.B, s.T, (s.H + 2 * s.KVH) * s.hd};
    const Shape out_shape{s.B, s.T, s.H * s.hd};
    auto x = decode_values(encode_values(testing::random_values(static_cast<std::size_t>(qkv_shape.numel()), 21, 2.0), rounded),
                           rounded);
    auto seed = decode_values(
        encode_values(testing::random_values(static_cast<std::size_t>(out_shape.numel()), 22, 1.0), rounded), rounded);
    Tensor qkv = host_tensor(x, qkv_shape, dt);
    Tensor dout = host_tensor(seed, out_shape, dt);
    auto body = [&]() -> async::Task<Result<AttentionRun>> {
      COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx_->forward(layer, qkv));
      COSHARD_CO_TRY_ASSIGN(Tensor dqkv, co_await ctx_->backward(layer, dout));
      AttentionRun r;
      COSHARD_CO_TRY_ASSIGN(r.out, co_await ctx_->read(out));
      COSHARD_CO_TRY_ASSIGN(r.dqkv, co_await ctx_->read(dqkv));
      co_return r;
    };
    auto r = rt_.block_on(body());
    EXPECT_TRUE(r) << r.error().message();
    return r ? *r : AttentionRun{};
  }
};

TEST_P(CpuHalfAttention, IsWithinItsRoundingOfTheF64LayerAndDeterministic) {
  const auto [dt, shape] = GetParam();
  const auto products = cpu_half_products();
  ASSERT_TRUE(products) << products.error().message();
  // (bf16 natively where its products are; f16 on the f32 copies everywhere, held to the same bound)
  if (dt == DataType::bf16 && !products->native(dt)) GTEST_SKIP() << products->describe(dt);
  const AttentionRun half = run(dt, dt, shape);
  const AttentionRun f64 = run(DataType::f64, dt, shape);
  ASSERT_FALSE(f64.out.empty());
  // The probabilities and dS are rounded once each before their products (as PyTorch's autocast
  // rounds its matmuls' inputs), the results once: a few units of the type's rounding, normwise
  // (bf16: 2^-9 = 2e-3 a rounding; f16: 2^-12). A wrong beta, head or transpose is off by O(1).
  const double bound = dt == DataType::bf16 ? 6e-3 : 1e-3;
  const double out_error = testing::normwise_error(half.out, f64.out);
  const double grad_error = testing::normwise_error(half.dqkv, f64.dqkv);
  std::printf("%s: normwise error output %.2e, qkv gradient %.2e\n", async::to_string(dt).data(), out_error, grad_error);
  EXPECT_LT(out_error, bound) << "output";
  EXPECT_LT(grad_error, bound) << "qkv gradient";
  const AttentionRun again = run(dt, dt, shape);
  EXPECT_EQ(again.out, half.out);
  EXPECT_EQ(again.dqkv, half.dqkv);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuHalfAttention,
    ::testing::Combine(::testing::Values(DataType::bf16, DataType::f16),
                       ::testing::Values(AttentionShape{1, 1, 2, 2, 16},    // one row
                                         AttentionShape{2, 37, 4, 2, 32},   // grouped, off every width
                                         AttentionShape{2, 64, 3, 1, 24},   // one key/value head of three
                                         AttentionShape{1, 130, 8, 8, 64})),  // multi-head
    [](const auto& info) {
      std::ostringstream name;
      name << async::to_string(std::get<0>(info.param)) << "_" << std::get<1>(info.param);
      return name.str();
    });

}  // namespace
}  // namespace coshard::modules
