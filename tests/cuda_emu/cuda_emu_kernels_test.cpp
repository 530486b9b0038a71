// More of coshard's CUDA kernel files on the CPU through the emulation (see cuda_emu_test.cpp):
// the ones no GPU had run when they were written. Against f64 references from the same stored
// inputs:
//   - the one-pass (online-softmax) cross-entropy (loss.cu): loss and logits' gradient, a
//     vocabulary that ends inside a thread stride, masked (-inf) logits, a target out of range;
//   - SwiGLU and rotary embeddings (pointwise.cu), forward and backward / inverse, from a first
//     position; the decoding attention over a key/value cache (attention_decode.cu);
//   - the multi-tensor AdamW and gradient statistics (optimizer.cu): the same bits as the
//     one-tensor kernels, lists split at 32 tensors, tensors of several chunks, clipping.
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

// ---- cross-entropy ----

class EmulatedCrossEntropy : public ::testing::TestWithParam<int> {};

// The f64 reference of N rows of logits L [N, V] against `targets`: each row's loss, their mean,
// and the logits' gradient seeded with `seed`.
struct CrossEntropyReference {
  std::vector<double> rows, dlogits;
  double loss = 0;
};
CrossEntropyReference cross_entropy_reference(const std::vector<double>& L, const std::vector<std::int32_t>& targets,
                                              std::int64_t N, std::int64_t V, double seed) {
  CrossEntropyReference r{std::vector<double>(N), std::vector<double>(N * V), 0};
  for (std::int64_t i = 0; i < N; ++i) {
    double mx = -INFINITY, sum = 0;
    for (std::int64_t j = 0; j < V; ++j) mx = std::max(mx, L[i * V + j]);
    for (std::int64_t j = 0; j < V; ++j) sum += std::exp(L[i * V + j] - mx);
    r.rows[i] = std::log(sum) + mx - L[i * V + targets[i]];
    r.loss += r.rows[i] / N;
    for (std::int64_t j = 0; j < V; ++j)
      r.dlogits[i * V + j] = (std::exp(L[i * V + j] - mx) / sum - (j == targets[i] ? 1 : 0)) * seed / N;
  }
  return r;
}

