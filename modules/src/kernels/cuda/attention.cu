// Fused causal attention (see attention.cuh), FlashAttention-2's way: a warp owns 16 rows
// of a tile and keeps its products in registers through PTX's mma.m16n8k16 (mma.cuh), whose
// accumulator layout lets the scores, once exponentiated and rounded to the storage type, feed the
// product with V directly; the online softmax works on those registers, its row statistics reduced
// over the four lanes that share a row. Shared memory holds only the K/V (or Q/dO) tiles, padded
// against bank conflicts, and transposed copies of those read down their columns. Probabilities
// are rounded to the storage type before their products (as FlashAttention does); the only f32
// state in device memory is one log-sum-exp per query row (and backward's delta).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "attention.cuh"
#include "mma.cuh"

namespace coshard::modules::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kFlashThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // query rows of a forward or dQ block, key rows of a dK/dV block
constexpr int kKeys = 64;           // keys a tile (forward, dQ)
constexpr int kQueries = 32;        // query rows a tile of the dK/dV kernel (its registers' limit)
constexpr int kPad = 8;             // elements after each shared row: rows start on different banks

// Column sums and maxima over the four lanes of a row (lanes 4g .. 4g + 3).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Where a (batch, head)'s rows start, and their strides.
struct Heads {
  int T, H, KVH;
  __device__ std::int64_t width(int hd) const { return static_cast<std::int64_t>(H + 2 * KVH) * hd; }
};

// Shared memory carved in order, each region 128-byte aligned.
struct Carve {
  unsigned char* p;
  template <class X>
  __device__ X* take(int count) {
    X* at = reinterpret_cast<X*>(p);
    p += (static_cast<std::size_t>(count) * sizeof(X) + 127) / 128 * 128;
    return at;
  }
};
constexpr std::size_t carved(std::size_t bytes) { return (bytes + 127) / 128 * 128; }

// dst[r][0, HD) (row stride ld) <- rows [0, rows) of a matrix with row stride src_ld; rows up to
// ROWS past them are zero. `vec`: every source row starts 16-byte aligned (16-byte moves).
template <class E, int HD, int ROWS>
__device__ void load_rows(E* dst, int ld, const E* src, std::int64_t src_ld, int rows, bool vec) {
  if (vec) {
    constexpr int kPerRow = HD * static_cast<int>(sizeof(E)) / 16;
    for (int i = threadIdx.x; i < ROWS * kPerRow; i += blockDim.x) {
      const int r = i / kPerRow, c = (i % kPerRow) * (16 / static_cast<int>(sizeof(E)));
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < rows) v = *reinterpret_cast<const uint4*>(src + r * src_ld + c);
      *reinterpret_cast<uint4*>(dst + r * ld + c) = v;
    }
  } else {
    for (int i = threadIdx.x; i < ROWS * HD; i += blockDim.x) {
      const int r = i / HD, c = i % HD;
      store(dst, r * ld + c, r < rows ? load(src, r * src_ld + c) : 0.0f);
    }
  }
}

// dst[c][r] (row stride ldt) <- src[r][c] (row stride ld), ROWS x HD, both shared.
template <class E, int HD, int ROWS>
__device__ void transpose(E* dst, int ldt, const E* src, int ld) {
  for (int i = threadIdx.x; i < ROWS * HD; i += blockDim.x) {
    const int r = i % ROWS, c = i / ROWS;
    dst[c * ldt + r] = src[r * ld + c];
  }
}

// acc[j] (j < N8: 16 rows x 8 columns each) += A B^T over HD: A's 16 rows from row a0 of `a`, B's
// 8 N8 rows from row 0 of `b`, both row-major shared tiles with row stride ld.
template <class E, int HD, int N8>
__device__ __forceinline__ void rows_times_rows(float (&acc)[N8][4], const E* a, int a0, const E* b, int ld) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int kk = 0; kk < HD; kk += 16) {
    const std::uint32_t fa[4] = {word(a, a0 + g, kk + 2 * t, ld), word(a, a0 + g + 8, kk + 2 * t, ld),
                                 word(a, a0 + g, kk + 8 + 2 * t, ld), word(a, a0 + g + 8, kk + 8 + 2 * t, ld)};
#pragma unroll
    for (int j = 0; j < N8; ++j) {
      const std::uint32_t fb[2] = {word(b, j * 8 + g, kk + 2 * t, ld), word(b, j * 8 + g, kk + 8 + 2 * t, ld)};
      mma16816<E>(acc[j], fa, fb);
    }
  }
}

