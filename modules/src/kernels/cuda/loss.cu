// CUDA kernels of the losses: cross-entropy (one pass over each row: an online softmax), its
// vocabulary-parallel steps (each rank's columns of the logits) and the fused output layer's
// chunks of columns, and the mean squared error. f32, bf16 and f16 storage; all arithmetic in
// f32. Every loss is the mean of per-row (or per-element) terms summed by one block in a fixed
// order, so losses and gradients are deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

// ---- cross-entropy: one block per row ----

// The row's max, and the sum of exp(x - max), over the block in one pass over the row (an online
// softmax: each thread rescales its running sum when its maximum grows; the block then rescales
// each thread's sum to the block's maximum). A vocabulary-wide row is read once here, not twice.
template <class T>
__device__ void row_max_and_exp_sum(const T* r, std::int64_t V, float& mx, float& sum) {
  float m = -INFINITY, s = 0;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float x = load(r, j);
    if (x > m) {
      s = s * expf(m - x) + 1.0f;
      m = x;
    } else if (!(x == -INFINITY && m == -INFINITY)) {  // a masked (-inf) logit adds 0; a NaN still spreads
      s += expf(x - m);
    }
  }
  const float block_m = block_max(m);
  mx = block_m;
  sum = block_sum(m == -INFINITY ? 0.0f : s * expf(m - block_m));
}

template <class T>
__global__ void cross_entropy_rows_kernel(const T* logits, const std::int32_t* targets, float* row_losses,
                                          std::int64_t V) {
  const std::int64_t row = blockIdx.x;
  const T* r = logits + row * V;
  float mx, sum;
  row_max_and_exp_sum(r, V, mx, sum);
  if (threadIdx.x == 0) {
    const std::int32_t t = targets[row];
    row_losses[row] = (t >= 0 && t < V) ? logf(sum) + mx - load(r, t) : NAN;
  }
}

// One block, fixed order: each thread sums a strided slice, then a fixed tree.
__global__ void mean_kernel(const float* values, float* out, std::int64_t n) {
  float s = 0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) s += values[i];
  s = block_sum(s);
  if (threadIdx.x == 0) out[0] = s / static_cast<float>(n);
}

template <class T>
__global__ void cross_entropy_backward_kernel(const T* logits, const std::int32_t* targets, const float* seed,
                                              T* dlogits, std::int64_t N, std::int64_t V) {
  const std::int64_t row = blockIdx.x;
  const T* r = logits + row * V;
  float mx, sum;
  row_max_and_exp_sum(r, V, mx, sum);
  const float g = seed[0] / static_cast<float>(N);
  const std::int32_t t = targets[row];
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float p = expf(load(r, j) - mx) / sum;
    store(dlogits + row * V, j, (p - (j == t ? 1.0f : 0.0f)) * g);
  }
}

// ---- vocabulary-parallel cross-entropy: one block per row (the mean: one block) ----

template <class T>
__global__ void row_max_kernel(const T* logits, float* max, std::int64_t V) {
  const std::int64_t row = blockIdx.x;
  const T* r = logits + row * V;
  float m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, load(r, j));
  m = block_max(m);
  if (threadIdx.x == 0) max[row] = m;
}

template <class T>
__global__ void vocab_ce_sums_kernel(const T* logits, const std::int32_t* targets, const float* max, float* sums,
                                     std::int64_t N, std::int64_t V, std::int64_t first, std::int64_t vocab) {
  const std::int64_t row = blockIdx.x;
  const T* r = logits + row * V;
  const float m = max[row];
  float s = 0;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(load(r, j) - m);
  s = block_sum(s);
  if (threadIdx.x == 0) {
    const std::int32_t t = targets[row];
    const std::int64_t at = t - first;
    sums[row] = s;
    sums[N + row] = !(t >= 0 && t < vocab) ? NAN : (at >= 0 && at < V) ? load(r, at) : 0.0f;
  }
}

// One chunk of the fused output layer's columns into each row's running max and sum (kernels.hpp's
// chunk_ce_sums): the chunk's own max and sum in one pass, then thread 0 merges them with the
// running pair (first = 0 starts it; a masked row of -inf adds nothing).
template <class T>
__global__ void chunk_ce_sums_kernel(const T* logits, const std::int32_t* targets, float* max, float* sums,
                                     std::int64_t N, std::int64_t V, std::int64_t first, std::int64_t vocab) {
  const std::int64_t row = blockIdx.x;
  const T* r = logits + row * V;
  float mx, sum;
  row_max_and_exp_sum(r, V, mx, sum);
  if (threadIdx.x != 0) return;
  const bool started = first > 0;
  const float before = started ? max[row] : -INFINITY, now = fmaxf(before, mx);
  float total = 0;
  if (started && before != -INFINITY) total += sums[row] * expf(before - now);
  if (mx != -INFINITY) total += sum * expf(mx - now);
  max[row] = now;
  sums[row] = total;
  const std::int32_t t = targets[row];
  const std::int64_t at = t - first;
  if (!(t >= 0 && t < vocab)) sums[N + row] = NAN;
  else if (at >= 0 && at < V) sums[N + row] = load(r, at);
  else if (!started) sums[N + row] = 0.0f;
}

