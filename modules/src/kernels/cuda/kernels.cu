// CUDA kernels for the layers (the matrix products are cuBLAS, in cuda_kernels.cpp; the norms
// are in norm.cu, the fused attention in attention.cu, the optimizers in optimizer.cu).
// f32, bf16 and f16 storage; all arithmetic in f32. Reductions that feed parameter gradients
// (bias, position embeddings) add in a fixed order (see column_sum.cuh), so they are
// deterministic; token-embedding gradients and the gradient norm use atomics and are not
// bit-reproducible run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "column_sum.cuh"
#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

// ---- embeddings ----

template <class T>
__global__ void embedding_forward_kernel(const std::int32_t* tokens, const T* wte, const T* wpe, T* out,
                                         std::int64_t BT, std::int64_t T_, std::int64_t C, std::int64_t vocab,
                                         std::int64_t first, std::int64_t rows) {
  COSHARD_GRID_STRIDE(i, BT * C) {
    const std::int64_t row = i / C, c = i % C;
    const std::int32_t tok = tokens[row];
    const std::int64_t at = tok - first;  // this table's row (another rank's: zeros)
    const float e = !(tok >= 0 && tok < vocab) ? NAN : (at >= 0 && at < rows) ? load(wte, at * C + c) : 0.0f;
    store(out, i, wpe ? e + load(wpe, (row % T_) * C + c) : e);
  }
}

template <class T>
__global__ void embedding_token_grad_kernel(const std::int32_t* tokens, const T* dout, T* dwte, std::int64_t BT,
                                            std::int64_t C, std::int64_t first, std::int64_t rows) {
  COSHARD_GRID_STRIDE(i, BT * C) {
    const std::int64_t row = i / C, c = i % C;
    const std::int64_t at = tokens[row] - first;
    if (at >= 0 && at < rows) atomicAdd(dwte + at * C + c, dout[i]);
  }
}

// One thread per (position, column), summing over the batch in order.
template <class T>
__global__ void embedding_position_grad_kernel(const T* dout, T* dwpe, std::int64_t B, std::int64_t T_,
                                               std::int64_t C) {
  COSHARD_GRID_STRIDE(i, T_ * C) {
    float sum = 0;
    for (std::int64_t b = 0; b < B; ++b) sum += load(dout, b * T_ * C + i);
    store(dwpe, i, load(dwpe, i) + sum);
  }
}

// ---- elementwise ----

constexpr float kGeluScale = 0.7978845608028654f;
constexpr float kGeluCube = 0.044715f;

// SwiGLU over rows of gate | up: element k of the output is row k / I, column k % I.
template <class T>
__global__ void swiglu_forward_kernel(const T* gate_up, T* out, std::int64_t N, std::int64_t I) {
  COSHARD_GRID_STRIDE(k, N * I) {
    const std::int64_t row = k / I, j = k % I;
    const float g = load(gate_up, row * 2 * I + j), u = load(gate_up, row * 2 * I + I + j);
    store(out, k, g / (1.0f + __expf(-g)) * u);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* gate_up, const T* dout, T* dgate_up, std::int64_t N, std::int64_t I) {
  COSHARD_GRID_STRIDE(k, N * I) {
    const std::int64_t row = k / I, j = k % I;
    const float g = load(gate_up, row * 2 * I + j), u = load(gate_up, row * 2 * I + I + j), d = load(dout, k);
    const float sg = 1.0f / (1.0f + __expf(-g));
    store(dgate_up, row * 2 * I + j, d * u * sg * (1.0f + g * (1.0f - sg)));
    store(dgate_up, row * 2 * I + I + j, d * g * sg);
  }
}

// RoPE: one thread per (row, head, pair); heads past `rotated` are copied.
template <class T>
__global__ void rope_kernel(const T* x, T* out, const float* inv_freq, std::int64_t B, std::int64_t T_,
                            std::int64_t heads, std::int64_t rotated, std::int64_t hd, bool inverse, std::int64_t first) {
  const std::int64_t half = hd / 2;
  COSHARD_GRID_STRIDE(k, B * T_ * heads * half) {
    const std::int64_t i = k % half, h = (k / half) % heads, row = k / (half * heads), t = row % T_;
    const std::int64_t at = (row * heads + h) * hd + i;
    const float x1 = load(x, at), x2 = load(x, at + half);
    if (h >= rotated) {
      store(out, at, x1);
      store(out, at + half, x2);
    } else {
      float sn = 0, c = 0;
      sincosf(static_cast<float>(first + t) * inv_freq[i], &sn, &c);
      if (inverse) sn = -sn;
      store(out, at, x1 * c - x2 * sn);
      store(out, at + half, x2 * c + x1 * sn);
    }
  }
}

// Decoding with a key/value cache (Kernels::attention_decode): one block per (row b, new position
// i, head h); its threads score the keys 0..first+i into scratch, the block reduces the maximum and
// the sum, then each thread sums the values for its columns. Plain, not fast: one query a block.
inline constexpr int kDecodeThreads = 128;

template <class T>
__global__ void attention_decode_kernel(const T* cache, T* out, float* scratch, std::int64_t Tmax, std::int64_t first,
                                        std::int64_t Tn, std::int64_t H, std::int64_t KVH, std::int64_t hd) {
  __shared__ float reduce[kDecodeThreads];
  const std::int64_t h = blockIdx.x % H, i = (blockIdx.x / H) % Tn, b = blockIdx.x / (H * Tn);
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, kv = C + (h / (H / KVH)) * hd, at = first + i;
  const T* rows = cache + b * Tmax * W;
  const T* q = rows + at * W + h * hd;
  float* scores = scratch + static_cast<std::int64_t>(blockIdx.x) * (first + Tn);
  const float scale = rsqrtf(static_cast<float>(hd));
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j <= at; j += blockDim.x) {
    float dot = 0;
    for (std::int64_t d = 0; d < hd; ++d) dot += load(q, d) * load(rows, j * W + kv + d);
    scores[j] = dot * scale;
    mx = fmaxf(mx, scores[j]);
  }
  reduce[threadIdx.x] = mx;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) reduce[threadIdx.x] = fmaxf(reduce[threadIdx.x], reduce[threadIdx.x + stride]);
    __syncthreads();
  }
  mx = reduce[0];
  __syncthreads();
  float sum = 0;
  for (std::int64_t j = threadIdx.x; j <= at; j += blockDim.x) {
    scores[j] = __expf(scores[j] - mx);
    sum += scores[j];
  }
  reduce[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) reduce[threadIdx.x] += reduce[threadIdx.x + stride];
    __syncthreads();
  }
  const float inv = 1.0f / reduce[0];
  T* o = out + (b * Tn + i) * C + h * hd;
  for (std::int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0;
    for (std::int64_t j = 0; j <= at; ++j) acc += scores[j] * load(rows, j * W + kv + KVH * hd + d);
    store(o, d, acc * inv);
  }
}