TEST_P(EmulatedCrossEntropy, OnePassMatchesTheReference) {
  const int dt = GetParam();
  const std::int64_t N = 7, V = 1000;  // V: 3 strides of 256 threads and a part
  auto lv = random_values(static_cast<std::size_t>(N * V), 31, 4.0);
  lv[2 * V + 5] = 12.0;  // a row whose maximum comes late in a thread's slice
  for (std::int64_t j = 0; j < V; j += 3) lv[3 * V + j] = -INFINITY;  // masked logits add nothing
  Stored logits(dt, lv);
  std::vector<std::int32_t> targets{0, 999, 5, 4, 500, 1, 256};
  std::vector<float> loss(1), rows(N), seed{2.0f};
  ASSERT_EQ(cu::cross_entropy_forward(nullptr, dt, logits.data(), targets.data(), loss.data(), rows.data(), N, V), 0);
  Stored dlogits(dt, std::vector<double>(N * V, 9.0));
  ASSERT_EQ(cu::cross_entropy_backward(nullptr, dt, logits.data(), targets.data(), seed.data(), dlogits.data(), N, V),
            0);
  const auto want = cross_entropy_reference(logits.values(), targets, N, V, seed[0]);
  for (std::int64_t i = 0; i < N; ++i)
    EXPECT_NEAR(rows[i], want.rows[i], 1e-4 * std::max(1.0, std::abs(want.rows[i]))) << "row " << i;
  EXPECT_NEAR(loss[0], want.loss, 1e-4 * want.loss);
  EXPECT_LT(normwise_error(dlogits.values(), want.dlogits), tolerance(dt)) << "logits' gradient";
  // a target outside [0, V) gives a NaN loss (documented in kernels.hpp)
  targets[4] = static_cast<std::int32_t>(V);
  ASSERT_EQ(cu::cross_entropy_forward(nullptr, dt, logits.data(), targets.data(), loss.data(), rows.data(), N, V), 0);
  EXPECT_TRUE(std::isnan(loss[0]));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmulatedCrossEntropy, ::testing::Values(kF32, kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---- the vocabulary-parallel cross-entropy and embedding (tensor parallelism) ----

// Two ranks' columns of the logits through row_max, vocab_ce_sums and vocab_ce_loss / _backward,
// the all-reduces (max, then sum) done here between the steps: the whole logits' loss and gradient.
TEST_P(EmulatedCrossEntropy, VocabularyParallelPartsGiveTheWholeLossAndGradient) {
  const int dt = GetParam();
  const std::int64_t N = 5, V = 1000, P = 2, Vp = V / P;  // a part: 500 columns (not a whole stride)
  const auto lv = random_values(static_cast<std::size_t>(N * V), 33, 4.0);
  const std::vector<std::int32_t> targets{0, 999, 499, 500, 250};  // both sides of the split
  std::vector<Stored> parts;
  for (std::int64_t p = 0; p < P; ++p) {
    std::vector<double> part(static_cast<std::size_t>(N * Vp));
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t j = 0; j < Vp; ++j) part[i * Vp + j] = lv[i * V + p * Vp + j];
    parts.emplace_back(dt, part);
  }
  std::vector<float> max(N, -INFINITY), sums(2 * N, 0.0f);
  for (std::int64_t p = 0; p < P; ++p) {
    std::vector<float> mine(N);
    ASSERT_EQ(cu::row_max(nullptr, dt, parts[p].data(), mine.data(), N, Vp), 0);
    for (std::int64_t i = 0; i < N; ++i) max[i] = std::max(max[i], mine[i]);
  }
  for (std::int64_t p = 0; p < P; ++p) {
    std::vector<float> mine(2 * N);
    ASSERT_EQ(cu::vocab_ce_sums(nullptr, dt, parts[p].data(), targets.data(), max.data(), mine.data(), N, Vp, p * Vp, V), 0);
    for (std::int64_t i = 0; i < 2 * N; ++i) sums[i] += mine[i];
  }
  std::vector<float> loss(1), seed{2.0f};
  ASSERT_EQ(cu::vocab_ce_loss(nullptr, max.data(), sums.data(), loss.data(), N), 0);
  std::vector<double> got_d(static_cast<std::size_t>(N * V));
  for (std::int64_t p = 0; p < P; ++p) {
    Stored d(dt, std::vector<double>(N * Vp, 9.0));
    ASSERT_EQ(cu::vocab_ce_backward(nullptr, dt, parts[p].data(), targets.data(), max.data(), sums.data(), seed.data(),
                                    d.data(), N, Vp, p * Vp),
              0);
    const auto dv = d.values();
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t j = 0; j < Vp; ++j) got_d[i * V + p * Vp + j] = dv[i * Vp + j];
  }
  // The reference from the stored (rounded) logits, whole.
  std::vector<double> L(static_cast<std::size_t>(N * V));
  for (std::int64_t p = 0; p < P; ++p) {
    const auto v = parts[p].values();
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t j = 0; j < Vp; ++j) L[i * V + p * Vp + j] = v[i * Vp + j];
  }
  const auto want = cross_entropy_reference(L, targets, N, V, seed[0]);
  EXPECT_NEAR(loss[0], want.loss, 1e-4 * want.loss);
  EXPECT_LT(normwise_error(got_d, want.dlogits), tolerance(dt)) << "the logits' gradient, put together";
  // a target outside the whole vocabulary: a NaN loss
  std::vector<std::int32_t> bad = targets;
  bad[1] = static_cast<std::int32_t>(V);
  std::vector<float> mine(2 * N);
  ASSERT_EQ(cu::vocab_ce_sums(nullptr, dt, parts[0].data(), bad.data(), max.data(), mine.data(), N, Vp, 0, V), 0);
  EXPECT_TRUE(std::isnan(mine[N + 1]));
}