// out[n] (n < HD / 8: 16 rows x 8 columns each) += P B, P the 16 x (8 * N8) tile whose
// accumulators `p` hold (rounded to E here), B = bt^T with bt [HD][8 * N8] row-major in shared
// memory (row stride ldt): B's column n is bt's row n.
template <class E, int HD, int N8>
__device__ __forceinline__ void registers_times_columns(float (&out)[HD / 8][4], const float (&p)[N8][4], const E* bt,
                                                        int ldt) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int ks = 0; ks < N8 / 2; ++ks) {
    const std::uint32_t fa[4] = {pair<E>(p[2 * ks][0], p[2 * ks][1]), pair<E>(p[2 * ks][2], p[2 * ks][3]),
                                 pair<E>(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                                 pair<E>(p[2 * ks + 1][2], p[2 * ks + 1][3])};
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      const std::uint32_t fb[2] = {word(bt, n * 8 + g, ks * 16 + 2 * t, ldt),
                                   word(bt, n * 8 + g, ks * 16 + 8 + 2 * t, ldt)};
      mma16816<E>(out[n], fa, fb);
    }
  }
}

// Rows r and r + 8 of a warp's 16 x HD accumulators into global memory (row stride ld), columns
// from `col`, each pair of columns as one 4-byte store; rows at or past `rows` are left alone.
template <class E, int HD>
__device__ __forceinline__ void store_rows(E* dst, std::int64_t ld, const float (&acc)[HD / 8][4], int row0,
                                           int rows, float scale0, float scale1) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + 8 * half;
    if (r >= rows) continue;
    const float s = half ? scale1 : scale0;
    E* row = dst + r * ld;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
      *reinterpret_cast<std::uint32_t*>(row + n * 8 + 2 * t) = pair<E>(acc[n][2 * half] * s, acc[n][2 * half + 1] * s);
  }
}

// ---- forward ----

template <class E, int HD>
struct ForwardSmem {
  static constexpr int ld = HD + kPad, ldt = kKeys + kPad;
  static constexpr std::size_t bytes =
      carved(kRows * ld * sizeof(E)) + carved(kKeys * ld * sizeof(E)) + carved(HD * ldt * sizeof(E));
};

