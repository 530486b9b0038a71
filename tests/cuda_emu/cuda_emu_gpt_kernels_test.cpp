// The rest of the layers' kernel files and optimizer.cu on the CPU through the emulation (see
// cuda_emu_test.cpp): the GPT's layers (embeddings with their atomics and position sums
// (embedding.cu), GELU, bias add and gradient, the element-wise ops and casts (pointwise.cu), the
// materialized attention's causal softmax (causal_softmax.cu), the squared error (loss.cu)) and
// the optimizer's SGD and dynamic loss scaling, against f64 references.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_emu.hpp"
#include "emu_support.hpp"
#include "kernels.cuh"

namespace {

namespace cu = coshard::modules::cuda;
namespace detail = coshard::modules::detail;
using namespace coshard::cuda_emu_test;

TEST(EmulatedGptKernels, EmbeddingsForwardAndBackward) {
  const std::int64_t B = 3, T = 5, C = 40, vocab = 7;
  std::vector<std::int32_t> tokens;
  for (std::int64_t i = 0; i < B * T; ++i) tokens.push_back(static_cast<std::int32_t>((i * 3) % 4));  // repeats
  Stored wte(kF32, random_values(vocab * C, 61)), wpe(kF32, random_values(T * C, 62));
  Stored out(kF32, std::vector<double>(B * T * C)), dout(kF32, random_values(B * T * C, 63));
  Stored dwte(kF32, std::vector<double>(vocab * C, 0.5)), dwpe(kF32, std::vector<double>(T * C, -0.5));
  ASSERT_EQ(cu::embedding_forward(nullptr, kF32, tokens.data(), wte.data(), wpe.data(), out.data(), B, T, C, vocab, 0, vocab), 0);
  ASSERT_EQ(cu::embedding_backward(nullptr, kF32, tokens.data(), dout.data(), dwte.data(), dwpe.data(), B, T, C, 0, vocab), 0);
  const auto E = wte.values(), P = wpe.values(), D = dout.values();
  std::vector<double> want_out(B * T * C), want_dwte(vocab * C, 0.5), want_dwpe(T * C, -0.5);
  for (std::int64_t r = 0; r < B * T; ++r)
    for (std::int64_t c = 0; c < C; ++c) {
      want_out[r * C + c] = E[tokens[r] * C + c] + P[(r % T) * C + c];
      want_dwte[tokens[r] * C + c] += D[r * C + c];
      want_dwpe[(r % T) * C + c] += D[r * C + c];
    }
  EXPECT_LT(normwise_error(out.values(), want_out), 1e-6);
  EXPECT_LT(normwise_error(dwte.values(), want_dwte), 1e-6) << "token rows added to, repeated tokens summed";
  EXPECT_LT(normwise_error(dwpe.values(), want_dwpe), 1e-6);
  // a token outside the vocabulary gives NaN, not another row
  tokens[4] = static_cast<std::int32_t>(vocab);
  ASSERT_EQ(cu::embedding_forward(nullptr, kF32, tokens.data(), wte.data(), nullptr, out.data(), B, T, C, vocab, 0, vocab), 0);
  EXPECT_TRUE(std::isnan(out.values()[4 * C]));
}

TEST(EmulatedGptKernels, GeluForwardAndBackward) {
  const std::int64_t n = 700;
  Stored x(kBF16, random_values(n, 71, 4.0)), dout(kBF16, random_values(n, 72));
  Stored y(kBF16, std::vector<double>(n)), dx(kBF16, std::vector<double>(n));
  ASSERT_EQ(cu::gelu_forward(nullptr, kBF16, x.data(), y.data(), n), 0);
  ASSERT_EQ(cu::gelu_backward(nullptr, kBF16, x.data(), dout.data(), dx.data(), n), 0);
  const auto X = x.values(), D = dout.values();
  std::vector<double> want_y(n), want_dx(n);
  const double k = std::sqrt(2 / M_PI), a = 0.044715;
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = X[i], th = std::tanh(k * (v + a * v * v * v));
    want_y[i] = 0.5 * v * (1 + th);
    want_dx[i] = D[i] * (0.5 * (1 + th) + 0.5 * v * (1 - th * th) * k * (1 + 3 * a * v * v));
  }
  EXPECT_LT(normwise_error(y.values(), want_y), tolerance(kBF16));
  EXPECT_LT(normwise_error(dx.values(), want_dx), tolerance(kBF16));
}