template <class T>
__global__ void gelu_forward_kernel(const T* x, T* out, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) {
    const float v = load(x, i);
    store(out, i, 0.5f * v * (1.0f + tanhf(kGeluScale * (v + kGeluCube * v * v * v))));
  }
}

template <class T>
__global__ void gelu_backward_kernel(const T* x, const T* dout, T* dx, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) {
    const float v = load(x, i);
    const float th = tanhf(kGeluScale * (v + kGeluCube * v * v * v));
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCube * v * v);
    store(dx, i, load(dout, i) * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du));
  }
}

template <class T>
__global__ void add_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) { store(out, i, load(a, i) + load(b, i)); }
}

template <class T>
__global__ void mul_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) { store(out, i, load(a, i) * load(b, i)); }
}

template <class T>
__global__ void scale_kernel(T* x, float factor, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) { store(x, i, load(x, i) * factor); }
}

// Rows over the grid's y, columns over its x: no 64-bit division per element (which made this
// add, over a vocabulary-wide head, cost as much as the head's matrix product).
template <class T>
__global__ void bias_add_kernel(T* out, const T* bias, std::int64_t N, std::int64_t C) {
  for (std::int64_t row = blockIdx.y; row < N; row += gridDim.y)
    for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < C;
         j += static_cast<std::int64_t>(blockDim.x) * gridDim.x)
      store(out, row * C + j, load(out, row * C + j) + load(bias, j));
}

// ---- attention softmax: one block per row ----

template <class T>
__global__ void causal_softmax_kernel(T* scores, std::int64_t T_, float scale) {
  const std::int64_t row = blockIdx.x;  // over matrices * T
  const std::int64_t i = row % T_;
  T* r = scores + row * T_;
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, load(r, j) * scale);
  mx = block_max(mx);
  float sum = 0;
  for (std::int64_t j = threadIdx.x; j <= i; j += blockDim.x) sum += __expf(load(r, j) * scale - mx);
  const float inv = 1.0f / block_sum(sum);
  for (std::int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    store(r, j, j <= i ? __expf(load(r, j) * scale - mx) * inv : 0.0f);
}

template <class T>
__global__ void causal_softmax_backward_kernel(const T* probs, T* dprobs, std::int64_t T_) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t i = row % T_;
  const T* p = probs + row * T_;
  T* d = dprobs + row * T_;
  float dot = 0;
  for (std::int64_t j = threadIdx.x; j <= i; j += blockDim.x) dot += load(p, j) * load(d, j);
  dot = block_sum(dot);
  for (std::int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    store(d, j, j <= i ? load(p, j) * (load(d, j) - dot) : 0.0f);
}

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

__global__ void cast_kernel(int from, const void* src, int to, void* dst, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) { store_any(to, dst, i, load_any(from, src, i)); }
}

}  // namespace

int embedding_forward(void* s, int dt, const std::int32_t* tokens, const void* wte, const void* wpe, void* out,
                      std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t vocab, std::int64_t first,
                      std::int64_t rows) {
  return with_type(dt, [&]<class E>() {
    embedding_forward_kernel<E><<<grid_for(B * T * C), kThreads, 0, as_stream(s)>>>(
        tokens, static_cast<const E*>(wte), static_cast<const E*>(wpe), static_cast<E*>(out), B * T, T, C, vocab,
        first, rows);
  });
}

