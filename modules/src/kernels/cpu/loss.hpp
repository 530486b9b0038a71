// The CPU kernels of the losses (private): cross-entropy over logits (log-sum-exp in double,
// forward) and mean squared error, with their backward. The cross-entropy's rows split across
// the rank's math threads (parallel_rows: each row's bits as one loop's; the mean adds the rows'
// terms in row order).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

#include "kernels/cpu/parallel.hpp"
#include "kernels/half_convert.hpp"

namespace coshard::modules::detail {

using async::DataType;

template <class T>
double cross_entropy_row(const T* row, std::int32_t target, std::int64_t V) {
  double mx = row[0];
  for (std::int64_t j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(row[j]));
  double sum = 0;
  for (std::int64_t j = 0; j < V; ++j) sum += std::exp(row[j] - mx);
  return std::log(sum) + mx - row[target];
}

template <class T>
void cross_entropy_fwd(const T* logits, const std::int32_t* targets, T* loss, std::int64_t N, std::int64_t V) {
  double total = 0;
  std::vector<double> terms;
  try {
    terms.resize(static_cast<std::size_t>(N));
  } catch (const std::bad_alloc&) {
    terms.clear();  // no room for the rows' terms: one loop
  }
  if (N > 0 && !terms.empty()) {
    parallel_rows(N, 2 * V, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) terms[static_cast<std::size_t>(i)] = cross_entropy_row(logits + i * V, targets[i], V);
    });
    for (const double t : terms) total += t;
  } else {
    for (std::int64_t i = 0; i < N; ++i) total += cross_entropy_row(logits + i * V, targets[i], V);
  }
  loss[0] = static_cast<T>(total / static_cast<double>(N));
}

template <class T>
void mse_fwd(const T* pred, const T* target, T* loss, std::int64_t n) {
  double total = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(pred[i]) - static_cast<double>(target[i]);
    total += d * d;
  }
  loss[0] = static_cast<T>(total / static_cast<double>(n));
}

template <class T>
void mse_bwd(const T* pred, const T* target, const T* seed, T* dpred, std::int64_t n) {
  const T g = 2 * seed[0] / static_cast<T>(n);
  for (std::int64_t i = 0; i < n; ++i) dpred[i] = (pred[i] - target[i]) * g;
}

template <class T>
void cross_entropy_bwd_row(const T* row, std::int32_t target, T g, T* drow, std::int64_t V) {
  T mx = row[0];
  for (std::int64_t j = 1; j < V; ++j) mx = std::max(mx, row[j]);
  T sum = 0;
  for (std::int64_t j = 0; j < V; ++j) {
    drow[j] = std::exp(row[j] - mx);
    sum += drow[j];
  }
  const T scale = g / sum;
  for (std::int64_t j = 0; j < V; ++j) drow[j] *= scale;
  drow[target] -= g;
}

template <class T>
void cross_entropy_bwd(const T* logits, const std::int32_t* targets, const T* seed, T* dlogits, std::int64_t N,
                       std::int64_t V) {
  const T g = seed[0] / static_cast<T>(N);
  parallel_rows(N, 3 * V, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) cross_entropy_bwd_row(logits + i * V, targets[i], g, dlogits + i * V, V);
  });
}

// bf16/f16 logits a row at a time: each row widened into a buffer of its chunk's (the values a
// copy of the whole logits holds), then fn(i, row, scratch) as the f32 kernels compute it (scratch:
// V floats more where `with_scratch`, for an output row). Throws std::bad_alloc on the calling
// thread where a buffer cannot be had, as a copy would.
template <class Fn>
void for_widened_rows(DataType dt, const std::uint16_t* logits, std::int64_t N, std::int64_t V,
                      std::int64_t work_per_row, bool with_scratch, Fn&& fn) {
  rows_with_buffer(N, with_scratch ? 2 * V : V, work_per_row, [&](std::int64_t i, float* row) {
    widen_half(dt, logits + i * V, row, static_cast<std::size_t>(V));
    fn(i, row, row + V);
  });
}

// A bf16/f16 row widened to f32: its term of the loss (e: V floats of scratch), and its gradient
// g (softmax - onehot) (loss_half.cpp: the exponentials vectorised, for the CPU's widest vectors).
double cross_entropy_half_row(const float* row, std::int32_t target, float* e, std::int64_t V) noexcept;
void cross_entropy_half_row_grad(const float* row, std::int32_t target, float g, float* drow, std::int64_t V) noexcept;

