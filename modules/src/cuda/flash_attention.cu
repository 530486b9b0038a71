// Fused causal attention (see flash_attention.cuh). One thread block per tile of kTile rows and
// one (batch, head); its four warps own 16 rows of each tile product, computed with 16x16x16
// WMMA fragments. Scores, probabilities and the running output stay in shared memory (f32,
// probabilities rounded to the storage type before their product with V, as FlashAttention
// does); the only f32 state in device memory is one log-sum-exp per query row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "flash_attention.cuh"

namespace coshard::modules::cuda {
namespace {

using namespace nvcuda;

constexpr int kTile = 64;  // query rows and key rows per tile
constexpr int kWarps = kTile / 16;
constexpr int kFlashThreads = kWarps * 32;

template <class E>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major>;
template <class E>
using FragATransposed = wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::col_major>;
template <class E>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major>;
template <class E>
using FragBTransposed = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major>;
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Column sums and maxima over a warp (every lane gets the result).
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// dst [kTile][HD] (shared) <- rows [0, rows) of a matrix with row stride `ld` elements; the
// other rows are zero. `vec`: every row start is 16-byte aligned, so rows move in 16 bytes.
template <class E, int HD>
__device__ void load_tile(E* dst, const E* src, std::int64_t ld, int rows, bool vec) {
  if (vec) {
    constexpr int kPerRow = HD * static_cast<int>(sizeof(E)) / 16;
    for (int i = threadIdx.x; i < kTile * kPerRow; i += blockDim.x) {
      const int r = i / kPerRow, c = (i % kPerRow) * (16 / static_cast<int>(sizeof(E)));
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < rows) v = *reinterpret_cast<const uint4*>(src + r * ld + c);
      *reinterpret_cast<uint4*>(dst + r * HD + c) = v;
    }
  } else {
    for (int i = threadIdx.x; i < kTile * HD; i += blockDim.x) {
      const int r = i / HD, c = i % HD;
      store(dst, i, r < rows ? load(src, r * ld + c) : 0.0f);
    }
  }
}

// out[16 rows of `warp`][kTile] (f32, row stride kTile) = A[rows][HD] * B[kTile][HD]^T, both
// row-major in shared memory with row stride HD.
template <class E, int HD>
__device__ void product_abt(const E* a, const E* b, float* out, int warp) {
  const int r0 = warp * 16;
  for (int n0 = 0; n0 < kTile; n0 += 16) {
    Accumulator acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < HD; kk += 16) {
      FragA<E> fa;
      FragBTransposed<E> fb;
      wmma::load_matrix_sync(fa, a + r0 * HD + kk, HD);
      wmma::load_matrix_sync(fb, b + n0 * HD + kk, HD);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + r0 * kTile + n0, acc, kTile, wmma::mem_row_major);
  }
}

// acc[16 rows of `warp`][HD] (f32, row stride HD) += op(A) * B, B [kTile][HD] row-major with
// row stride HD; A [kTile][kTile] row-major (row stride kTile), used as is or transposed.
template <class E, int HD, bool kTransposeA>
__device__ void accumulate_ab(const E* a, const E* b, float* acc_rows, int warp) {
  const int r0 = warp * 16;
  for (int n0 = 0; n0 < HD; n0 += 16) {
    Accumulator acc;
    wmma::load_matrix_sync(acc, acc_rows + r0 * HD + n0, HD, wmma::mem_row_major);
    for (int kk = 0; kk < kTile; kk += 16) {
      FragB<E> fb;
      wmma::load_matrix_sync(fb, b + kk * HD + n0, HD);
      if constexpr (kTransposeA) {
        FragATransposed<E> fa;  // element (m, k) is A[kk + k][r0 + m]
        wmma::load_matrix_sync(fa, a + kk * kTile + r0, kTile);
        wmma::mma_sync(acc, fa, fb, acc);
      } else {
        FragA<E> fa;
        wmma::load_matrix_sync(fa, a + r0 * kTile + kk, kTile);
        wmma::mma_sync(acc, fa, fb, acc);
      }
    }
    wmma::store_matrix_sync(acc_rows + r0 * HD + n0, acc, HD, wmma::mem_row_major);
  }
}