TEST(EmulatedGptKernels, CausalSoftmaxForwardAndBackward) {
  const std::int64_t matrices = 2, T = 40;  // rows longer than a warp, shorter than a block
  const float scale = 0.125f;
  Stored probs(kF32, random_values(matrices * T * T, 81, 8.0)), dprobs(kF32, random_values(matrices * T * T, 82));
  const auto S = probs.values(), DP = dprobs.values();
  ASSERT_EQ(cu::causal_softmax(nullptr, kF32, probs.data(), matrices, T, scale), 0);
  ASSERT_EQ(cu::causal_softmax_backward(nullptr, kF32, probs.data(), dprobs.data(), matrices, T), 0);
  std::vector<double> want_p(matrices * T * T, 0.0), want_d(matrices * T * T, 0.0);
  for (std::int64_t row = 0; row < matrices * T; ++row) {
    const std::int64_t i = row % T;
    double mx = -INFINITY, sum = 0, dot = 0;
    for (std::int64_t j = 0; j <= i; ++j) mx = std::max(mx, S[row * T + j] * scale);
    for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(S[row * T + j] * scale - mx);
    for (std::int64_t j = 0; j <= i; ++j) {
      want_p[row * T + j] = std::exp(S[row * T + j] * scale - mx) / sum;
      dot += want_p[row * T + j] * DP[row * T + j];
    }
    for (std::int64_t j = 0; j <= i; ++j) want_d[row * T + j] = want_p[row * T + j] * (DP[row * T + j] - dot);
  }
  EXPECT_LT(normwise_error(probs.values(), want_p), 1e-5) << "zeros above the diagonal";
  EXPECT_LT(normwise_error(dprobs.values(), want_d), 1e-5);
}

TEST(EmulatedGptKernels, BiasElementwiseSquaredErrorAndCasts) {
  const std::int64_t N = 70, C = 72;  // more rows than a column sum's lanes, columns past a tile
  Stored out(kF16, random_values(N * C, 91)), bias(kF16, random_values(C, 92));
  const auto O = out.values(), Bv = bias.values();
  Stored dbias(kF16, std::vector<double>(C, 0.25));
  ASSERT_EQ(cu::bias_add(nullptr, kF16, out.data(), bias.data(), N, C), 0);
  ASSERT_EQ(cu::bias_grad(nullptr, kF16, out.data(), dbias.data(), N, C), 0);
  std::vector<double> want_out(N * C), want_db(C, 0.25);
  for (std::int64_t r = 0; r < N; ++r)
    for (std::int64_t c = 0; c < C; ++c) want_out[r * C + c] = O[r * C + c] + Bv[c];
  const auto added = out.values();
  for (std::int64_t r = 0; r < N; ++r)
    for (std::int64_t c = 0; c < C; ++c) want_db[c] += added[r * C + c];
  EXPECT_LT(normwise_error(added, want_out), tolerance(kF16));
  EXPECT_LT(normwise_error(dbias.values(), want_db), tolerance(kF16));

  const std::int64_t n = 1000;
  Stored a(kF32, random_values(n, 93)), b(kF32, random_values(n, 94)), sum(kF32, std::vector<double>(n)),
      prod(kF32, std::vector<double>(n));
  ASSERT_EQ(cu::add(nullptr, kF32, a.data(), b.data(), sum.data(), n), 0);
  ASSERT_EQ(cu::mul(nullptr, kF32, a.data(), b.data(), prod.data(), n), 0);
  ASSERT_EQ(cu::scale(nullptr, kF32, prod.data(), -2.0f, n), 0);
  std::vector<float> loss(1), squares(n), seed{3.0f};
  Stored dpred(kF32, std::vector<double>(n));
  ASSERT_EQ(cu::mse_forward(nullptr, kF32, a.data(), b.data(), loss.data(), squares.data(), n), 0);
  ASSERT_EQ(cu::mse_backward(nullptr, kF32, a.data(), b.data(), seed.data(), dpred.data(), n), 0);
  const auto A = a.values(), Bn = b.values();
  std::vector<double> want_sum(n), want_prod(n), want_dpred(n);
  double want_loss = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    want_sum[i] = A[i] + Bn[i];
    want_prod[i] = -2 * A[i] * Bn[i];
    want_loss += (A[i] - Bn[i]) * (A[i] - Bn[i]) / n;
    want_dpred[i] = 2 * 3.0 * (A[i] - Bn[i]) / n;
  }
  EXPECT_LT(normwise_error(sum.values(), want_sum), 1e-6);
  EXPECT_LT(normwise_error(prod.values(), want_prod), 1e-6);
  EXPECT_NEAR(loss[0], want_loss, 1e-5 * want_loss);
  EXPECT_LT(normwise_error(dpred.values(), want_dpred), 1e-6);

  Stored half(kBF16, std::vector<double>(n)), back(kF32, std::vector<double>(n));
  ASSERT_EQ(cu::cast(nullptr, kF32, a.data(), kBF16, half.data(), n), 0);
  ASSERT_EQ(cu::cast(nullptr, kBF16, half.data(), kF32, back.data(), n), 0);
  EXPECT_EQ(back.values(), Stored(kBF16, A).values()) << "f32 -> bf16 -> f32 is bf16's rounding";
}