// One block: kRows query rows of one (batch, head), the warp's 16 rows in registers.
template <class E, int HD>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_kernel(const E* qkv, E* out, float* lse, Heads heads, float scale, bool vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = ForwardSmem<E, HD>;
  const int T = heads.T, H = heads.H, KVH = heads.KVH;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kRows;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH);
  const std::int64_t W = heads.width(HD), C = static_cast<std::int64_t>(H) * HD;
  const E* base = qkv + static_cast<std::int64_t>(b) * T * W;
  const E* q = base + h * HD;
  const E* k = base + C + kvh * HD;
  const E* v = base + C + KVH * HD + kvh * HD;

  Carve carve{smem};
  E* qs = carve.take<E>(kRows * S::ld);  // Q, then each V tile before its transpose
  E* ks = carve.take<E>(kKeys * S::ld);
  E* vt = carve.take<E>(HD * S::ldt);  // V transposed: [dim][key]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = warp * 16;
  const int rows_q = min(kRows, T - q0);
  load_rows<E, HD, kRows>(qs, S::ld, q + q0 * W, W, rows_q, vec);
  __syncthreads();
  // The warp's Q rows as A operands, kept for every key tile.
  std::uint32_t qa[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    qa[kk][0] = word(qs, r0 + g, kk * 16 + 2 * t, S::ld);
    qa[kk][1] = word(qs, r0 + g + 8, kk * 16 + 2 * t, S::ld);
    qa[kk][2] = word(qs, r0 + g, kk * 16 + 8 + 2 * t, S::ld);
    qa[kk][3] = word(qs, r0 + g + 8, kk * 16 + 8 + 2 * t, S::ld);
  }
  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 (l: this lane's part)
  const int qi[2] = {q0 + r0 + g, q0 + r0 + g + 8};
  const int q_last = q0 + rows_q - 1;
  for (int k0 = 0; k0 <= q_last; k0 += kKeys) {
    __syncthreads();  // every warp is done with the previous tiles (and with Q's)
    const int rows_k = min(kKeys, T - k0);
    load_rows<E, HD, kKeys>(ks, S::ld, k + k0 * W, W, rows_k, vec);
    load_rows<E, HD, kKeys>(qs, S::ld, v + k0 * W, W, rows_k, vec);
    __syncthreads();
    transpose<E, HD, kKeys>(vt, S::ldt, qs, S::ld);
    float s[kKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        const std::uint32_t fb[2] = {word(ks, j * 8 + g, kk * 16 + 2 * t, S::ld),
                                     word(ks, j * 8 + g, kk * 16 + 8 + 2 * t, S::ld)};
        mma16816<E>(s[j], qa[kk], fb);
      }
    }
    // Scaled and masked (causal, and keys past T), then the rows' new maxima.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kj = k0 + j * 8 + 2 * t + (e & 1), row = e >> 1;
        s[j][e] = (kj <= qi[row] && kj < T) ? s[j][e] * scale : -INFINITY;
        mx[row] = fmaxf(mx[row], s[j][e]);
      }
    float alpha[2];
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      mx[row] = quad_max(mx[row]);
      alpha[row] = mx[row] == -INFINITY ? 1.0f : __expf(m[row] - mx[row]);
      m[row] = mx[row];
      l[row] *= alpha[row];
    }
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = e >> 1;
        const float p = mx[row] == -INFINITY ? 0.0f : rounded<E>(__expf(s[j][e] - mx[row]));
        s[j][e] = p;
        l[row] += p;
      }
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    __syncthreads();  // V's transpose is complete
    registers_times_columns<E, HD, kKeys / 8>(o, s, vt, S::ldt);
  }
  const float sum[2] = {quad_sum(l[0]), quad_sum(l[1])};
  E* out_rows = out + (static_cast<std::int64_t>(b) * T + q0) * C + h * HD;
  store_rows<E, HD>(out_rows, C, o, r0, rows_q, 1.0f / sum[0], 1.0f / sum[1]);
  if (t == 0) {
#pragma unroll
    for (int row = 0; row < 2; ++row)
      if (qi[row] < T) lse[(static_cast<std::int64_t>(b) * H + h) * T + qi[row]] = m[row] + logf(sum[row]);
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

// dQ of one query tile of one (batch, query head): sums over the key tiles at or before it.
template <class E, int HD>
struct BackwardQSmem {
  static constexpr int ld = HD + kPad, ldt = kKeys + kPad;
  static constexpr std::size_t bytes = 2 * carved(kRows * ld * sizeof(E)) + 2 * carved(kKeys * ld * sizeof(E)) +
                                       carved(HD * ldt * sizeof(E));
};

template <class E, int HD>
__global__ void __launch_bounds__(kFlashThreads) flash_backward_q_kernel(const E* dout, const E* qkv, const float* lse,
                                                                        const float* delta, E* dqkv, Heads heads,
                                                                        float scale, bool vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = BackwardQSmem<E, HD>;
  const int T = heads.T, H = heads.H, KVH = heads.KVH;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kRows;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH);
  const std::int64_t W = heads.width(HD), C = static_cast<std::int64_t>(H) * HD;
  const std::int64_t row0 = static_cast<std::int64_t>(b) * T;

  Carve carve{smem};
  E* qs = carve.take<E>(kRows * S::ld);
  E* dos = carve.take<E>(kRows * S::ld);
  E* ks = carve.take<E>(kKeys * S::ld);
  E* vs = carve.take<E>(kKeys * S::ld);
  E* kt = carve.take<E>(HD * S::ldt);  // K transposed: [dim][key]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = warp * 16;
  const int rows_q = min(kRows, T - q0);
  load_rows<E, HD, kRows>(qs, S::ld, qkv + (row0 + q0) * W + h * HD, W, rows_q, vec);
  load_rows<E, HD, kRows>(dos, S::ld, dout + (row0 + q0) * C + h * HD, C, rows_q, vec);
  const int qi[2] = {q0 + r0 + g, q0 + r0 + g + 8};
  float lse_r[2], delta_r[2];
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    const std::int64_t at = (static_cast<std::int64_t>(b) * H + h) * T + qi[row];
    lse_r[row] = qi[row] < T ? lse[at] : 0.0f;
    delta_r[row] = qi[row] < T ? delta[at] : 0.0f;
  }
  float dq[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
  const E* k = qkv + row0 * W + C + kvh * HD;
  const E* v = qkv + row0 * W + C + KVH * HD + kvh * HD;
  const int q_last = q0 + rows_q - 1;
  for (int k0 = 0; k0 <= q_last; k0 += kKeys) {
    __syncthreads();  // every warp is done with the previous K and V tiles
    const int rows_k = min(kKeys, T - k0);
    load_rows<E, HD, kKeys>(ks, S::ld, k + k0 * W, W, rows_k, vec);
    load_rows<E, HD, kKeys>(vs, S::ld, v + k0 * W, W, rows_k, vec);
    __syncthreads();
    transpose<E, HD, kKeys>(kt, S::ldt, ks, S::ld);
    float s[kKeys / 8][4], dp[kKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j)
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
    rows_times_rows<E, HD, kKeys / 8>(s, qs, r0, ks, S::ld);    // S = Q K^T
    rows_times_rows<E, HD, kKeys / 8>(dp, dos, r0, vs, S::ld);  // dP = dO V^T
    // dS = P (dP - delta) scale, P = exp(S scale - lse), masked causally.
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kj = k0 + j * 8 + 2 * t + (e & 1), row = e >> 1;
        const bool live = qi[row] < T && kj <= qi[row];
        const float p = live ? __expf(s[j][e] * scale - lse_r[row]) : 0.0f;
        s[j][e] = live ? p * (dp[j][e] - delta_r[row]) * scale : 0.0f;
      }
    __syncthreads();  // K's transpose is complete
    registers_times_columns<E, HD, kKeys / 8>(dq, s, kt, S::ldt);  // dQ += dS K
  }
  store_rows<E, HD>(dqkv + (row0 + q0) * W + h * HD, W, dq, r0, rows_q, 1.0f, 1.0f);
}