// The output layer fused with its loss (FusedCrossEntropyLoss): the logits come a chunk of
// columns at a time, uneven chunks, through chunk_ce_sums's running max and sums, then
// vocab_ce_loss and each chunk's vocab_ce_backward in place: the whole logits' loss and gradient.
// A row's first chunk wholly masked (-inf), and a target out of range (a NaN loss).
TEST_P(EmulatedCrossEntropy, ChunksOfColumnsGiveTheWholeLossAndGradient) {
  const int dt = GetParam();
  const std::int64_t N = 6, V = 1000;
  const std::int64_t bounds[] = {0, 384, 768, 1000};  // chunks of 384, 384 and 232 columns
  auto lv = random_values(static_cast<std::size_t>(N * V), 35, 4.0);
  lv[1 * V + 900] = 15.0;                                   // a row's max in the last chunk
  for (std::int64_t j = 0; j < 384; ++j) lv[2 * V + j] = -INFINITY;  // a row's first chunk masked
  const std::vector<std::int32_t> targets{0, 900, 500, 383, 384, 999};
  std::vector<Stored> chunks;
  for (int c = 0; c < 3; ++c) {
    const std::int64_t w = bounds[c + 1] - bounds[c];
    std::vector<double> part(static_cast<std::size_t>(N * w));
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t j = 0; j < w; ++j) part[i * w + j] = lv[i * V + bounds[c] + j];
    chunks.emplace_back(dt, part);
  }
  std::vector<float> max(N, 7.0f), sums(2 * N, 7.0f);  // (garbage: the first chunk starts them)
  for (int c = 0; c < 3; ++c)
    ASSERT_EQ(cu::chunk_ce_sums(nullptr, dt, chunks[c].data(), targets.data(), max.data(), sums.data(), N,
                                bounds[c + 1] - bounds[c], bounds[c], V),
              0);
  std::vector<float> loss(1), seed{2.0f};
  ASSERT_EQ(cu::vocab_ce_loss(nullptr, max.data(), sums.data(), loss.data(), N), 0);
  std::vector<double> got_d(static_cast<std::size_t>(N * V)), L(static_cast<std::size_t>(N * V));
  for (int c = 0; c < 3; ++c) {
    const std::int64_t w = bounds[c + 1] - bounds[c];
    const auto before = chunks[c].values();
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t j = 0; j < w; ++j) L[i * V + bounds[c] + j] = before[i * w + j];
    ASSERT_EQ(cu::vocab_ce_backward(nullptr, dt, chunks[c].data(), targets.data(), max.data(), sums.data(),
                                    seed.data(), chunks[c].data(), N, w, bounds[c]),
              0);  // in place, as the fused layer runs it
    const auto dv = chunks[c].values();
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t j = 0; j < w; ++j) got_d[i * V + bounds[c] + j] = dv[i * w + j];
  }
  const auto want = cross_entropy_reference(L, targets, N, V, seed[0]);
  EXPECT_NEAR(loss[0], want.loss, 1e-5 * want.loss);
  for (std::int64_t i = 0; i < N; ++i) {
    double mx = -INFINITY;
    for (std::int64_t j = 0; j < V; ++j) mx = std::max(mx, L[i * V + j]);
    EXPECT_EQ(max[i], static_cast<float>(mx)) << "row " << i << "'s max";
    EXPECT_EQ(sums[N + i], static_cast<float>(L[i * V + targets[i]])) << "row " << i << "'s target logit";
  }
  EXPECT_LT(normwise_error(got_d, want.dlogits), tolerance(dt)) << "the logits' gradient, chunk by chunk";
  // a target outside the vocabulary: a NaN loss, whichever chunk is last
  std::vector<std::int32_t> bad = targets;
  bad[3] = -1;
  for (int c = 0; c < 3; ++c)
    ASSERT_EQ(cu::chunk_ce_sums(nullptr, dt, chunks[c].data(), bad.data(), max.data(), sums.data(), N,
                                bounds[c + 1] - bounds[c], bounds[c], V),
              0);
  ASSERT_EQ(cu::vocab_ce_loss(nullptr, max.data(), sums.data(), loss.data(), N), 0);
  EXPECT_TRUE(std::isnan(loss[0]));
}

