// What the fused attention's kernels share (attention.cu's forward, attention_backward.cu's
// backward; the method in attention.cu's opening): the tile shapes, shared memory carved in order,
// a tile's rows loaded into shared memory and transposed there, a warp's tensor-core products
// (mma.cuh) and its rows stored back, and the launch with the dynamic shared memory the tiles
// need. Its templates live in an unnamed namespace (as column_sum.cuh's), so each file's kernels
// are its own.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "mma.cuh"

namespace coshard::modules::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kFlashThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // query rows of a forward or dQ block, key rows of a dK/dV block
constexpr int kKeys = 64;           // keys a tile (forward, dQ)
constexpr int kPad = 8;             // elements after each shared row: rows start on different banks

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

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

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
}  // namespace coshard::modules::cuda
