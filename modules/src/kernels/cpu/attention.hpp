// The CPU kernels of causal self-attention (private), grouped-query included: the scores and
// their softmax materialised per head (B x H x T x T), the products through blas.hpp (OpenBLAS
// threads each), the softmax's rows split across the rank's math threads between them (each row
// as one loop computes it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/blas.hpp"
#include "kernels/cpu/parallel.hpp"

namespace coshard::modules::detail {

// Row i of a head's scores, in place: its causal softmax over columns 0..i, zeros after them.
// `exp` is libm's (the f32 and f64 kernels: PyTorch's bits to the last units) or exp_approx (the
// half types', whose probabilities are rounded to 2^-9 anyway: then the loop vectorises).
struct LibmExp {
  template <class T>
  T operator()(T x) const {
    return std::exp(x);
  }
};
template <class T, class Exp = LibmExp>
void causal_softmax_row(T* row, std::int64_t i, std::int64_t T_, Exp exp = {}) {
  T mx = row[0];
  for (std::int64_t j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
  for (std::int64_t j = 0; j <= i; ++j) row[j] = exp(row[j] - mx);
  T sum = 0;
  for (std::int64_t j = 0; j <= i; ++j) sum += row[j];
  const T inv = T(1) / sum;
  for (std::int64_t j = 0; j <= i; ++j) row[j] *= inv;
  for (std::int64_t j = i + 1; j < T_; ++j) row[j] = 0;
}

// Row i of dP, in place: dS = P * (dP - rowsum(P * dP)) over columns 0..i, zeros after them (P
// is zero there).
template <class T>
void causal_softmax_backward_row(const T* p, T* dp, std::int64_t i, std::int64_t T_) {
  T dot = 0;
  for (std::int64_t j = 0; j <= i; ++j) dot += p[j] * dp[j];
  for (std::int64_t j = 0; j <= i; ++j) dp[j] = p[j] * (dp[j] - dot);
  for (std::int64_t j = i + 1; j < T_; ++j) dp[j] = 0;
}

// Grouped-query attention (KVH = H: multi-head). Row stride W = (H + 2 KVH) hd; query head h
// uses key/value head h / (H / KVH).
template <class T>
void attention_fwd(const T* qkv, T* out, T* probs, std::int64_t B, std::int64_t T_, std::int64_t H, std::int64_t KVH,
                   std::int64_t hd) {
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, group = H / KVH;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  // S = scale * Q K^T of every head (full square; the masked half is overwritten below).
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const T* row0 = qkv + b * T_ * W;
      GemmArgs g{.trans_a = false, .trans_b = true, .m = T_, .n = T_, .k = hd, .lda = W, .ldb = W,
                 .ldc = T_, .alpha = static_cast<float>(scale), .beta = 0.0f};
      gemm_one<T>(g, row0 + h * hd, row0 + C + (h / group) * hd, probs + (b * H + h) * T_ * T_);
    }
  }
  // Each row's causal softmax: row i of a head keeps columns 0..i.
  parallel_rows(B * H * T_, 2 * T_, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) causal_softmax_row(probs + r * T_, r % T_, T_);
  });
  // O = P V, written into the head's columns of out.
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const T* v = qkv + b * T_ * W + C + KVH * hd + (h / group) * hd;
      GemmArgs o{.m = T_, .n = hd, .k = T_, .lda = T_, .ldb = W, .ldc = C};
      gemm_one<T>(o, probs + (b * H + h) * T_ * T_, v, out + b * T_ * C + h * hd);
    }
  }
}