TEST(EmulatedOptimizer, SgdWithMomentumAndDynamicLossScaling) {
  const std::int64_t n = 600;
  const auto w0 = random_values(n, 101);
  std::vector<float> master(w0.begin(), w0.end()), buf(n, 0.0f);
  const double loss_scale = 1024;
  auto gv = random_values(n, 102);
  for (auto& g : gv) g *= loss_scale;  // gradients of a scaled loss
  Stored grad(kF16, gv), param(kF16, std::vector<double>(n));
  detail::StepState st;
  st.loss_scale = static_cast<float>(loss_scale);
  const detail::SgdArgs args{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true};
  const detail::LossScaleArgs scaling{.dynamic = true, .growth_interval = 2};
  auto step = [&] {
    ASSERT_EQ(cu::step_begin(nullptr, &st), 0);
    ASSERT_EQ(cu::grad_stats(nullptr, kF16, grad.data(), n, &st), 0);
    ASSERT_EQ(cu::sgd(nullptr, master.data(), kF16, grad.data(), buf.data(), kF16, param.data(), n, args, &st), 0);
    ASSERT_EQ(cu::step_end(nullptr, &st, scaling), 0);
  };
  // two steps by hand in f64: SGD with Nesterov momentum on unscaled gradients
  const auto G = grad.values();
  std::vector<double> w(master.begin(), master.end()), b(n, 0.0);
  for (int s = 0; s < 2; ++s)
    for (std::int64_t i = 0; i < n; ++i) {
      const double g = G[i] / loss_scale + 0.01 * w[i];
      b[i] = s == 0 ? g : 0.9 * b[i] + g;
      w[i] -= 0.1 * (g + 0.9 * b[i]);
    }
  step();
  step();
  EXPECT_EQ(st.step, 2);
  EXPECT_EQ(st.loss_scale, 2048.0f) << "grown after growth_interval good steps";
  EXPECT_LT(normwise_error(std::vector<double>(master.begin(), master.end()), w), 1e-5);
  EXPECT_EQ(param.values(), Stored(kF16, std::vector<double>(master.begin(), master.end())).values());
  // an infinite gradient: the step is skipped, nothing moves, and the scale backs off
  const auto before = master;
  grad.f16[17] = __half{0x7c00};
  step();
  EXPECT_EQ(st.step, 2);
  EXPECT_EQ(st.last_skipped, 1);
  EXPECT_EQ(st.skipped_steps, 1);
  EXPECT_EQ(st.loss_scale, 1024.0f);
  EXPECT_EQ(master, before);
}

}  // namespace