int embedding_backward(void* s, int dt, const std::int32_t* tokens, const void* dout, void* dwte, void* dwpe,
                       std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t first, std::int64_t rows) {
  return with_type(dt, [&]<class E>() {
    embedding_token_grad_kernel<E><<<grid_for(B * T * C), kThreads, 0, as_stream(s)>>>(
        tokens, static_cast<const E*>(dout), static_cast<E*>(dwte), B * T, C, first, rows);
    if (dwpe)
      embedding_position_grad_kernel<E><<<grid_for(T * C), kThreads, 0, as_stream(s)>>>(
          static_cast<const E*>(dout), static_cast<E*>(dwpe), B, T, C);
  });
}

int swiglu_forward(void* s, int dt, const void* gate_up, void* out, std::int64_t N, std::int64_t I) {
  return with_type(dt, [&]<class E>() {
    swiglu_forward_kernel<E><<<grid_for(N * I), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(gate_up),
                                                                            static_cast<E*>(out), N, I);
  });
}

int swiglu_backward(void* s, int dt, const void* gate_up, const void* dout, void* dgate_up, std::int64_t N,
                    std::int64_t I) {
  return with_type(dt, [&]<class E>() {
    swiglu_backward_kernel<E><<<grid_for(N * I), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(gate_up), static_cast<const E*>(dout), static_cast<E*>(dgate_up), N, I);
  });
}

int rope(void* s, int dt, const void* x, void* out, const float* inv_freq, std::int64_t B, std::int64_t T,
         std::int64_t heads, std::int64_t rotated, std::int64_t hd, bool inverse, std::int64_t first) {
  return with_type(dt, [&]<class E>() {
    rope_kernel<E><<<grid_for(B * T * heads * (hd / 2)), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(x), static_cast<E*>(out), inv_freq, B, T, heads, rotated, hd, inverse, first);
  });
}

int attention_decode(void* s, int dt, const void* cache, void* out, float* scratch, std::int64_t B, std::int64_t Tmax,
                     std::int64_t first, std::int64_t Tn, std::int64_t H, std::int64_t KVH, std::int64_t hd) {
  const auto blocks = static_cast<unsigned>(B * Tn * H);
  return with_type(dt, [&]<class E>() {
    attention_decode_kernel<E><<<blocks, kDecodeThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(cache), static_cast<E*>(out), scratch, Tmax, first, Tn, H, KVH, hd);
  });
}

int gelu_forward(void* s, int dt, const void* x, void* out, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    gelu_forward_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(x),
                                                                        static_cast<E*>(out), n);
  });
}

int gelu_backward(void* s, int dt, const void* x, const void* dout, void* dx, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    gelu_backward_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(x), static_cast<const E*>(dout), static_cast<E*>(dx), n);
  });
}

int add(void* s, int dt, const void* a, const void* b, void* out, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    add_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(a), static_cast<const E*>(b),
                                                              static_cast<E*>(out), n);
  });
}

int mul(void* s, int dt, const void* a, const void* b, void* out, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    mul_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(a), static_cast<const E*>(b),
                                                              static_cast<E*>(out), n);
  });
}

int scale(void* s, int dt, void* x, float factor, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    scale_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<E*>(x), factor, n);
  });
}

int bias_add(void* s, int dt, void* out, const void* bias, std::int64_t N, std::int64_t C) {
  return with_type(dt, [&]<class E>() {
    const dim3 grid(grid_for(C), static_cast<unsigned>(N < 1 ? 1 : (N > 65535 ? 65535 : N)));
    bias_add_kernel<E><<<grid, kThreads, 0, as_stream(s)>>>(static_cast<E*>(out), static_cast<const E*>(bias), N, C);
  });
}

int bias_grad(void* s, int dt, const void* dout, void* dbias, std::int64_t N, std::int64_t C) {
  return with_type(dt, [&]<class E>() {
    launch_column_grad<E, E, ColumnGrad::bias>(as_stream(s), static_cast<const E*>(dout), nullptr, nullptr, nullptr,
                                               nullptr, static_cast<E*>(dbias), N, C);
  });
}

int causal_softmax(void* s, int dt, void* scores, std::int64_t matrices, std::int64_t T, float scale) {
  return with_type(dt, [&]<class E>() {
    causal_softmax_kernel<E><<<static_cast<unsigned>(matrices * T), kThreads, 0, as_stream(s)>>>(
        static_cast<E*>(scores), T, scale);
  });
}

int causal_softmax_backward(void* s, int dt, const void* probs, void* dprobs, std::int64_t matrices,
                            std::int64_t T) {
  return with_type(dt, [&]<class E>() {
    causal_softmax_backward_kernel<E><<<static_cast<unsigned>(matrices * T), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(probs), static_cast<E*>(dprobs), T);
  });
}

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

int cast(void* s, int from, const void* src, int to, void* dst, std::int64_t n) {
  cast_kernel<<<grid_for(n), kThreads, 0, as_stream(s)>>>(from, src, to, dst, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace coshard::modules::cuda