__global__ void vocab_ce_loss_kernel(const float* max, const float* sums, float* loss, std::int64_t N) {
  float s = 0;
  for (std::int64_t i = threadIdx.x; i < N; i += blockDim.x) s += logf(sums[i]) + max[i] - sums[N + i];
  s = block_sum(s);
  if (threadIdx.x == 0) loss[0] = s / static_cast<float>(N);
}

template <class T>
__global__ void vocab_ce_backward_kernel(const T* logits, const std::int32_t* targets, const float* max,
                                         const float* sums, const float* seed, T* dlogits, std::int64_t N,
                                         std::int64_t V, std::int64_t first) {
  const std::int64_t row = blockIdx.x;
  const T* r = logits + row * V;
  const float m = max[row], scale = seed[0] / static_cast<float>(N), inv = 1.0f / sums[row];
  const std::int64_t t = targets[row] - first;
  for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x)
    store(dlogits + row * V, j, (expf(load(r, j) - m) * inv - (j == t ? 1.0f : 0.0f)) * scale);
}

// ---- mean squared error ----

template <class T>
__global__ void squared_error_kernel(const T* pred, const T* target, float* squares, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) {
    const float d = load(pred, i) - load(target, i);
    squares[i] = d * d;
  }
}

template <class T>
__global__ void mse_backward_kernel(const T* pred, const T* target, const float* seed, T* dpred, std::int64_t n) {
  const float g = 2.0f * seed[0] / static_cast<float>(n);
  COSHARD_GRID_STRIDE(i, n) { store(dpred, i, (load(pred, i) - load(target, i)) * g); }
}

}  // namespace

int cross_entropy_forward(void* s, int dt, const void* logits, const std::int32_t* targets, float* loss,
                          float* row_losses, std::int64_t N, std::int64_t V) {
  return with_type(dt, [&]<class E>() {
    cross_entropy_rows_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(logits), targets, row_losses, V);
    mean_kernel<<<1, 1024, 0, as_stream(s)>>>(row_losses, loss, N);
  });
}

int cross_entropy_backward(void* s, int dt, const void* logits, const std::int32_t* targets, const float* seed,
                           void* dlogits, std::int64_t N, std::int64_t V) {
  return with_type(dt, [&]<class E>() {
    cross_entropy_backward_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(logits), targets, seed, static_cast<E*>(dlogits), N, V);
  });
}

int row_max(void* s, int dt, const void* logits, float* max, std::int64_t N, std::int64_t V) {
  return with_type(dt, [&]<class E>() {
    row_max_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(logits), max, V);
  });
}

int vocab_ce_sums(void* s, int dt, const void* logits, const std::int32_t* targets, const float* max, float* sums,
                  std::int64_t N, std::int64_t V, std::int64_t first, std::int64_t vocab) {
  return with_type(dt, [&]<class E>() {
    vocab_ce_sums_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(logits), targets, max, sums, N, V, first, vocab);
  });
}

int chunk_ce_sums(void* s, int dt, const void* logits, const std::int32_t* targets, float* max, float* sums,
                  std::int64_t N, std::int64_t V, std::int64_t first, std::int64_t vocab) {
  return with_type(dt, [&]<class E>() {
    chunk_ce_sums_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(logits), targets, max, sums, N, V, first, vocab);
  });
}

int vocab_ce_loss(void* s, const float* max, const float* sums, float* loss, std::int64_t N) {
  vocab_ce_loss_kernel<<<1, 1024, 0, as_stream(s)>>>(max, sums, loss, N);
  return 0;
}

int vocab_ce_backward(void* s, int dt, const void* logits, const std::int32_t* targets, const float* max,
                      const float* sums, const float* seed, void* dlogits, std::int64_t N, std::int64_t V,
                      std::int64_t first) {
  return with_type(dt, [&]<class E>() {
    vocab_ce_backward_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(logits), targets, max, sums, seed, static_cast<E*>(dlogits), N, V, first);
  });
}

int mse_forward(void* s, int dt, const void* pred, const void* target, float* loss, float* squares, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    squared_error_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(pred),
                                                                         static_cast<const E*>(target), squares, n);
    mean_kernel<<<1, 1024, 0, as_stream(s)>>>(squares, loss, n);
  });
}

int mse_backward(void* s, int dt, const void* pred, const void* target, const float* seed, void* dpred,
                 std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    mse_backward_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(pred), static_cast<const E*>(target), seed, static_cast<E*>(dpred), n);
  });
}

}  // namespace coshard::modules::cuda