TEST(EmulatedTensorParallelKernels, AVocabularyPartEmbedsItsRowsAndZerosTheRest) {
  const std::int64_t B = 2, T = 3, C = 40, vocab = 8, first = 4, rows = 4;  // this table: tokens 4-7
  const std::vector<std::int32_t> tokens{1, 4, 7, 5, 0, 4};
  Stored wte(kF32, random_values(rows * C, 81));
  Stored out(kF32, std::vector<double>(B * T * C, 9.0)), dout(kF32, random_values(B * T * C, 82));
  Stored dwte(kF32, std::vector<double>(rows * C, 0.5));
  ASSERT_EQ(cu::embedding_forward(nullptr, kF32, tokens.data(), wte.data(), nullptr, out.data(), B, T, C, vocab, first, rows), 0);
  ASSERT_EQ(cu::embedding_backward(nullptr, kF32, tokens.data(), dout.data(), dwte.data(), nullptr, B, T, C, first, rows), 0);
  const auto E = wte.values(), D = dout.values();
  std::vector<double> want_out(B * T * C, 0.0), want_dwte(rows * C, 0.5);
  for (std::int64_t r = 0; r < B * T; ++r) {
    const std::int64_t at = tokens[r] - first;
    if (at < 0 || at >= rows) continue;  // another rank's row: zeros, no gradient here
    for (std::int64_t c = 0; c < C; ++c) {
      want_out[r * C + c] = E[at * C + c];
      want_dwte[at * C + c] += D[r * C + c];
    }
  }
  EXPECT_LT(normwise_error(out.values(), want_out), 1e-6);
  EXPECT_LT(normwise_error(dwte.values(), want_dwte), 1e-6) << "this table's rows only, repeated tokens summed";
}

// ---- SwiGLU and rotary embeddings ----

TEST(EmulatedLlamaKernels, SwiGluForwardAndBackward) {
  const std::int64_t N = 5, I = 300;
  Stored gate_up(kBF16, random_values(static_cast<std::size_t>(N * 2 * I), 41, 3.0));
  Stored dout(kBF16, random_values(static_cast<std::size_t>(N * I), 42));
  Stored out(kBF16, std::vector<double>(N * I)), dgu(kBF16, std::vector<double>(N * 2 * I, 9.0));
  ASSERT_EQ(cu::swiglu_forward(nullptr, kBF16, gate_up.data(), out.data(), N, I), 0);
  ASSERT_EQ(cu::swiglu_backward(nullptr, kBF16, gate_up.data(), dout.data(), dgu.data(), N, I), 0);
  const auto GU = gate_up.values(), D = dout.values();
  std::vector<double> want_out(N * I), want_d(N * 2 * I);
  for (std::int64_t r = 0; r < N; ++r)
    for (std::int64_t j = 0; j < I; ++j) {
      const double g = GU[r * 2 * I + j], u = GU[r * 2 * I + I + j], sg = 1 / (1 + std::exp(-g));
      want_out[r * I + j] = g * sg * u;
      want_d[r * 2 * I + j] = D[r * I + j] * u * sg * (1 + g * (1 - sg));
      want_d[r * 2 * I + I + j] = D[r * I + j] * g * sg;
    }
  EXPECT_LT(normwise_error(out.values(), want_out), tolerance(kBF16));
  EXPECT_LT(normwise_error(dgu.values(), want_d), tolerance(kBF16));
}

TEST(EmulatedLlamaKernels, RotaryTurnsPairsByPositionAndBack) {
  // transformers' convention: dimension i pairs with i + hd/2; the last head is not rotated
  const std::int64_t B = 2, T = 9, heads = 3, rotated = 2, hd = 16, half = hd / 2;
  Stored x(kF32, random_values(static_cast<std::size_t>(B * T * heads * hd), 51));
  std::vector<float> inv_freq(half);
  for (std::int64_t i = 0; i < half; ++i) inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / hd));
  Stored turned(kF32, std::vector<double>(B * T * heads * hd)), back(kF32, std::vector<double>(B * T * heads * hd));
  ASSERT_EQ(cu::rope(nullptr, kF32, x.data(), turned.data(), inv_freq.data(), B, T, heads, rotated, hd, false), 0);
  ASSERT_EQ(cu::rope(nullptr, kF32, turned.data(), back.data(), inv_freq.data(), B, T, heads, rotated, hd, true), 0);
  const auto X = x.values();
  std::vector<double> want(X.size());
  for (std::int64_t row = 0; row < B * T; ++row)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < half; ++i) {
        const std::int64_t at = (row * heads + h) * hd + i;
        const double a = h < rotated ? static_cast<double>(row % T) * inv_freq[i] : 0.0;
        want[at] = X[at] * std::cos(a) - X[at + half] * std::sin(a);
        want[at + half] = X[at + half] * std::cos(a) + X[at] * std::sin(a);
      }
  EXPECT_LT(normwise_error(turned.values(), want), 1e-5);
  EXPECT_LT(normwise_error(back.values(), X), 1e-5) << "the inverse turns back";
}

