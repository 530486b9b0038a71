// coshard's CUDA kernel files run on the CPU through the emulation in cuda_emu.hpp (translated by
// translate.py at build time), so that their logic is tested where no GPU is (CI): indexing, tile
// edges, masks, barriers and the order of sums. Against references computed here in f64 from the
// same rounded inputs, within each storage type's tolerance:
//   - the norms (norm.cu): forward, and the fused backward against the two-kernel backward, on
//     the scalar path and the vector path (rows in registers)
//     (the input gradient the same bits; the parameter gradients added to what was there);
//   - the fused attention (kernels/cuda/attention.cu, attention_backward.cu): forward and
//     backward, grouped-query heads, every served head size, sequences that end inside a tile.
// What the emulation cannot show (speed, the hardware's fragment layouts, memory-model subtleties)
// is for the CUDA tests on a GPU (FusedAttention.*, CudaNorm.*).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <tuple>
#include <vector>

#include "cuda_emu.hpp"
#include "emu_support.hpp"
#include "attention.cuh"
#include "kernels.cuh"

namespace {

namespace cu = coshard::modules::cuda;
using namespace coshard::cuda_emu_test;

TEST(CudaEmulation, HalfConversionsRoundToNearestEven) {
  EXPECT_EQ(__float2half_rn(1.0f).bits, 0x3c00);
  EXPECT_EQ(__float2half_rn(65504.0f).bits, 0x7bff);
  EXPECT_EQ(__float2half_rn(65520.0f).bits, 0x7c00);          // rounds up to infinity
  EXPECT_EQ(__float2half_rn(std::ldexp(1.0f, -24)).bits, 1);  // the smallest subnormal
  EXPECT_EQ(__float2half_rn(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00);  // a tie goes to even
  EXPECT_EQ(__float2half_rn(1.0f + 3 * std::ldexp(1.0f, -11)).bits, 0x3c02);
  EXPECT_EQ(__half2float(__half{0x3555}), 0.333251953125f);
  EXPECT_EQ(__float2bfloat16_rn(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);  // a tie goes to even
  EXPECT_EQ(__float2bfloat16_rn(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82);
  EXPECT_EQ(__bfloat162float(__nv_bfloat16{0x4049}), 3.140625f);
}

// ---- norms ----

struct NormCase {
  bool layer_norm;
  int dt;
  std::int64_t rows, dim;
  friend std::ostream& operator<<(std::ostream& os, const NormCase& c) {
    return os << (c.layer_norm ? "LayerNorm" : "RmsNorm") << "_" << dtype_name(c.dt) << "_rows" << c.rows << "_dim"
              << c.dim;
  }
};

class EmulatedNorm : public ::testing::TestWithParam<NormCase> {};

TEST_P(EmulatedNorm, FusedBackwardMatchesTheTwoKernelsAndTheReference) {
  const NormCase c = GetParam();
  const std::int64_t N = c.rows, C = c.dim;
  auto xv = random_values(static_cast<std::size_t>(N * C), 1);
  for (std::int64_t i = 0; i < N; ++i)  // rows of other scales and offsets
    for (std::int64_t j = 0; j < C; ++j) xv[i * C + j] = xv[i * C + j] * (1 + i % 5) + 0.2 * (i % 3);
  Stored x(c.dt, xv), w(c.dt, random_values(C, 2)), b(c.dt, random_values(C, 3)),
      g(c.dt, random_values(static_cast<std::size_t>(N * C), 4));
  const auto grads0 = random_values(C, 5, 0.5);
  Stored out(c.dt, std::vector<double>(N * C)), dx_fused(c.dt, std::vector<double>(N * C)),
      dx_two(c.dt, std::vector<double>(N * C));
  Stored dw_fused(c.dt, grads0), db_fused(c.dt, grads0), dw_two(c.dt, grads0), db_two(c.dt, grads0);
  std::vector<float> mean(N), rstd(N);
  const float eps = 1e-5f;
  if (c.layer_norm)
    ASSERT_EQ(cu::layernorm_forward(nullptr, c.dt, x.data(), w.data(), b.data(), out.data(), mean.data(), rstd.data(),
                                    N, C, eps), 0);
  else
    ASSERT_EQ(cu::rmsnorm_forward(nullptr, c.dt, x.data(), w.data(), out.data(), rstd.data(), N, C, eps), 0);
  const std::int64_t partial_count = cu::norm_backward_partials(N, C, c.layer_norm);
  ASSERT_GT(partial_count, 0) << "these shapes are the fused backward's";
  std::vector<float> partials(static_cast<std::size_t>(partial_count), NAN);
  if (c.layer_norm) {
    ASSERT_EQ(cu::layernorm_backward(nullptr, c.dt, g.data(), x.data(), w.data(), mean.data(), rstd.data(),
                                     dx_fused.data(), dw_fused.data(), db_fused.data(), partials.data(), N, C), 0);
    ASSERT_EQ(cu::layernorm_backward(nullptr, c.dt, g.data(), x.data(), w.data(), mean.data(), rstd.data(),
                                     dx_two.data(), dw_two.data(), db_two.data(), nullptr, N, C), 0);
  } else {
    ASSERT_EQ(cu::rmsnorm_backward(nullptr, c.dt, g.data(), x.data(), w.data(), rstd.data(), dx_fused.data(),
                                   dw_fused.data(), partials.data(), N, C), 0);
    ASSERT_EQ(cu::rmsnorm_backward(nullptr, c.dt, g.data(), x.data(), w.data(), rstd.data(), dx_two.data(),
                                   dw_two.data(), nullptr, N, C), 0);
  }
  // The reference, in f64 from the stored inputs.
  const auto X = x.values(), W = w.values(), Bv = b.values(), G = g.values();
  const auto grads0_stored = Stored(c.dt, grads0).values();  // what the gradients held before
  std::vector<double> want_out(N * C), want_dx(N * C), want_dw(grads0_stored), want_db(grads0_stored);
  for (std::int64_t i = 0; i < N; ++i) {
    double m = 0, v = 0;
    for (std::int64_t j = 0; j < C; ++j) m += X[i * C + j];
    m = c.layer_norm ? m / C : 0;
    for (std::int64_t j = 0; j < C; ++j) v += (X[i * C + j] - m) * (X[i * C + j] - m);
    const double r = 1 / std::sqrt(v / C + eps);
    double a = 0, bsum = 0;
    for (std::int64_t j = 0; j < C; ++j) {
      const double xhat = (X[i * C + j] - m) * r;
      want_out[i * C + j] = xhat * W[j] + (c.layer_norm ? Bv[j] : 0);
      a += G[i * C + j] * W[j];
      bsum += G[i * C + j] * W[j] * xhat;
      want_dw[j] += G[i * C + j] * xhat;
      want_db[j] += G[i * C + j];
    }
    for (std::int64_t j = 0; j < C; ++j) {
      const double xhat = (X[i * C + j] - m) * r;
      want_dx[i * C + j] = r * (G[i * C + j] * W[j] - (c.layer_norm ? a / C : 0) - xhat * bsum / C);
    }
  }
  const double tol = tolerance(c.dt);
  EXPECT_LT(normwise_error(out.values(), want_out), tol) << "output";
  EXPECT_LT(normwise_error(dx_fused.values(), want_dx), tol) << "input gradient";
  EXPECT_EQ(dx_fused.values(), dx_two.values()) << "the fused backward's input gradient has the two kernels' bits";
  EXPECT_LT(normwise_error(dw_fused.values(), want_dw), tol) << "weight gradient, fused";
  EXPECT_LT(normwise_error(dw_two.values(), want_dw), tol) << "weight gradient, two kernels";
  if (c.layer_norm) {
    EXPECT_LT(normwise_error(db_fused.values(), want_db), tol) << "bias gradient, fused";
    EXPECT_LT(normwise_error(db_two.values(), want_db), tol) << "bias gradient, two kernels";
  } else {
    EXPECT_EQ(db_fused.values(), grads0_stored) << "RMSNorm has no bias gradient to touch";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmulatedNorm,
                         ::testing::Values(NormCase{true, kF32, 3, 96},     // a row a block
                                           NormCase{false, kF32, 3, 96},    //
                                           NormCase{true, kBF16, 5, 300},   // a partial thread stride
                                           NormCase{false, kF16, 5, 300},   //
                                           // two rows a block, and one (each row of these costs
                                           // the emulation 256 threads' barriers: one shape only)
                                           NormCase{false, kBF16, 1030, 8},
                                           // the vector path (rows of whole 16-byte vectors in
                                           // registers): fewer vectors than threads, two and four
                                           // a thread (the most), and one vector too many (scalar)
                                           NormCase{true, kBF16, 4, 1600},
                                           NormCase{false, kF16, 2, 4096},
                                           NormCase{true, kF32, 2, 4096},
                                           NormCase{false, kBF16, 2, 4104}),
                         [](const auto& info) {
                           std::ostringstream name;
                           name << info.param;
                           return name.str();
                         });

// ---- fused attention ----

struct AttentionCase {
  int dt;
  std::int64_t B, T, H, KVH, hd;
  friend std::ostream& operator<<(std::ostream& os, const AttentionCase& c) {
    return os << dtype_name(c.dt) << "_B" << c.B << "_T" << c.T << "_H" << c.H << "_KVH" << c.KVH << "_hd" << c.hd;
  }
};

class EmulatedFlashAttention : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(EmulatedFlashAttention, MatchesTheReference) {
  const AttentionCase c = GetParam();
  ASSERT_TRUE(cu::flash_attention_supported(c.dt, c.hd));
  const std::int64_t B = c.B, T = c.T, H = c.H, KVH = c.KVH, hd = c.hd;
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, group = H / KVH;
  Stored qkv(c.dt, random_values(static_cast<std::size_t>(B * T * W), 11, 1.5));
  Stored dout(c.dt, random_values(static_cast<std::size_t>(B * T * C), 12));
  Stored out(c.dt, std::vector<double>(B * T * C)), dqkv(c.dt, std::vector<double>(B * T * W, 7.0));
  std::vector<float> lse(B * H * T), delta(B * H * T);
  ASSERT_EQ(cu::flash_attention_forward(nullptr, c.dt, qkv.data(), out.data(), lse.data(), B, T, H, KVH, hd), 0);
  ASSERT_EQ(cu::flash_attention_backward(nullptr, c.dt, dout.data(), qkv.data(), out.data(), lse.data(),
                                         dqkv.data(), delta.data(), B, T, H, KVH, hd),
            0);

  // The reference in f64 from the stored inputs.
  const auto X = qkv.values(), DO = dout.values();
  std::vector<double> want_out(B * T * C, 0.0), want_d(B * T * W, 0.0), want_lse(B * H * T);
  const double scale = 1 / std::sqrt(static_cast<double>(hd));
  auto at = [&](std::int64_t b, std::int64_t t, std::int64_t col) { return (b * T + t) * W + col; };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t kv = h / group, qc = h * hd, kc = C + kv * hd, vc = C + KVH * hd + kv * hd;
      std::vector<double> P(T * T, 0.0), dP(T * T, 0.0);
      for (std::int64_t i = 0; i < T; ++i) {
        double mx = -INFINITY;
        for (std::int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (std::int64_t d = 0; d < hd; ++d) s += X[at(b, i, qc + d)] * X[at(b, j, kc + d)];
          P[i * T + j] = s * scale;
          mx = std::max(mx, s * scale);
        }
        double sum = 0;
        for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(P[i * T + j] - mx);
        want_lse[(b * H + h) * T + i] = mx + std::log(sum);
        for (std::int64_t j = 0; j <= i; ++j) P[i * T + j] = std::exp(P[i * T + j] - mx) / sum;
        for (std::int64_t d = 0; d < hd; ++d) {
          double o = 0;
          for (std::int64_t j = 0; j <= i; ++j) o += P[i * T + j] * X[at(b, j, vc + d)];
          want_out[(b * T + i) * C + qc + d] = o;
        }
      }
      for (std::int64_t i = 0; i < T; ++i) {
        double rowdot = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (std::int64_t d = 0; d < hd; ++d) s += DO[(b * T + i) * C + qc + d] * X[at(b, j, vc + d)];
          dP[i * T + j] = s;
          rowdot += P[i * T + j] * s;
        }
        for (std::int64_t j = 0; j <= i; ++j) {
          const double ds = P[i * T + j] * (dP[i * T + j] - rowdot) * scale;
          for (std::int64_t d = 0; d < hd; ++d) {
            want_d[at(b, i, qc + d)] += ds * X[at(b, j, kc + d)];
            want_d[at(b, j, kc + d)] += ds * X[at(b, i, qc + d)];
            want_d[at(b, j, vc + d)] += P[i * T + j] * DO[(b * T + i) * C + qc + d];
          }
        }
      }
    }
  const double tol = tolerance(c.dt);
  EXPECT_LT(normwise_error(out.values(), want_out), tol) << "output";
  std::vector<double> got_lse(lse.begin(), lse.end());
  EXPECT_LT(normwise_error(got_lse, want_lse), 1e-3) << "log-sum-exp";
  EXPECT_LT(normwise_error(dqkv.values(), want_d), tol) << "qkv gradient (every element overwritten)";
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmulatedFlashAttention,
                         ::testing::Values(AttentionCase{kBF16, 1, 1, 2, 2, 64},    // one row
                                           AttentionCase{kF16, 1, 64, 2, 2, 64},    // one whole tile
                                           AttentionCase{kBF16, 2, 100, 4, 2, 64},  // grouped, ends in a tile
                                           AttentionCase{kF16, 1, 130, 2, 1, 32},   // one key/value head
                                           AttentionCase{kBF16, 1, 77, 3, 3, 96},   // odd head count
                                           AttentionCase{kF16, 1, 70, 2, 1, 128}),  // Llama-3's head size
                         [](const auto& info) {
                           std::ostringstream name;
                           name << info.param;
                           return name.str();
                         });

}  // namespace