// Decoding (Kernels::attention_decode): new rows [first, first + Tn) of the cache attend over the
// rows up to themselves; the scores of one query in scratch (f32, first + Tn of them).
template <class T>
void attention_decode_rows(const T* cache, T* out, float* scratch, std::int64_t B, std::int64_t Tmax, std::int64_t first,
                           std::int64_t Tn, std::int64_t H, std::int64_t KVH, std::int64_t hd) {
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, group = H / KVH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (std::int64_t b = 0; b < B; ++b) {
    const T* rows = cache + b * Tmax * W;
    for (std::int64_t i = 0; i < Tn; ++i) {
      const std::int64_t at = first + i;  // this query's position: keys 0..at
      for (std::int64_t h = 0; h < H; ++h) {
        const T* q = rows + at * W + h * hd;
        const std::int64_t kv = C + (h / group) * hd;
        float mx = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j <= at; ++j) {
          const T* k = rows + j * W + kv;
          double dot = 0;
          for (std::int64_t d = 0; d < hd; ++d) dot += static_cast<double>(q[d]) * static_cast<double>(k[d]);
          scratch[j] = static_cast<float>(dot * scale);
          mx = std::max(mx, scratch[j]);
        }
        double sum = 0;
        for (std::int64_t j = 0; j <= at; ++j) {
          scratch[j] = std::exp(scratch[j] - mx);
          sum += scratch[j];
        }
        T* o = out + (b * Tn + i) * C + h * hd;
        for (std::int64_t d = 0; d < hd; ++d) {
          double acc = 0;
          for (std::int64_t j = 0; j <= at; ++j) acc += static_cast<double>(scratch[j]) * static_cast<double>(rows[j * W + kv + KVH * hd + d]);
          o[d] = static_cast<T>(acc / sum);
        }
      }
    }
  }
}

// dK and dV of a key/value head sum over the query heads of its group, in head order: the first
// writes (beta 0), the others add. The products in (batch, head) order, the softmax's backward
// rows between them split across the math threads.
template <class T>
void attention_bwd(const T* dout, const T* qkv, const T* probs, T* dqkv, T* scratch, std::int64_t B,
                   std::int64_t T_, std::int64_t H, std::int64_t KVH, std::int64_t hd) {
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, group = H / KVH;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t row0 = b * T_ * W;
      const std::int64_t kv = C + (h / group) * hd;
      const float first = h % group == 0 ? 0.0f : 1.0f;  // beta of the group's sums
      const T* v = qkv + row0 + kv + KVH * hd;
      T* dv = dqkv + row0 + kv + KVH * hd;
      const T* p = probs + (b * H + h) * T_ * T_;
      const T* dO = dout + b * T_ * C + h * hd;
      T* dp = scratch + (b * H + h) * T_ * T_;
      // dP = dO V^T; dV (+)= P^T dO.
      GemmArgs g1{.trans_b = true, .m = T_, .n = T_, .k = hd, .lda = C, .ldb = W, .ldc = T_};
      gemm_one<T>(g1, dO, v, dp);
      GemmArgs g2{.trans_a = true, .m = T_, .n = hd, .k = T_, .lda = T_, .ldb = C, .ldc = W, .beta = first};
      gemm_one<T>(g2, p, dO, dv);
    }
  }
  // dS = P * (dP - rowsum(P * dP)), zero above the diagonal (P is zero there).
  parallel_rows(B * H * T_, 2 * T_, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) causal_softmax_backward_row(probs + r * T_, scratch + r * T_, r % T_, T_);
  });
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t row0 = b * T_ * W;
      const std::int64_t kv = C + (h / group) * hd;
      const float first = h % group == 0 ? 0.0f : 1.0f;
      const T* dp = scratch + (b * H + h) * T_ * T_;
      // dQ = scale dS K; dK (+)= scale dS^T Q.
      GemmArgs g3{.m = T_, .n = hd, .k = T_, .lda = T_, .ldb = W, .ldc = W, .alpha = scale};
      gemm_one<T>(g3, dp, qkv + row0 + kv, dqkv + row0 + h * hd);
      GemmArgs g4{.trans_a = true, .m = T_, .n = hd, .k = T_, .lda = T_, .ldb = W, .ldc = W, .alpha = scale,
                  .beta = first};
      gemm_one<T>(g4, dp, qkv + row0 + h * hd, dqkv + row0 + kv);
    }
  }
}

}  // namespace coshard::modules::detail