// Decoding: rows of a sequence rotated from a first position equal the same rows of the whole
// sequence rotated from 0.
TEST(EmulatedLlamaKernels, RotaryFromAFirstPositionContinuesTheSequence) {
  const std::int64_t T = 9, heads = 2, rotated = 2, hd = 8, first = 6, W = heads * hd;
  Stored x(kF32, random_values(static_cast<std::size_t>(T * W), 52));
  std::vector<float> inv_freq(hd / 2);
  for (std::int64_t i = 0; i < hd / 2; ++i) inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / hd));
  Stored whole(kF32, std::vector<double>(T * W)), tail(kF32, std::vector<double>((T - first) * W));
  ASSERT_EQ(cu::rope(nullptr, kF32, x.data(), whole.data(), inv_freq.data(), 1, T, heads, rotated, hd, false), 0);
  const auto X = x.values();
  Stored rest(kF32, std::vector<double>(X.begin() + first * W, X.end()));
  ASSERT_EQ(cu::rope(nullptr, kF32, rest.data(), tail.data(), inv_freq.data(), 1, T - first, heads, rotated, hd, false,
                     first),
            0);
  const auto all = whole.values();
  EXPECT_LT(normwise_error(tail.values(), std::vector<double>(all.begin() + first * W, all.end())), 1e-6);
}

// Decoding with a key/value cache (attention_decode.cu): the new rows of a cache attend as
// in a causal attention over the whole sequence (a f64 reference), grouped-query included, with
// rows of the cache past the sequence left out.
class EmulatedAttentionDecode : public ::testing::TestWithParam<int> {};

TEST_P(EmulatedAttentionDecode, NewRowsAttendOverTheCacheUpToThemselves) {
  const int dt = GetParam();
  const std::int64_t B = 2, Tmax = 12, first = 5, Tn = 3, H = 4, KVH = 2, hd = 16;
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, group = H / KVH;
  auto values = random_values(static_cast<std::size_t>(B * Tmax * W), 53, 1.0);
  Stored cache(dt, values);
  const auto Q = cache.values();  // (as stored: bf16 rounds)
  Stored out(dt, std::vector<double>(B * Tn * C, 7.0));
  std::vector<float> scratch(static_cast<std::size_t>(B * Tn * H * (first + Tn)));
  ASSERT_EQ(cu::attention_decode(nullptr, dt, cache.data(), out.data(), scratch.data(), B, Tmax, first, Tn, H, KVH, hd), 0);
  std::vector<double> want(static_cast<std::size_t>(B * Tn * C));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < Tn; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t at = first + i, kv = C + (h / group) * hd;
        std::vector<double> p(static_cast<std::size_t>(at + 1));
        double mx = -INFINITY, sum = 0;
        for (std::int64_t j = 0; j <= at; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < hd; ++d) dot += Q[(b * Tmax + at) * W + h * hd + d] * Q[(b * Tmax + j) * W + kv + d];
          p[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, p[j]);
        }
        for (auto& v : p) sum += (v = std::exp(v - mx));
        for (std::int64_t d = 0; d < hd; ++d) {
          double acc = 0;
          for (std::int64_t j = 0; j <= at; ++j) acc += p[j] * Q[(b * Tmax + j) * W + kv + KVH * hd + d];
          want[(b * Tn + i) * C + h * hd + d] = acc / sum;
        }
      }
  EXPECT_LT(normwise_error(out.values(), want), tolerance(dt));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmulatedAttentionDecode, ::testing::Values(kF32, kBF16, kF16));

// ---- multi-tensor AdamW ----

