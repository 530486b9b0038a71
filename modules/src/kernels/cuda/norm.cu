// LayerNorm and RMSNorm on CUDA, f32/bf16/f16 storage with f32 arithmetic.
// Forward: one block per row computes the row's statistics and writes the affine output (rows of
// whole 16-byte vectors up to 4096 elements held in registers, loaded once: the vector path).
// Backward, fused (norm_backward_partials says where): one kernel reads each row of dout and x
// once from memory, writes dx, and adds the row's parameter-gradient terms into shared memory;
// a column sum then adds the blocks' partials in block order. Deterministic, and two passes over
// the N x C inputs fewer than the two-kernel form (a dx kernel, then a column sum over dout and x
// again), which still serves rows too wide for a block's shared memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "column_sum.cuh"
#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

// ---- LayerNorm: one block per row ----

template <class T>
__global__ void layernorm_forward_kernel(const T* x, const T* w, const T* b, T* out, float* mean, float* rstd,
                                         std::int64_t C, float eps) {
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * C;
  float s = 0;
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) s += load(xr, j);
  const float m = block_sum(s) / static_cast<float>(C);
  float v = 0;
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float d = load(xr, j) - m;
    v += d * d;
  }
  const float r = rsqrtf(block_sum(v) / static_cast<float>(C) + eps);
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x)
    store(out + row * C, j, (load(xr, j) - m) * r * load(w, j) + load(b, j));
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// ---- RMSNorm: one block per row ----

template <class T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, T* out, float* rstd, std::int64_t C, float eps) {
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * C;
  float s = 0;
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float v = load(xr, j);
    s += v * v;
  }
  const float r = rsqrtf(block_sum(s) / static_cast<float>(C) + eps);
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) store(out + row * C, j, load(xr, j) * r * load(w, j));
  if (threadIdx.x == 0) rstd[row] = r;
}

// ---- the vector path: a row in registers ----
// Rows of whole 16-byte vectors, at most 16 elements a thread (C <= 4096 at kThreads 256) and
// 16-byte aligned: each thread loads its vectors of the row once, 16 bytes a load, and every
// pass after that (the statistics and the output forward; the two sums, dx and the column terms
// backward) reads registers. The scalar kernels above and below serve every other row, and the
// same arithmetic in another order of sums.
template <class T>
inline constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements a vector
template <class T>
inline constexpr int kRowVectors = 16 / kVec<T>;  // vectors a thread at most

template <class T>
__device__ __forceinline__ void load_vec(const T* p, std::int64_t vec, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p + vec * kVec<T>);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) out[i] = load(e, i);
}
template <class T>
__device__ __forceinline__ void store_vec(T* p, std::int64_t vec, const float* in) {
  uint4 raw = make_uint4(0, 0, 0, 0);
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) store(e, i, in[i]);
  *reinterpret_cast<uint4*>(p + vec * kVec<T>) = raw;
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Whether rows of C elements of T at these addresses take the vector path.
template <class T>
bool vector_rows(std::int64_t C, std::initializer_list<const void*> pointers) {
  if (C <= 0 || C % kVec<T> != 0 || C / kVec<T> > std::int64_t{kThreads} * kRowVectors<T>) return false;
  for (const void* p : pointers)
    if (p && !aligned16(p)) return false;
  return true;
}

template <class T, bool kLayerNorm>
__global__ void norm_forward_vec_kernel(const T* x, const T* w, const T* b, T* out, float* mean, float* rstd,
                                        std::int64_t C, float eps) {
  constexpr int V = kVec<T>, K = kRowVectors<T>;
  const std::int64_t row = blockIdx.x, vecs = C / V;
  const T* xr = x + row * C;
  float xv[K][V];
  float s = 0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const std::int64_t vec = threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x;
    if (vec >= vecs) continue;
    load_vec(xr, vec, xv[k]);
#pragma unroll
    for (int i = 0; i < V; ++i) s += kLayerNorm ? xv[k][i] : xv[k][i] * xv[k][i];
  }
  float m = 0, r = 0;
  if constexpr (kLayerNorm) {
    m = block_sum(s) / static_cast<float>(C);
    float var = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x >= vecs) continue;