// dK and dV of one key tile of one (batch, key/value head): sums over the group's query heads in
// order, and over the query tiles at or after it (deterministic: no atomics). The warp's 16 key
// rows hold S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T feed dV += P^T dO and dK += dS^T Q
// from registers.
template <class E, int HD>
struct BackwardKvSmem {
  static constexpr int ld = HD + kPad, ldt = kQueries + kPad;
  static constexpr std::size_t bytes = 2 * carved(kRows * ld * sizeof(E)) + 2 * carved(kQueries * ld * sizeof(E)) +
                                       2 * carved(HD * ldt * sizeof(E)) + 2 * carved(kQueries * sizeof(float));
};

template <class E, int HD>
__global__ void __launch_bounds__(kFlashThreads) flash_backward_kv_kernel(const E* dout, const E* qkv, const float* lse,
                                                                         const float* delta, E* dqkv, Heads heads,
                                                                         float scale, bool vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = BackwardKvSmem<E, HD>;
  const int T = heads.T, H = heads.H, KVH = heads.KVH, group = H / KVH;
  const int k0 = blockIdx.x * kRows, kvh = blockIdx.y, b = blockIdx.z;
  const std::int64_t W = heads.width(HD), C = static_cast<std::int64_t>(H) * HD;
  const std::int64_t row0 = static_cast<std::int64_t>(b) * T;

  Carve carve{smem};
  E* ks = carve.take<E>(kRows * S::ld);
  E* vs = carve.take<E>(kRows * S::ld);
  E* qs = carve.take<E>(kQueries * S::ld);
  E* dos = carve.take<E>(kQueries * S::ld);
  E* qt = carve.take<E>(HD * S::ldt);   // Q transposed: [dim][query]
  E* dot = carve.take<E>(HD * S::ldt);  // dO transposed
  float* lse_s = carve.take<float>(kQueries);
  float* delta_s = carve.take<float>(kQueries);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = warp * 16;
  const int rows_k = min(kRows, T - k0);
  load_rows<E, HD, kRows>(ks, S::ld, qkv + (row0 + k0) * W + C + kvh * HD, W, rows_k, vec);
  load_rows<E, HD, kRows>(vs, S::ld, qkv + (row0 + k0) * W + C + KVH * HD + kvh * HD, W, rows_k, vec);
  const int kj[2] = {k0 + r0 + g, k0 + r0 + g + 8};
  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n)
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;

  for (int r = 0; r < group; ++r) {
    const int h = kvh * group + r;
    const float* lse_h = lse + (static_cast<std::int64_t>(b) * H + h) * T;
    const float* delta_h = delta + (static_cast<std::int64_t>(b) * H + h) * T;
    for (int q0 = k0; q0 < T; q0 += kQueries) {
      __syncthreads();  // every warp is done with the previous query tile
      const int rows_q = min(kQueries, T - q0);
      load_rows<E, HD, kQueries>(qs, S::ld, qkv + (row0 + q0) * W + h * HD, W, rows_q, vec);
      load_rows<E, HD, kQueries>(dos, S::ld, dout + (row0 + q0) * C + h * HD, C, rows_q, vec);
      if (threadIdx.x < kQueries) {
        const bool valid = static_cast<int>(threadIdx.x) < rows_q;
        lse_s[threadIdx.x] = valid ? lse_h[q0 + threadIdx.x] : 0.0f;
        delta_s[threadIdx.x] = valid ? delta_h[q0 + threadIdx.x] : 0.0f;
      }
      __syncthreads();
      transpose<E, HD, kQueries>(qt, S::ldt, qs, S::ld);
      transpose<E, HD, kQueries>(dot, S::ldt, dos, S::ld);
      float st[kQueries / 8][4], dpt[kQueries / 8][4];
#pragma unroll
      for (int j = 0; j < kQueries / 8; ++j)
        st[j][0] = st[j][1] = st[j][2] = st[j][3] = dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.0f;
      rows_times_rows<E, HD, kQueries / 8>(st, ks, r0, qs, S::ld);    // S^T = K Q^T
      rows_times_rows<E, HD, kQueries / 8>(dpt, vs, r0, dos, S::ld);  // dP^T = V dO^T
#pragma unroll
      for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = j * 8 + 2 * t + (e & 1), qi = q0 + c, row = e >> 1;
          const bool live = qi < T && kj[row] <= qi;
          const float p = live ? __expf(st[j][e] * scale - lse_s[c]) : 0.0f;
          st[j][e] = p;
          dpt[j][e] = live ? p * (dpt[j][e] - delta_s[c]) * scale : 0.0f;
        }
      __syncthreads();  // the transposes are complete
      registers_times_columns<E, HD, kQueries / 8>(dv, st, dot, S::ldt);  // dV += P^T dO
      registers_times_columns<E, HD, kQueries / 8>(dk, dpt, qt, S::ldt);  // dK += dS^T Q
    }
  }
  store_rows<E, HD>(dqkv + (row0 + k0) * W + C + kvh * HD, W, dk, r0, rows_k, 1.0f, 1.0f);
  store_rows<E, HD>(dqkv + (row0 + k0) * W + C + KVH * HD + kvh * HD, W, dv, r0, rows_k, 1.0f, 1.0f);
}

// ---- launch ----

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
  const dim3 grid((heads.T + kRows - 1) / kRows, heads.H, static_cast<unsigned>(B));
  const bool vec = aligned16(qkv);
  return launch(flash_forward_kernel<E, HD>, grid, ForwardSmem<E, HD>::bytes, stream, static_cast<const E*>(qkv),
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
  const unsigned tiles = static_cast<unsigned>((heads.T + kRows - 1) / kRows);
  if (const cudaError_t e = launch(flash_backward_kv_kernel<E, HD>, dim3(tiles, heads.KVH, static_cast<unsigned>(B)),
                                   BackwardKvSmem<E, HD>::bytes, stream, static_cast<const E*>(dout),
                                   static_cast<const E*>(qkv), lse, static_cast<const float*>(delta),
                                   static_cast<E*>(dqkv), heads, scale, vec);
      e != cudaSuccess) {
    return e;
  }
  return launch(flash_backward_q_kernel<E, HD>, dim3(tiles, heads.H, static_cast<unsigned>(B)),
                BackwardQSmem<E, HD>::bytes, stream, static_cast<const E*>(dout), static_cast<const E*>(qkv), lse,
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