// Where a (batch, head)'s rows start, and their strides.
struct Heads {
  int T, H, KVH;
  __device__ std::int64_t width(int hd) const { return static_cast<std::int64_t>(H + 2 * KVH) * hd; }
};

// Shared memory carved in order, each region 128-byte aligned (WMMA needs 32).
struct Carve {
  unsigned char* p;
  template <class X>
  __device__ X* take(int count) {
    X* at = reinterpret_cast<X*>(p);
    p += (static_cast<std::size_t>(count) * sizeof(X) + 127) / 128 * 128;
    return at;
  }
};

// ---- forward ----

template <class E, int HD>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_kernel(const E* qkv, E* out, float* lse, Heads heads, float scale, bool vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int T = heads.T, H = heads.H, KVH = heads.KVH;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kTile;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH);
  const std::int64_t W = heads.width(HD), C = static_cast<std::int64_t>(H) * HD;
  const E* base = qkv + static_cast<std::int64_t>(b) * T * W;
  const E* q = base + h * HD;
  const E* k = base + C + kvh * HD;
  const E* v = base + C + KVH * HD + kvh * HD;

  Carve carve{smem};
  E* qs = carve.take<E>(kTile * HD);
  E* ks = carve.take<E>(kTile * HD);
  E* vs = carve.take<E>(kTile * HD);
  E* ps = carve.take<E>(kTile * kTile);
  float* ss = carve.take<float>(kTile * kTile);
  float* os = carve.take<float>(kTile * HD);
  float* row_max = carve.take<float>(kTile);
  float* row_sum = carve.take<float>(kTile);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const int rows_q = min(kTile, T - q0);
  load_tile<E, HD>(qs, q + q0 * W, W, rows_q, vec);
  for (int i = threadIdx.x; i < kTile * HD; i += blockDim.x) os[i] = 0.0f;
  if (threadIdx.x < kTile) {
    row_max[threadIdx.x] = -INFINITY;
    row_sum[threadIdx.x] = 0.0f;
  }
  const int q_last = q0 + rows_q - 1;
  for (int k0 = 0; k0 <= q_last; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous K and V tiles
    const int rows_k = min(kTile, T - k0);
    load_tile<E, HD>(ks, k + k0 * W, W, rows_k, vec);
    load_tile<E, HD>(vs, v + k0 * W, W, rows_k, vec);
    __syncthreads();
    product_abt<E, HD>(qs, ks, ss, warp);
    __syncwarp();
    // Online softmax of the warp's rows; each lane holds columns lane and lane + 32.
    for (int r = r0; r < r0 + 16; ++r) {
      const int qi = q0 + r;
      const int c0 = k0 + lane, c1 = k0 + lane + 32;
      const float s0 = (c0 <= qi && c0 < T) ? ss[r * kTile + lane] * scale : -INFINITY;
      const float s1 = (c1 <= qi && c1 < T) ? ss[r * kTile + lane + 32] * scale : -INFINITY;
      const float m_old = row_max[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
      float p0 = 0.0f, p1 = 0.0f, alpha = 1.0f;
      if (m_new != -INFINITY) {
        p0 = rounded<E>(__expf(s0 - m_new));
        p1 = rounded<E>(__expf(s1 - m_new));
        alpha = __expf(m_old - m_new);
      }
      store(ps, r * kTile + lane, p0);
      store(ps, r * kTile + lane + 32, p1);
      const float sum = warp_sum(p0 + p1);
      __syncwarp();  // every lane has read row_max[r] before lane 0 writes it
      if (lane == 0) {
        row_max[r] = m_new;
        row_sum[r] = row_sum[r] * alpha + sum;
      }
      for (int c = lane; c < HD; c += 32) os[r * HD + c] *= alpha;
    }
    __syncwarp();
    accumulate_ab<E, HD, false>(ps, vs, os, warp);
  }
  __syncwarp();
  for (int r = r0; r < r0 + 16; ++r) {
    const int qi = q0 + r;
    if (qi >= T) break;
    const float inv = 1.0f / row_sum[r];
    E* orow = out + (static_cast<std::int64_t>(b) * T + qi) * C + h * HD;
    for (int c = lane; c < HD; c += 32) store(orow, c, os[r * HD + c] * inv);
    if (lane == 0) lse[(static_cast<std::int64_t>(b) * H + h) * T + qi] = row_max[r] + logf(row_sum[r]);
  }
}