#pragma unroll
      for (int i = 0; i < V; ++i) var += (xv[k][i] - m) * (xv[k][i] - m);
    }
    r = rsqrtf(block_sum(var) / static_cast<float>(C) + eps);
  } else {
    r = rsqrtf(block_sum(s) / static_cast<float>(C) + eps);
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const std::int64_t vec = threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x;
    if (vec >= vecs) continue;
    float wv[V], bv[V], o[V];
    load_vec(w, vec, wv);
    if constexpr (kLayerNorm) load_vec(b, vec, bv);
#pragma unroll
    for (int i = 0; i < V; ++i) o[i] = kLayerNorm ? (xv[k][i] - m) * r * wv[i] + bv[i] : xv[k][i] * r * wv[i];
    store_vec(out + row * C, vec, o);
  }
  if (threadIdx.x == 0) {
    if constexpr (kLayerNorm) mean[row] = m;
    rstd[row] = r;
  }
}

// The backward on the vector path: block b takes rows [b * rows_per_block, ...) and writes their
// dx; each thread sums its own columns' weight (and bias) terms in registers over those rows, in
// row order, and writes them to the block's row of `partials` as the scalar fused kernel does
// (null partials: dx alone, the two-kernel form's first kernel).
template <class T, ColumnGrad kKind>
__global__ void norm_backward_vec_kernel(const T* dout, const T* x, const T* w, const float* mean, const float* rstd,
                                         T* dx, float* partials, std::int64_t N, std::int64_t C,
                                         std::int64_t rows_per_block) {
  constexpr bool kLayerNorm = kKind == ColumnGrad::layernorm;
  constexpr int V = kVec<T>, K = kRowVectors<T>;
  const std::int64_t vecs = C / V;
  float wv[K][V], sw[K][V], sb[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const std::int64_t vec = threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x;
#pragma unroll
    for (int i = 0; i < V; ++i) sw[k][i] = sb[k][i] = wv[k][i] = 0;
    if (vec < vecs) load_vec(w, vec, wv[k]);
  }
  const std::int64_t first = blockIdx.x * rows_per_block;
  const std::int64_t last = first + rows_per_block < N ? first + rows_per_block : N;
  for (std::int64_t row = first; row < last; ++row) {
    const float m = kLayerNorm ? mean[row] : 0.0f, r = rstd[row];
    float gv[K][V], xhat[K][V];
    float a = 0, bsum = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const std::int64_t vec = threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x;
      if (vec >= vecs) continue;
      load_vec(dout + row * C, vec, gv[k]);
      load_vec(x + row * C, vec, xhat[k]);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        xhat[k][i] = (xhat[k][i] - m) * r;
        const float dxhat = gv[k][i] * wv[k][i];
        a += dxhat;
        bsum += dxhat * xhat[k][i];
      }
    }
    const float mean_dxhat = kLayerNorm ? block_sum(a) / static_cast<float>(C) : 0.0f;
    const float mean_dxhat_xhat = block_sum(bsum) / static_cast<float>(C);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const std::int64_t vec = threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x;
      if (vec >= vecs) continue;
      float d[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        d[i] = r * (gv[k][i] * wv[k][i] - mean_dxhat - xhat[k][i] * mean_dxhat_xhat);
        sw[k][i] += gv[k][i] * xhat[k][i];
        sb[k][i] += gv[k][i];
      }
      store_vec(dx + row * C, vec, d);
    }
  }
  if (!partials) return;  // (the two-kernel form's dx: the column sums come after)
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const std::int64_t vec = threadIdx.x + static_cast<std::int64_t>(k) * blockDim.x;
    if (vec >= vecs) continue;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      partials[blockIdx.x * C + vec * V + i] = sw[k][i];
      if constexpr (kLayerNorm) partials[(gridDim.x + blockIdx.x) * C + vec * V + i] = sb[k][i];
    }
  }
}

// ---- backward ----

