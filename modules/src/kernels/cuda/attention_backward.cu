// The fused causal attention's backward (attention.cu's opening has the method; attention_tiles.cuh
// what the forward and backward share): delta, the rowsum of dout * out per query row, then one
// kernel gives each key/value tile its dK and dV and another each query tile its dQ, with no
// atomics, so the gradients are deterministic. The probabilities are recomputed tile by tile from
// the forward's log-sum-exp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "attention.cuh"
#include "attention_tiles.cuh"

namespace coshard::modules::cuda {
namespace {

constexpr int kQueries = 32;  // query rows a tile of the dK/dV kernel (its registers' limit)

// The sum over a warp's 32 lanes.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

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

}  // namespace

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
