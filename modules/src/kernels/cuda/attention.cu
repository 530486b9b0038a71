// Fused causal attention (see attention.cuh), FlashAttention-2's way: a warp owns 16 rows
// of a tile and keeps its products in registers through PTX's mma.m16n8k16 (mma.cuh), whose
// accumulator layout lets the scores, once exponentiated and rounded to the storage type, feed the
// product with V directly; the online softmax works on those registers, its row statistics reduced
// over the four lanes that share a row. Shared memory holds only the K/V (or Q/dO) tiles, padded
// against bank conflicts, and transposed copies of those read down their columns. Probabilities
// are rounded to the storage type before their products (as FlashAttention does); the only f32
// state in device memory is one log-sum-exp per query row (and backward's delta).
//
// This file is the forward; attention_backward.cu the backward, attention_tiles.cuh what they share.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "attention.cuh"
#include "attention_tiles.cuh"
#include "mma.cuh"

namespace coshard::modules::cuda {
namespace {

// Column sums and maxima over the four lanes of a row (lanes 4g .. 4g + 3).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

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

template <class E, int HD>
cudaError_t forward_as(cudaStream_t stream, const void* qkv, void* out, float* lse, std::int64_t B, Heads heads) {
  const dim3 grid((heads.T + kRows - 1) / kRows, heads.H, static_cast<unsigned>(B));
  const bool vec = aligned16(qkv);
  return launch(flash_forward_kernel<E, HD>, grid, ForwardSmem<E, HD>::bytes, stream, static_cast<const E*>(qkv),
                static_cast<E*>(out), lse, heads, 1.0f / sqrtf(static_cast<float>(HD)), vec);
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

}  // namespace coshard::modules::cuda