// ---- backward ----

// delta[b, h, t] = sum over the head's columns of dout * out; one warp per query row.
template <class E>
__global__ void flash_delta_kernel(const E* dout, const E* out, float* delta, int B, int T, int H, int hd) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * H * T;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (std::int64_t row = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const std::int64_t t = row % T, h = (row / T) % H, b = row / (static_cast<std::int64_t>(T) * H);
    const std::int64_t at = (b * T + t) * H * hd + h * hd;
    float s = 0.0f;
    for (int c = lane; c < hd; c += 32) s += load(dout, at + c) * load(out, at + c);
    s = warp_sum(s);
    if (lane == 0) delta[row] = s;
  }
}

// The shared steps of both backward kernels for one (query tile, key tile) pair, on the warp's
// query rows: P = exp(S * scale - lse) (masked causally) into p (f32) and ps (rounded), and
// dS = P * (dP - delta) * scale into ds (rounded). S is in `p` on entry, dP in `dp`.
template <class E>
__device__ void probabilities_and_score_grads(float* p, const float* dp, E* ps, E* ds, const float* lse_rows,
                                              const float* delta_rows, int q0, int k0, int T, float scale,
                                              int warp, int lane) {
  for (int r = warp * 16; r < warp * 16 + 16; ++r) {
    const int qi = q0 + r;
    for (int c = lane; c < kTile; c += 32) {
      const int kj = k0 + c;
      const bool live = qi < T && kj <= qi;
      const float prob = live ? __expf(p[r * kTile + c] * scale - lse_rows[r]) : 0.0f;
      store(ps, r * kTile + c, prob);
      store(ds, r * kTile + c, live ? prob * (dp[r * kTile + c] - delta_rows[r]) * scale : 0.0f);
    }
  }
}

// The shared memory both backward kernels work in (each carves its f32 accumulators after it),
// and their common steps.
template <class E, int HD>
struct BackwardTiles {
  E *qs, *dos, *ks, *vs, *ps, *dss;
  float *p, *dp, *lse_rows, *delta_rows;
  static constexpr std::size_t kBytes =
      (4 * kTile * HD + 2 * kTile * kTile) * sizeof(E) + (2 * kTile * kTile + 2 * kTile) * sizeof(float);

  __device__ explicit BackwardTiles(Carve& carve)
      : qs(carve.take<E>(kTile * HD)),
        dos(carve.take<E>(kTile * HD)),
        ks(carve.take<E>(kTile * HD)),
        vs(carve.take<E>(kTile * HD)),
        ps(carve.take<E>(kTile * kTile)),
        dss(carve.take<E>(kTile * kTile)),
        p(carve.take<float>(kTile * kTile)),
        dp(carve.take<float>(kTile * kTile)),
        lse_rows(carve.take<float>(kTile)),
        delta_rows(carve.take<float>(kTile)) {}