// One optimizer step over `sizes` tensors of bf16 gradients, from the same start: multi-tensor or
// one launch a tensor. The masters, moments and bf16 parameters after it.
struct AdamRun {
  std::vector<std::vector<float>> master, m, v;
  std::vector<Stored> params;
  detail::StepState state;
};

// Tensor k's start, fixed by k: f32 masters and moments (the second non-negative), bf16 gradients.
struct AdamStart {
  std::vector<float> master, m, v;
  Stored grad;
};

AdamStart adam_start(std::size_t k, std::int64_t size) {
  const auto n = static_cast<std::size_t>(size);
  const auto w = random_values(n, 100 + k), m0 = random_values(n, 200 + k, 0.1);
  auto v0 = random_values(n, 300 + k, 0.01);
  for (auto& x : v0) x = std::abs(x);
  return {{w.begin(), w.end()}, {m0.begin(), m0.end()}, {v0.begin(), v0.end()},
          Stored(kBF16, random_values(n, 400 + k, 0.5))};
}

AdamRun adam_step(const std::vector<std::int64_t>& sizes, bool multi, float max_grad_norm) {
  AdamRun run;
  std::vector<Stored> grads;
  std::vector<detail::OptimizerTensor> list;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    AdamStart start = adam_start(k, sizes[k]);
    run.master.push_back(std::move(start.master));
    run.m.push_back(std::move(start.m));
    run.v.push_back(std::move(start.v));
    grads.push_back(std::move(start.grad));
    run.params.emplace_back(kBF16, std::vector<double>(static_cast<std::size_t>(sizes[k])));
  }
  for (std::size_t k = 0; k < sizes.size(); ++k)
    list.push_back({run.master[k].data(), grads[k].data(), run.m[k].data(), run.v[k].data(), run.params[k].data(),
                    sizes[k], kBF16, kBF16});
  detail::AdamArgs args{.lr = 1e-2f, .weight_decay = 0.1f, .max_grad_norm = max_grad_norm};
  run.state.step = 3;
  EXPECT_EQ(cu::step_begin(nullptr, &run.state), 0);
  if (multi) {
    EXPECT_EQ(cu::grad_stats_multi(nullptr, list.data(), static_cast<int>(list.size()), &run.state), 0);
    EXPECT_EQ(cu::adamw_multi(nullptr, list.data(), static_cast<int>(list.size()), args, &run.state), 0);
  } else {
    for (const auto& t : list) EXPECT_EQ(cu::grad_stats(nullptr, t.gdt, t.grad, t.n, &run.state), 0);
    for (const auto& t : list)
      EXPECT_EQ(cu::adamw(nullptr, t.master, t.gdt, t.grad, t.state1, t.state2, t.pdt, t.param_out, t.n, args,
                          &run.state),
                0);
  }
  EXPECT_EQ(cu::step_end(nullptr, &run.state, {}), 0);
  return run;
}

TEST(EmulatedMultiTensorAdamW, MatchesOneTensorLaunchesAndTheReference) {
  // 40 tensors: two lists of at most 32; one of two chunks and a part (65,536 elements a chunk)
  std::vector<std::int64_t> sizes{140000, 1, 300};
  for (int k = 0; k < 37; ++k) sizes.push_back(17 + 5 * k);
  const auto multi = adam_step(sizes, true, 0.0f);
  const auto single = adam_step(sizes, false, 0.0f);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    ASSERT_EQ(multi.master[k], single.master[k]) << "tensor " << k << ": the same bits without clipping";
    ASSERT_EQ(multi.m[k], single.m[k]) << "tensor " << k;
    ASSERT_EQ(multi.v[k], single.v[k]) << "tensor " << k;
    ASSERT_EQ(multi.params[k].values(), single.params[k].values()) << "tensor " << k;
  }
  EXPECT_EQ(multi.state.step, 4);
  EXPECT_NEAR(multi.state.grad_sumsq, single.state.grad_sumsq, 1e-4 * single.state.grad_sumsq);

  // Clipped to a norm below the gradients': against AdamW in f64.
  const float clip = 1.0f;
  const auto clipped = adam_step(sizes, true, clip);
  double sumsq = 0;
  std::vector<AdamStart> starts;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    starts.push_back(adam_start(k, sizes[k]));
    for (double x : starts.back().grad.values()) sumsq += x * x;
  }
  const double norm = std::sqrt(sumsq), factor = norm > clip ? clip / (norm + 1e-6) : 1.0;
  ASSERT_GT(norm, clip);
  EXPECT_NEAR(clipped.state.last_grad_norm, norm, 1e-4 * norm);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  const double bc1 = 1 - std::pow(b1, 4), bc2 = 1 - std::pow(b2, 4);
  double err = 0, ref = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const AdamStart& start = starts[k];
    const auto g = start.grad.values();
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double gi = g[i] * factor;
      const double mi = b1 * start.m[i] + (1 - b1) * gi;
      const double vi = b2 * start.v[i] + (1 - b2) * gi * gi;
      const double want = start.master[i] * (1 - lr * wd) - lr * (mi / bc1) / (std::sqrt(vi / bc2) + eps);
      err += (clipped.master[k][i] - want) * (clipped.master[k][i] - want);
      ref += want * want;
    }
  }
  EXPECT_LT(std::sqrt(err / ref), 1e-6) << "the clipped step's masters against AdamW in f64";
}