// The cross-entropy of bf16/f16 logits without copying the whole logits or their gradient (a
// vocabulary's rows are hundreds of megabytes, past what the copies' buffers keep): each row
// widened into a buffer, the gradient rounded once a row into the output.
inline void cross_entropy_fwd_half(DataType dt, const std::uint16_t* logits, const std::int32_t* targets, float* loss,
                                   std::int64_t N, std::int64_t V) {
  std::vector<double> terms(static_cast<std::size_t>(N));
  for_widened_rows(dt, logits, N, V, V, true, [&](std::int64_t i, const float* row, float* e) {
    terms[static_cast<std::size_t>(i)] = cross_entropy_half_row(row, targets[i], e, V);
  });
  double total = 0;
  for (const double t : terms) total += t;
  loss[0] = static_cast<float>(total / static_cast<double>(N));
}

inline void cross_entropy_bwd_half(DataType dt, const std::uint16_t* logits, const std::int32_t* targets,
                                   const float* seed, std::uint16_t* dlogits, std::int64_t N, std::int64_t V) {
  const float g = seed[0] / static_cast<float>(N);
  for_widened_rows(dt, logits, N, V, 2 * V, true, [&](std::int64_t i, const float* row, float* drow) {
    cross_entropy_half_row_grad(row, targets[i], g, drow, V);
    narrow_half(dt, drow, dlogits + i * V, static_cast<std::size_t>(V));
  });
}

// The vocabulary-parallel cross-entropy's steps (Kernels::row_max and after): `T` the logits'
// type, max and sums in the stat type (the Operands give T's stat view: f32 for f32/bf16/f16).
template <class T>
void vocab_row_max(const T* logits, T* max, std::int64_t N, std::int64_t V) {
  parallel_rows(N, V, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T* row = logits + i * V;
      T mx = row[0];
      for (std::int64_t j = 1; j < V; ++j) mx = std::max(mx, row[j]);
      max[i] = mx;
    }
  });
}

template <class T>
void vocab_ce_sums_rows(const T* logits, const std::int32_t* targets, const T* max, T* sums, std::int64_t N,
                        std::int64_t V, std::int64_t first) {
  parallel_rows(N, 2 * V, [&](std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    const T* row = logits + i * V;
    double sum = 0;
    for (std::int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j]) - static_cast<double>(max[i]));
    sums[i] = static_cast<T>(sum);
    const std::int64_t t = targets[i] - first;
    sums[N + i] = (t >= 0 && t < V) ? row[t] : T(0);
  }
  });
}

// One chunk of columns [first, first + V) into each row's running max, sum of exp(x - max) (in
// double within the chunk, as vocab_ce_sums_rows) and target logit; first = 0 starts them.
template <class T>
void chunk_ce_sums_rows(const T* logits, const std::int32_t* targets, T* max, T* sums, std::int64_t N, std::int64_t V,
                        std::int64_t first) {
  parallel_rows(N, 3 * V, [&](std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    const T* row = logits + i * V;
    T mx = row[0];
    for (std::int64_t j = 1; j < V; ++j) mx = std::max(mx, row[j]);
    const bool started = first > 0;
    const T before = started ? max[i] : mx;
    const T now = std::max(before, mx);
    double sum = started ? static_cast<double>(sums[i]) * std::exp(static_cast<double>(before) - static_cast<double>(now)) : 0.0;
    for (std::int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j]) - static_cast<double>(now));
    max[i] = now;
    sums[i] = static_cast<T>(sum);
    const std::int64_t t = targets[i] - first;
    if (t >= 0 && t < V) sums[N + i] = row[t];
    else if (!started) sums[N + i] = T(0);
  }
  });
}

template <class T>
void vocab_ce_mean(const T* max, const T* sums, T* loss, std::int64_t N) {
  double total = 0;
  for (std::int64_t i = 0; i < N; ++i)
    total += std::log(static_cast<double>(sums[i])) + static_cast<double>(max[i]) - static_cast<double>(sums[N + i]);
  loss[0] = static_cast<T>(total / static_cast<double>(N));
}

template <class T>
void vocab_ce_bwd(const T* logits, const std::int32_t* targets, const T* max, const T* sums, const T* seed, T* dlogits,
                  std::int64_t N, std::int64_t V, std::int64_t first) {
  const T g = seed[0] / static_cast<T>(N);
  parallel_rows(N, 2 * V, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T* row = logits + i * V;
      T* drow = dlogits + i * V;
      const T scale = g / sums[i];
      for (std::int64_t j = 0; j < V; ++j) drow[j] = std::exp(row[j] - max[i]) * scale;
      const std::int64_t t = targets[i] - first;
      if (t >= 0 && t < V) drow[t] -= g;
    }
  });
}

}  // namespace coshard::modules::detail