  // A query tile of one head: its rows of Q (row stride W) and dO (row stride C) from row q0,
  // and their log-sum-exps and deltas (rows past T: zeros, masked later).
  __device__ void load_queries(const E* q, std::int64_t W, const E* dO, std::int64_t C, const float* lse_h,
                               const float* delta_h, int q0, int rows_q, bool vec) {
    load_tile<E, HD>(qs, q + q0 * W, W, rows_q, vec);
    load_tile<E, HD>(dos, dO + q0 * C, C, rows_q, vec);
    if (threadIdx.x < kTile) {
      const bool valid = static_cast<int>(threadIdx.x) < rows_q;
      lse_rows[threadIdx.x] = valid ? lse_h[q0 + threadIdx.x] : 0.0f;
      delta_rows[threadIdx.x] = valid ? delta_h[q0 + threadIdx.x] : 0.0f;
    }
  }

  // With Q, dO, K and V in place: S and dP = dO V^T of the warp's query rows, then their P and dS.
  __device__ void score_grads(int q0, int k0, int T, float scale, int warp, int lane) {
    product_abt<E, HD>(qs, ks, p, warp);
    product_abt<E, HD>(dos, vs, dp, warp);
    __syncwarp();
    probabilities_and_score_grads<E>(p, dp, ps, dss, lse_rows, delta_rows, q0, k0, T, scale, warp, lane);
  }
};

// dK and dV of one key/value tile of one (batch, key/value head): sums over the group's query
// heads in order, and over the query tiles at or after it.
template <class E, int HD>
__global__ void __launch_bounds__(kFlashThreads) flash_backward_kv_kernel(const E* dout, const E* qkv, const float* lse,
                                                                         const float* delta, E* dqkv, Heads heads,
                                                                         float scale, bool vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int T = heads.T, H = heads.H, KVH = heads.KVH, group = H / KVH;
  const int k0 = blockIdx.x * kTile, kvh = blockIdx.y, b = blockIdx.z;
  const std::int64_t W = heads.width(HD), C = static_cast<std::int64_t>(H) * HD;
  const std::int64_t row0 = static_cast<std::int64_t>(b) * T;

  Carve carve{smem};
  BackwardTiles<E, HD> tiles(carve);
  float* dk = carve.take<float>(kTile * HD);
  float* dv = carve.take<float>(kTile * HD);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_k = min(kTile, T - k0);
  const E* k = qkv + row0 * W + C + kvh * HD;
  const E* v = qkv + row0 * W + C + KVH * HD + kvh * HD;
  load_tile<E, HD>(tiles.ks, k + k0 * W, W, rows_k, vec);
  load_tile<E, HD>(tiles.vs, v + k0 * W, W, rows_k, vec);
  for (int i = threadIdx.x; i < kTile * HD; i += blockDim.x) dk[i] = dv[i] = 0.0f;

  for (int r = 0; r < group; ++r) {
    const int h = kvh * group + r;
    const float* lse_h = lse + (static_cast<std::int64_t>(b) * H + h) * T;
    const float* delta_h = delta + (static_cast<std::int64_t>(b) * H + h) * T;
    for (int q0 = k0; q0 < T; q0 += kTile) {
      __syncthreads();  // every warp is done with the previous query tile
      tiles.load_queries(qkv + row0 * W + h * HD, W, dout + row0 * C + h * HD, C, lse_h, delta_h, q0,
                         min(kTile, T - q0), vec);
      __syncthreads();
      tiles.score_grads(q0, k0, T, scale, warp, lane);
      __syncthreads();  // every query row's P and dS before the key-row products
      accumulate_ab<E, HD, true>(tiles.ps, tiles.dos, dv, warp);  // dV += P^T dO (the warp's key rows)
      accumulate_ab<E, HD, true>(tiles.dss, tiles.qs, dk, warp);  // dK += dS^T Q
    }
  }
  __syncthreads();
  E* dk_out = dqkv + row0 * W + C + kvh * HD;
  E* dv_out = dqkv + row0 * W + C + KVH * HD + kvh * HD;
  for (int i = threadIdx.x; i < rows_k * HD; i += blockDim.x) {
    const int r = i / HD, c = i % HD;
    store(dk_out, (k0 + r) * W + c, dk[i]);
    store(dv_out, (k0 + r) * W + c, dv[i]);
  }
}