// Segments of one flat buffer, as the engine hands a shard's parameter groups over: most start at
// offsets that rule out four-element vector accesses, so the multi-tensor step mixes its vector
// and element-by-element paths (and a tensor's tail after its last whole four).
TEST(EmulatedMultiTensorAdamW, SegmentsOfAFlatBufferAtAnyOffsetMatchOneTensorLaunches) {
  const std::vector<std::int64_t> lengths{5, 131075, 7, 65536, 2, 70001, 4};
  std::int64_t total = 0;
  for (auto n : lengths) total += n;
  struct Flat {
    std::vector<float> master, m, v;
    Stored grad, params;
    detail::StepState state;
  };
  auto run = [&](bool multi) {
    const auto n = static_cast<std::size_t>(total);
    const auto w = random_values(n, 11), m0 = random_values(n, 12, 0.1);
    auto v0 = random_values(n, 13, 0.01);
    for (auto& x : v0) x = std::abs(x);
    Flat f{{w.begin(), w.end()}, {m0.begin(), m0.end()}, {v0.begin(), v0.end()},
           Stored(kBF16, random_values(n, 14, 0.5)), Stored(kBF16, std::vector<double>(n)), {}};
    std::vector<detail::OptimizerTensor> list;
    std::int64_t at = 0;
    for (auto len : lengths) {
      list.push_back({f.master.data() + at, static_cast<std::uint16_t*>(f.grad.data()) + at, f.m.data() + at,
                      f.v.data() + at, static_cast<std::uint16_t*>(f.params.data()) + at, len, kBF16, kBF16});
      at += len;
    }
    const detail::AdamArgs args{.lr = 1e-2f, .weight_decay = 0.1f};
    f.state.step = 2;
    EXPECT_EQ(cu::step_begin(nullptr, &f.state), 0);
    if (multi) {
      EXPECT_EQ(cu::adamw_multi(nullptr, list.data(), static_cast<int>(list.size()), args, &f.state), 0);
    } else {
      for (const auto& t : list)
        EXPECT_EQ(cu::adamw(nullptr, t.master, t.gdt, t.grad, t.state1, t.state2, t.pdt, t.param_out, t.n, args,
                            &f.state),
                  0);
    }
    return f;
  };
  const Flat multi = run(true), single = run(false);
  EXPECT_EQ(multi.master, single.master);
  EXPECT_EQ(multi.m, single.m);
  EXPECT_EQ(multi.v, single.v);
  EXPECT_EQ(multi.params.values(), single.params.values());
  // Every element stepped (an element a path skipped would keep its start, and its copy zero).
  const auto start = random_values(static_cast<std::size_t>(total), 11);
  const auto params = multi.params.values();
  for (std::size_t i = 0; i < start.size(); ++i) {
    ASSERT_NE(multi.master[i], static_cast<float>(start[i])) << "element " << i;
    ASSERT_NE(params[i], 0.0) << "element " << i;
  }
}

}  // namespace