// One row of a norm's backward (the row's dout, x and dx; its mean, unused by RMSNorm, and rstd):
// writes dx, and with `sums` adds the row's weight terms into sums[0, C) and, for LayerNorm, its
// bias terms into sums[C, 2C). Thread t owns columns t, t + blockDim.x, ... of the sums, so they
// need no synchronisation. Both backward forms run this, so their dx has the same bits.
template <class T, ColumnGrad kKind>
__device__ void norm_backward_row(const T* gr, const T* xr, const T* w, float m, float r, T* dxr, std::int64_t C,
                                  float* sums) {
  if constexpr (kKind == ColumnGrad::layernorm) {
    float a = 0, bsum = 0;
    for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float xhat = (load(xr, j) - m) * r;
      const float dxhat = load(gr, j) * load(w, j);
      a += dxhat;
      bsum += dxhat * xhat;
    }
    const float mean_dxhat = block_sum(a) / static_cast<float>(C);
    const float mean_dxhat_xhat = block_sum(bsum) / static_cast<float>(C);
    for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float g = load(gr, j);
      const float xhat = (load(xr, j) - m) * r;
      store(dxr, j, r * (g * load(w, j) - mean_dxhat - xhat * mean_dxhat_xhat));
      if (sums) {
        sums[j] += g * xhat;
        sums[C + j] += g;
      }
    }
  } else {
    float a = 0;
    for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) a += load(gr, j) * load(w, j) * load(xr, j) * r;
    const float mean_dxhat_xhat = block_sum(a) / static_cast<float>(C);
    for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float g = load(gr, j);
      const float xhat = load(xr, j) * r;
      store(dxr, j, r * (g * load(w, j) - xhat * mean_dxhat_xhat));
      if (sums) sums[j] += g * xhat;
    }
  }
}

// The two-kernel form's first kernel: dx, one block per row.
template <class T, ColumnGrad kKind>
__global__ void norm_backward_dx_kernel(const T* dout, const T* x, const T* w, const float* mean, const float* rstd,
                                        T* dx, std::int64_t C) {
  const std::int64_t row = blockIdx.x;
  float m = 0;
  if constexpr (kKind == ColumnGrad::layernorm) m = mean[row];
  norm_backward_row<T, kKind>(dout + row * C, x + row * C, w, m, rstd[row], dx + row * C, C, nullptr);
}

// The fused form: block b takes rows [b * rows_per_block, ...) one at a time into its shared
// sums, which go to row b of `partials` (weight) and row gridDim.x + b (bias), both [.., C].
template <class T, ColumnGrad kKind>
__global__ void norm_backward_fused_kernel(const T* dout, const T* x, const T* w, const float* mean,
                                           const float* rstd, T* dx, float* partials, std::int64_t N,
                                           std::int64_t C, std::int64_t rows_per_block) {
  constexpr bool kLayerNorm = kKind == ColumnGrad::layernorm;
  extern __shared__ float sums[];
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    sums[j] = 0;
    if constexpr (kLayerNorm) sums[C + j] = 0;
  }
  const std::int64_t first = blockIdx.x * rows_per_block;
  const std::int64_t last = first + rows_per_block < N ? first + rows_per_block : N;
  for (std::int64_t row = first; row < last; ++row) {
    float m = 0;
    if constexpr (kLayerNorm) m = mean[row];
    norm_backward_row<T, kKind>(dout + row * C, x + row * C, w, m, rstd[row], dx + row * C, C, sums);
  }
  for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    partials[blockIdx.x * C + j] = sums[j];
    if constexpr (kLayerNorm) partials[(gridDim.x + blockIdx.x) * C + j] = sums[C + j];
  }
}