// dQ of one query tile of one (batch, query head): sums over the key tiles at or before it.
template <class E, int HD>
__global__ void __launch_bounds__(kFlashThreads) flash_backward_q_kernel(const E* dout, const E* qkv, const float* lse,
                                                                        const float* delta, E* dqkv, Heads heads,
                                                                        float scale, bool vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int T = heads.T, H = heads.H, KVH = heads.KVH;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kTile;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH);
  const std::int64_t W = heads.width(HD), C = static_cast<std::int64_t>(H) * HD;
  const std::int64_t row0 = static_cast<std::int64_t>(b) * T;

  Carve carve{smem};
  BackwardTiles<E, HD> tiles(carve);
  float* dq = carve.take<float>(kTile * HD);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_q = min(kTile, T - q0);
  tiles.load_queries(qkv + row0 * W + h * HD, W, dout + row0 * C + h * HD, C,
                     lse + (static_cast<std::int64_t>(b) * H + h) * T,
                     delta + (static_cast<std::int64_t>(b) * H + h) * T, q0, rows_q, vec);
  for (int i = threadIdx.x; i < kTile * HD; i += blockDim.x) dq[i] = 0.0f;
  const E* k = qkv + row0 * W + C + kvh * HD;
  const E* v = qkv + row0 * W + C + KVH * HD + kvh * HD;
  const int q_last = q0 + rows_q - 1;
  for (int k0 = 0; k0 <= q_last; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous K and V tiles
    const int rows_k = min(kTile, T - k0);
    load_tile<E, HD>(tiles.ks, k + k0 * W, W, rows_k, vec);
    load_tile<E, HD>(tiles.vs, v + k0 * W, W, rows_k, vec);
    __syncthreads();
    tiles.score_grads(q0, k0, T, scale, warp, lane);
    __syncwarp();
    accumulate_ab<E, HD, false>(tiles.dss, tiles.ks, dq, warp);  // dQ += dS K (the warp's query rows)
  }
  __syncwarp();
  E* dq_out = dqkv + row0 * W + h * HD;
  for (int r = warp * 16; r < warp * 16 + 16 && r < rows_q; ++r) {
    for (int c = lane; c < HD; c += 32) store(dq_out, (q0 + r) * W + c, dq[r * HD + c]);
  }
}

// ---- launch ----

std::size_t forward_smem(int hd, std::size_t element) {
  return 3 * kTile * hd * element + kTile * kTile * element + kTile * kTile * 4 + kTile * hd * 4 + 2 * 128 + 4 * 128;
}
template <class E, int HD>
constexpr std::size_t backward_kv_smem = BackwardTiles<E, HD>::kBytes + 2 * kTile * HD * sizeof(float);
template <class E, int HD>
constexpr std::size_t backward_q_smem = BackwardTiles<E, HD>::kBytes + kTile * HD * sizeof(float);

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Launches `kernel` with `smem` bytes of dynamic shared memory (above the 48 KiB default).
template <class Kernel, class... Args>
cudaError_t launch(Kernel kernel, dim3 grid, std::size_t smem, cudaStream_t stream, Args... args) {
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      e != cudaSuccess) {
    return e;
  }
  kernel<<<grid, kFlashThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}

template <class E, int HD>
cudaError_t forward_as(cudaStream_t stream, const void* qkv, void* out, float* lse, std::int64_t B, Heads heads) {
  const dim3 grid((heads.T + kTile - 1) / kTile, heads.H, static_cast<unsigned>(B));
  const bool vec = aligned16(qkv);
  return launch(flash_forward_kernel<E, HD>, grid, forward_smem(HD, sizeof(E)), stream, static_cast<const E*>(qkv),
                static_cast<E*>(out), lse, heads, 1.0f / sqrtf(static_cast<float>(HD)), vec);
}

