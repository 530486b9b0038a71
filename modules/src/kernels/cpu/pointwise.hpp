// The CPU kernels of the element-wise layers (private): GELU (GPT), SwiGLU and rotary position
// embeddings (Llama), on tensors of storage type S (elements.hpp: f32, f64, or bf16/f16 read
// into f32 and rounded once a value), computed in compute_t<S>. Rows (elements, for GELU) split
// across the rank's math threads: parallel_rows, each element's bits as one loop's.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels/cpu/elements.hpp"
#include "kernels/cpu/exp_approx.hpp"
#include "kernels/cpu/parallel.hpp"

namespace coshard::modules::detail {

// GPT-2's tanh approximation of GELU.
constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluCube = 0.044715;

// tanh through exp: 1 - 2 / (1 + e^(2u)). Absolute error ~2e-7, which is what GELU's
// 1 + tanh and 1 - tanh^2 need (its relative error near 0 is larger; nothing here uses that).
template <class T>
inline T tanh_of(T u) {
  if constexpr (std::is_same_v<T, float>)
    return 1.0f - 2.0f / (1.0f + exp_approx(2.0f * u));
  else
    return std::tanh(u);
}

template <class S>
void gelu_fwd(const S* x, S* out, std::int64_t n) {
  using T = compute_t<S>;
  parallel_rows(n, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T v = widen(x[i]);
      const T u = static_cast<T>(kGeluScale) * (v + static_cast<T>(kGeluCube) * v * v * v);
      out[i] = narrow<S>(T(0.5) * v * (T(1) + tanh_of(u)));
    }
  });
}

template <class S>
void gelu_bwd(const S* x, const S* dout, S* dx, std::int64_t n) {
  using T = compute_t<S>;
  parallel_rows(n, 2, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T v = widen(x[i]);
      const T u = static_cast<T>(kGeluScale) * (v + static_cast<T>(kGeluCube) * v * v * v);
      const T th = tanh_of(u);
      const T du = static_cast<T>(kGeluScale) * (T(1) + T(3) * static_cast<T>(kGeluCube) * v * v);
      dx[i] = narrow<S>(widen(dout[i]) * (T(0.5) * (T(1) + th) + T(0.5) * v * (T(1) - th * th) * du));
    }
  });
}

template <class T>
inline T sigmoid_of(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

// SwiGLU's sigmoid for storage S: libm's exp for f32 and f64 (their bits match PyTorch's to the
// last few units), exp_approx for bf16/f16, whose loops then vectorise (its ~2e-7 is far under
// their rounding).
template <class S>
inline compute_t<S> sigmoid_for(compute_t<S> v) {
  if constexpr (std::is_same_v<S, compute_t<S>>)
    return sigmoid_of(v);
  else
    return 1.0f / (1.0f + exp_approx(-v));
}

template <class S>
void swiglu_fwd(const S* gate_up, S* out, std::int64_t N, std::int64_t I) {
  parallel_rows(N, 2 * I, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const S* g = gate_up + i * 2 * I;
      const S* u = g + I;
      S* o = out + i * I;
      for (std::int64_t j = 0; j < I; ++j) {
        const auto gj = widen(g[j]);
        o[j] = narrow<S>(gj * sigmoid_for<S>(gj) * widen(u[j]));
      }
    }
  });
}

// d gate = dout * up * silu'(gate), silu'(g) = s (1 + g (1 - s)); d up = dout * silu(gate).
template <class S>
void swiglu_bwd(const S* gate_up, const S* dout, S* dgate_up, std::int64_t N, std::int64_t I) {
  using T = compute_t<S>;
  parallel_rows(N, 3 * I, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const S* g = gate_up + i * 2 * I;
      const S* u = g + I;
      const S* d = dout + i * I;
      S* dg = dgate_up + i * 2 * I;
      S* du = dg + I;
      for (std::int64_t j = 0; j < I; ++j) {
        const T gj = widen(g[j]), uj = widen(u[j]), dj = widen(d[j]);
        const T sg = sigmoid_for<S>(gj);
        dg[j] = narrow<S>(dj * uj * sg * (T(1) + gj * (T(1) - sg)));
        du[j] = narrow<S>(dj * gj * sg);
      }
    }
  });
}

// Angles in f32 as transformers computes them (position * inv_freq), in double for f64 models;
// a position's cosines and sines once for all its rows and heads (the same values each computed).
template <class S>
void rope_apply(const S* x, S* out, const float* inv_freq, std::int64_t B, std::int64_t T_, std::int64_t heads,
                std::int64_t rotated, std::int64_t hd, bool inverse, std::int64_t first) {
  using T = compute_t<S>;
  using Angle = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const std::int64_t half = hd / 2;
  auto angle = [&](std::int64_t t, std::int64_t i, T& c, T& sn) {
    const Angle a = static_cast<Angle>(first + t) * static_cast<Angle>(inv_freq[i]);
    c = static_cast<T>(std::cos(a));
    sn = static_cast<T>(inverse ? -std::sin(a) : std::sin(a));
  };
  // Each position's cosines and sines once for every row and head at it (the batch's rows share
  // them), unless there is no room: then a row's once for its heads, or each head its own.
  std::vector<T> table;
  try {
    if (rotated > 0) table.resize(static_cast<std::size_t>(T_ * 2 * half));
  } catch (const std::bad_alloc&) {
    table.clear();
  }
  if (!table.empty())
    parallel_rows(T_, 8 * half, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t t = begin; t < end; ++t)
        for (std::int64_t i = 0; i < half; ++i) angle(t, i, table[static_cast<std::size_t>((t * half + i) * 2)],
                                                      table[static_cast<std::size_t>((t * half + i) * 2 + 1)]);
    });
  parallel_rows(B * T_, heads * hd * 4, [&](std::int64_t begin, std::int64_t end) {
    std::vector<T> row_cos_sin;
    if (table.empty() && rotated > 0) {
      try {
        row_cos_sin.resize(static_cast<std::size_t>(2 * half));
      } catch (const std::bad_alloc&) {
        row_cos_sin.clear();  // no room: each head computes its own
      }
    }
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t t = row % T_;
      const std::int64_t base = row * heads * hd;
      const T* cos_sin = nullptr;
      if (!table.empty()) {
        cos_sin = table.data() + t * 2 * half;
      } else if (!row_cos_sin.empty()) {
        for (std::int64_t i = 0; i < half; ++i) angle(t, i, row_cos_sin[2 * i], row_cos_sin[2 * i + 1]);
        cos_sin = row_cos_sin.data();
      }
      for (std::int64_t h = 0; h < heads; ++h) {
        const S* xi = x + base + h * hd;
        S* oi = out + base + h * hd;
        if (h >= rotated) {
          for (std::int64_t i = 0; i < hd; ++i) oi[i] = xi[i];
          continue;
        }
        for (std::int64_t i = 0; i < half; ++i) {
          T c, sn;
          if (cos_sin != nullptr) {
            c = cos_sin[2 * i];
            sn = cos_sin[2 * i + 1];
          } else {
            angle(t, i, c, sn);
          }
          const T x1 = widen(xi[i]), x2 = widen(xi[i + half]);
          oi[i] = narrow<S>(x1 * c - x2 * sn);
          oi[i + half] = narrow<S>(x2 * c + x1 * sn);
        }
      }
    }
  });
}

}  // namespace coshard::modules::detail
