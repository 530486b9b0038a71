// The CPU kernels of the normalisations (private): LayerNorm (GPT) and RMSNorm (Llama), one row
// at a time, accumulating in double, on tensors of storage type S (elements.hpp: f32, f64, or
// bf16/f16 read into f32 and rounded once a value), statistics in compute_t<S>. Rows split across
// the rank's math threads, and the weight gradients' columns, each column adding the rows in
// order into an accumulator of compute_t<S> (read from and rounded into the gradient once): the
// bits of one loop.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/elements.hpp"
#include "kernels/cpu/parallel.hpp"

namespace coshard::modules::detail {

// Columns [begin, end) of weight gradients summed over rows 0..N-1 in row order: add(i, j, acc)
// adds row i's terms of column j to acc[0..k), one accumulator of compute_t<S> a gradient
// (`grads` of them), in blocks of columns that stay in L1.
template <class S, std::size_t k, class Add>
void column_sums(S* const (&grads)[k], std::int64_t N, std::int64_t begin, std::int64_t end, Add&& add) {
  constexpr std::int64_t kBlock = 256;
  using T = compute_t<S>;
  T acc[k][kBlock];
  for (std::int64_t first = begin; first < end; first += kBlock) {
    const std::int64_t last = std::min(end, first + kBlock);
    for (std::size_t g = 0; g < k; ++g)
      for (std::int64_t j = first; j < last; ++j) acc[g][j - first] = widen(grads[g][j]);
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t j = first; j < last; ++j) add(i, j, acc, j - first);
    for (std::size_t g = 0; g < k; ++g)
      for (std::int64_t j = first; j < last; ++j) grads[g][j] = narrow<S>(acc[g][j - first]);
  }
}

template <class S>
void layernorm_fwd(const S* x, const S* w, const S* b, S* out, compute_t<S>* mean, compute_t<S>* rstd, std::int64_t N,
                   std::int64_t C, float eps) {
  using T = compute_t<S>;
  parallel_rows(N, 3 * C, [&](std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    const S* xi = x + i * C;
    double m = 0;
    for (std::int64_t j = 0; j < C; ++j) m += widen(xi[j]);
    m /= static_cast<double>(C);
    double var = 0;
    for (std::int64_t j = 0; j < C; ++j) {
      const double d = widen(xi[j]) - m;
      var += d * d;
    }
    var /= static_cast<double>(C);
    const double r = 1.0 / std::sqrt(var + eps);
    S* oi = out + i * C;
    for (std::int64_t j = 0; j < C; ++j)
      oi[j] = narrow<S>(static_cast<T>((widen(xi[j]) - m) * r) * widen(w[j]) + widen(b[j]));
    mean[i] = static_cast<T>(m);
    rstd[i] = static_cast<T>(r);
  }
  });
}

template <class S>
void layernorm_bwd(const S* dout, const S* x, const S* w, const compute_t<S>* mean, const compute_t<S>* rstd, S* dx,
                   S* dw, S* db, std::int64_t N, std::int64_t C) {
  using T = compute_t<S>;
  parallel_rows(N, 4 * C, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const S* xi = x + i * C;
      const S* gi = dout + i * C;
      const double m = mean[i];
      const double r = rstd[i];
      double mean_dxhat = 0, mean_dxhat_xhat = 0;
      for (std::int64_t j = 0; j < C; ++j) {
        const double xhat = (widen(xi[j]) - m) * r;
        const double dxhat = static_cast<double>(widen(gi[j])) * widen(w[j]);
        mean_dxhat += dxhat;
        mean_dxhat_xhat += dxhat * xhat;
      }
      mean_dxhat /= static_cast<double>(C);
      mean_dxhat_xhat /= static_cast<double>(C);
      S* dxi = dx + i * C;
      for (std::int64_t j = 0; j < C; ++j) {
        const double xhat = (widen(xi[j]) - m) * r;
        const double dxhat = static_cast<double>(widen(gi[j])) * widen(w[j]);
        dxi[j] = narrow<S>(static_cast<T>(r * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)));
      }
    }
  });
  parallel_rows(C, 2 * N, [&](std::int64_t begin, std::int64_t end) {
    S* const grads[2] = {dw, db};
    column_sums(grads, N, begin, end, [&](std::int64_t i, std::int64_t j, auto& acc, std::int64_t at) {
      const T g = widen(dout[i * C + j]);
      const double xhat = (widen(x[i * C + j]) - static_cast<double>(mean[i])) * static_cast<double>(rstd[i]);
      acc[1][at] += g;
      acc[0][at] += static_cast<T>(g * xhat);
    });
  });
}

// RMSNorm: out = x * r * w with r = 1 / sqrt(mean(x^2) + eps); `rstd` keeps r per row.
template <class S>
void rmsnorm_fwd(const S* x, const S* w, S* out, compute_t<S>* rstd, std::int64_t N, std::int64_t C, float eps) {
  using T = compute_t<S>;
  parallel_rows(N, 2 * C, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const S* xi = x + i * C;
      double ms = 0;
      for (std::int64_t j = 0; j < C; ++j) ms += static_cast<double>(widen(xi[j])) * widen(xi[j]);
      const double r = 1.0 / std::sqrt(ms / static_cast<double>(C) + eps);
      S* oi = out + i * C;
      for (std::int64_t j = 0; j < C; ++j) oi[j] = narrow<S>(static_cast<T>(widen(xi[j]) * r) * widen(w[j]));
      rstd[i] = static_cast<T>(r);
    }
  });
}

// dx = r (dxhat - xhat mean(dxhat xhat)), dxhat = dout w, xhat = x r; dw += dout xhat.
template <class S>
void rmsnorm_bwd(const S* dout, const S* x, const S* w, const compute_t<S>* rstd, S* dx, S* dw, std::int64_t N,
                 std::int64_t C) {
  using T = compute_t<S>;
  parallel_rows(N, 3 * C, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const S* xi = x + i * C;
      const S* gi = dout + i * C;
      const double r = rstd[i];
      double mean_dxhat_xhat = 0;
      for (std::int64_t j = 0; j < C; ++j) {
        const double xhat = widen(xi[j]) * r;
        mean_dxhat_xhat += static_cast<double>(widen(gi[j])) * widen(w[j]) * xhat;
      }
      mean_dxhat_xhat /= static_cast<double>(C);
      S* dxi = dx + i * C;
      for (std::int64_t j = 0; j < C; ++j) {
        const double xhat = widen(xi[j]) * r;
        dxi[j] = narrow<S>(static_cast<T>(r * (static_cast<double>(widen(gi[j])) * widen(w[j]) - xhat * mean_dxhat_xhat)));
      }
    }
  });
  parallel_rows(C, N, [&](std::int64_t begin, std::int64_t end) {
    S* const grads[1] = {dw};
    column_sums(grads, N, begin, end, [&](std::int64_t i, std::int64_t j, auto& acc, std::int64_t at) {
      const double r = rstd[i];
      acc[0][at] += static_cast<T>(widen(dout[i * C + j]) * (widen(x[i * C + j]) * r));
    });
  });
}

}  // namespace coshard::modules::detail