// dx, and dw (and db) += the column sums: fused where `partials` is given and the row fits.
template <class T, ColumnGrad kKind>
void norm_backward(cudaStream_t s, const T* dout, const T* x, const T* w, const float* mean, const float* rstd, T* dx,
                   T* dw, T* db, float* partials, std::int64_t N, std::int64_t C) {
  constexpr bool kLayerNorm = kKind == ColumnGrad::layernorm;
  const bool vector = vector_rows<T>(C, {dout, x, w, dx});
  if (partials == nullptr || norm_backward_partials(N, C, kLayerNorm) == 0) {
    // (the vector path's dx, a row a block and no partials, so that both forms give its bits)
    if (vector)
      norm_backward_vec_kernel<T, kKind><<<static_cast<unsigned>(N), kThreads, 0, s>>>(dout, x, w, mean, rstd, dx,
                                                                                       nullptr, N, C, 1);
    else
      norm_backward_dx_kernel<T, kKind><<<static_cast<unsigned>(N), kThreads, 0, s>>>(dout, x, w, mean, rstd, dx, C);
    launch_column_grad<T, T, kKind>(s, dout, x, mean, rstd, dw, db, N, C);
    return;
  }
  const std::int64_t rows_per_block = norm_backward_rows_per_block(N);
  const std::int64_t blocks = norm_backward_blocks(N);
  if (vector) {
    norm_backward_vec_kernel<T, kKind><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
        dout, x, w, mean, rstd, dx, partials, N, C, rows_per_block);
  } else {
    const std::size_t shared = static_cast<std::size_t>(C) * (kLayerNorm ? 2 : 1) * sizeof(float);
    norm_backward_fused_kernel<T, kKind><<<static_cast<unsigned>(blocks), kThreads, shared, s>>>(
        dout, x, w, mean, rstd, dx, partials, N, C, rows_per_block);
  }
  launch_column_grad<float, T, ColumnGrad::bias>(s, partials, nullptr, nullptr, nullptr, nullptr, dw, blocks, C);
  if constexpr (kLayerNorm)
    launch_column_grad<float, T, ColumnGrad::bias>(s, partials + blocks * C, nullptr, nullptr, nullptr, nullptr, db,
                                                   blocks, C);
}

}  // namespace

int layernorm_forward(void* s, int dt, const void* x, const void* w, const void* b, void* out, float* mean,
                      float* rstd, std::int64_t N, std::int64_t C, float eps) {
  return with_type(dt, [&]<class E>() {
    if (vector_rows<E>(C, {x, w, b, out}))
      norm_forward_vec_kernel<E, true><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
          static_cast<const E*>(x), static_cast<const E*>(w), static_cast<const E*>(b), static_cast<E*>(out), mean,
          rstd, C, eps);
    else
      layernorm_forward_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
          static_cast<const E*>(x), static_cast<const E*>(w), static_cast<const E*>(b), static_cast<E*>(out), mean,
          rstd, C, eps);
  });
}

int layernorm_backward(void* s, int dt, const void* dout, const void* x, const void* w, const float* mean,
                       const float* rstd, void* dx, void* dw, void* db, float* partials, std::int64_t N,
                       std::int64_t C) {
  return with_type(dt, [&]<class E>() {
    norm_backward<E, ColumnGrad::layernorm>(as_stream(s), static_cast<const E*>(dout), static_cast<const E*>(x),
                                            static_cast<const E*>(w), mean, rstd, static_cast<E*>(dx),
                                            static_cast<E*>(dw), static_cast<E*>(db), partials, N, C);
  });
}

int rmsnorm_forward(void* s, int dt, const void* x, const void* w, void* out, float* rstd, std::int64_t N,
                    std::int64_t C, float eps) {
  return with_type(dt, [&]<class E>() {
    if (vector_rows<E>(C, {x, w, out}))
      norm_forward_vec_kernel<E, false><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
          static_cast<const E*>(x), static_cast<const E*>(w), nullptr, static_cast<E*>(out), nullptr, rstd, C, eps);
    else
      rmsnorm_forward_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, as_stream(s)>>>(
          static_cast<const E*>(x), static_cast<const E*>(w), static_cast<E*>(out), rstd, C, eps);
  });
}

int rmsnorm_backward(void* s, int dt, const void* dout, const void* x, const void* w, const float* rstd, void* dx,
                     void* dw, float* partials, std::int64_t N, std::int64_t C) {
  return with_type(dt, [&]<class E>() {
    norm_backward<E, ColumnGrad::rmsnorm>(as_stream(s), static_cast<const E*>(dout), static_cast<const E*>(x),
                                          static_cast<const E*>(w), nullptr, rstd, static_cast<E*>(dx),
                                          static_cast<E*>(dw), nullptr, partials, N, C);
  });
}

}  // namespace coshard::modules::cuda