template <class E, int HD>
cudaError_t backward_as(cudaStream_t stream, const void* dout, const void* qkv, const void* out, const float* lse,
                        void* dqkv, float* delta, std::int64_t B, Heads heads) {
  const std::int64_t rows = B * heads.H * heads.T;
  const std::int64_t blocks = (rows + 7) / 8;  // 8 warps a block
  flash_delta_kernel<E><<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(
      static_cast<const E*>(dout), static_cast<const E*>(out), delta, static_cast<int>(B), heads.T, heads.H, HD);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const float scale = 1.0f / sqrtf(static_cast<float>(HD));
  const bool vec = aligned16(qkv) && aligned16(dout);
  const unsigned tiles = static_cast<unsigned>((heads.T + kTile - 1) / kTile);
  if (const cudaError_t e = launch(flash_backward_kv_kernel<E, HD>, dim3(tiles, heads.KVH, static_cast<unsigned>(B)),
                                   backward_kv_smem<E, HD>, stream, static_cast<const E*>(dout),
                                   static_cast<const E*>(qkv), lse, static_cast<const float*>(delta),
                                   static_cast<E*>(dqkv), heads, scale, vec);
      e != cudaSuccess) {
    return e;
  }
  return launch(flash_backward_q_kernel<E, HD>, dim3(tiles, heads.H, static_cast<unsigned>(B)),
                backward_q_smem<E, HD>, stream, static_cast<const E*>(dout), static_cast<const E*>(qkv), lse,
                static_cast<const float*>(delta), static_cast<E*>(dqkv), heads, scale, vec);
}

// Runs fn.template operator()<E, HD>() for the served (dtype, head size).
template <class Fn>
cudaError_t dispatch(int dt, std::int64_t hd, Fn&& fn) {
  auto by_size = [&]<class E>() -> cudaError_t {
    switch (hd) {
      case 32: return fn.template operator()<E, 32>();
      case 64: return fn.template operator()<E, 64>();
      case 96: return fn.template operator()<E, 96>();
      case 128: return fn.template operator()<E, 128>();
      default: return cudaErrorInvalidValue;
    }
  };
  switch (dt) {
    case kF16: return by_size.template operator()<__half>();
    case kBF16: return by_size.template operator()<__nv_bfloat16>();
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool flash_attention_supported(int dt, std::int64_t hd) {
  return (dt == kF16 || dt == kBF16) && (hd == 32 || hd == 64 || hd == 96 || hd == 128);
}

int flash_attention_forward(void* stream, int dt, const void* qkv, void* out, float* lse, std::int64_t B,
                            std::int64_t T, std::int64_t H, std::int64_t KVH, std::int64_t hd) {
  const Heads heads{static_cast<int>(T), static_cast<int>(H), static_cast<int>(KVH)};
  const auto s = static_cast<cudaStream_t>(stream);
  return static_cast<int>(dispatch(dt, hd, [&]<class E, int HD>() { return forward_as<E, HD>(s, qkv, out, lse, B, heads); }));
}

int flash_attention_backward(void* stream, int dt, const void* dout, const void* qkv, const void* out,
                             const float* lse, void* dqkv, float* delta, std::int64_t B, std::int64_t T,
                             std::int64_t H, std::int64_t KVH, std::int64_t hd) {
  const Heads heads{static_cast<int>(T), static_cast<int>(H), static_cast<int>(KVH)};
  const auto s = static_cast<cudaStream_t>(stream);
  return static_cast<int>(dispatch(dt, hd, [&]<class E, int HD>() {
    return backward_as<E, HD>(s, dout, qkv, out, lse, dqkv, delta, B, heads);
  }));
}

}  // namespace coshard::modules::cuda
