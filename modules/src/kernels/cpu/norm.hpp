// The CPU kernels of the normalisations (private): LayerNorm (GPT) and RMSNorm (Llama), one row
// at a time, accumulating in double, in the element type T of the Operands (f32 or f64; bf16
// and f16 are computed in f32 on copies). Rows split across the rank's math threads, and the
// weight gradients' columns, each column adding the rows in order: the bits of one loop.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cpu/parallel.hpp"

namespace coshard::modules::detail {

template <class T>
void layernorm_fwd(const T* x, const T* w, const T* b, T* out, T* mean, T* rstd, std::int64_t N, std::int64_t C,
                   float eps) {
  parallel_rows(N, 3 * C, [&](std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    const T* xi = x + i * C;
    double m = 0;
    for (std::int64_t j = 0; j < C; ++j) m += xi[j];
    m /= static_cast<double>(C);
    double var = 0;
    for (std::int64_t j = 0; j < C; ++j) {
      const double d = xi[j] - m;
      var += d * d;
    }
    var /= static_cast<double>(C);
    const double r = 1.0 / std::sqrt(var + eps);
    T* oi = out + i * C;
    for (std::int64_t j = 0; j < C; ++j) oi[j] = static_cast<T>((xi[j] - m) * r) * w[j] + b[j];
    mean[i] = static_cast<T>(m);
    rstd[i] = static_cast<T>(r);
  }
  });
}

template <class T>
void layernorm_bwd(const T* dout, const T* x, const T* w, const T* mean, const T* rstd, T* dx, T* dw, T* db,
                   std::int64_t N, std::int64_t C) {
  parallel_rows(N, 4 * C, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * C;
      const T* gi = dout + i * C;
      const double m = mean[i];
      const double r = rstd[i];
      double mean_dxhat = 0, mean_dxhat_xhat = 0;
      for (std::int64_t j = 0; j < C; ++j) {
        const double xhat = (xi[j] - m) * r;
        const double dxhat = static_cast<double>(gi[j]) * w[j];
        mean_dxhat += dxhat;
        mean_dxhat_xhat += dxhat * xhat;
      }
      mean_dxhat /= static_cast<double>(C);
      mean_dxhat_xhat /= static_cast<double>(C);
      T* dxi = dx + i * C;
      for (std::int64_t j = 0; j < C; ++j) {
        const double xhat = (xi[j] - m) * r;
        const double dxhat = static_cast<double>(gi[j]) * w[j];
        dxi[j] = static_cast<T>(r * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
      }
    }
  });
  parallel_rows(C, 2 * N, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = 0; i < N; ++i) {
      const T* xi = x + i * C;
      const T* gi = dout + i * C;
      const double m = mean[i];
      const double r = rstd[i];
      for (std::int64_t j = begin; j < end; ++j) {
        const double xhat = (xi[j] - m) * r;
        db[j] += gi[j];
        dw[j] += static_cast<T>(gi[j] * xhat);
      }
    }
  });
}

// RMSNorm: out = x * r * w with r = 1 / sqrt(mean(x^2) + eps); `rstd` keeps r per row.
template <class T>
void rmsnorm_fwd(const T* x, const T* w, T* out, T* rstd, std::int64_t N, std::int64_t C, float eps) {
  parallel_rows(N, 2 * C, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * C;
      double ms = 0;
      for (std::int64_t j = 0; j < C; ++j) ms += static_cast<double>(xi[j]) * xi[j];
      const double r = 1.0 / std::sqrt(ms / static_cast<double>(C) + eps);
      T* oi = out + i * C;
      for (std::int64_t j = 0; j < C; ++j) oi[j] = static_cast<T>(xi[j] * r) * w[j];
      rstd[i] = static_cast<T>(r);
    }
  });
}

// dx = r (dxhat - xhat mean(dxhat xhat)), dxhat = dout w, xhat = x r; dw += dout xhat.
template <class T>
void rmsnorm_bwd(const T* dout, const T* x, const T* w, const T* rstd, T* dx, T* dw, std::int64_t N, std::int64_t C) {
  parallel_rows(N, 3 * C, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * C;
      const T* gi = dout + i * C;
      const double r = rstd[i];
      double mean_dxhat_xhat = 0;
      for (std::int64_t j = 0; j < C; ++j) {
        const double xhat = xi[j] * r;
        mean_dxhat_xhat += static_cast<double>(gi[j]) * w[j] * xhat;
      }
      mean_dxhat_xhat /= static_cast<double>(C);
      T* dxi = dx + i * C;
      for (std::int64_t j = 0; j < C; ++j) {
        const double xhat = xi[j] * r;
        dxi[j] = static_cast<T>(r * (static_cast<double>(gi[j]) * w[j] - xhat * mean_dxhat_xhat));
      }
    }
  });
  parallel_rows(C, N, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = 0; i < N; ++i) {
      const T* xi = x + i * C;
      const T* gi = dout + i * C;
      const double r = rstd[i];
      for (std::int64_t j = begin; j < end; ++j) dw[j] += static_cast<T>(gi[j] * (xi[j] * r));
    }
  });
}

}  // namespace coshard::modules::detail
