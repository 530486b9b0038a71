// What the CUDA kernel files of this folder share: element access (f32, f16 and bf16 storage read
// as f32 and rounded once, to nearest even, on store), launch shapes and block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace coshard::modules::cuda {

__device__ __forceinline__ float load(const float* p, std::int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __half* p, std::int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const __nv_bfloat16* p, std::int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, std::int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__half* p, std::int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, std::int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
// v as the storage type E holds it, read back as f32.
template <class E>
__device__ __forceinline__ float rounded(float v);
template <>
__device__ __forceinline__ float rounded<float>(float v) { return v; }
template <>
__device__ __forceinline__ float rounded<__half>(float v) { return __half2float(__float2half_rn(v)); }
template <>
__device__ __forceinline__ float rounded<__nv_bfloat16>(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// dtype codes as collectives::DataType; kThreads: the elementwise kernels' block size.
inline constexpr int kF32 = 0, kF16 = 2, kBF16 = 3;
inline constexpr int kThreads = 256;

__device__ __forceinline__ float load_any(int dt, const void* p, std::int64_t i) {
  switch (dt) {
    case kF16: return load(static_cast<const __half*>(p), i);
    case kBF16: return load(static_cast<const __nv_bfloat16*>(p), i);
    default: return load(static_cast<const float*>(p), i);
  }
}
__device__ __forceinline__ void store_any(int dt, void* p, std::int64_t i, float v) {
  switch (dt) {
    case kF16: store(static_cast<__half*>(p), i, v); break;
    case kBF16: store(static_cast<__nv_bfloat16*>(p), i, v); break;
    default: store(static_cast<float*>(p), i, v); break;
  }
}

inline unsigned grid_for(std::int64_t n, int threads = kThreads) {
  const std::int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Runs `launch.template operator()<T>()` with T the storage type of dt; the launch's error.
template <class Launch>
int with_type(int dt, Launch&& launch) {
  switch (dt) {
    case kF32: launch.template operator()<float>(); break;
    case kF16: launch.template operator()<__half>(); break;
    case kBF16: launch.template operator()<__nv_bfloat16>(); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

// Block-wide sum / max over kThreads threads (result valid in every thread).
__device__ inline float block_sum(float v) {
  __shared__ float shared[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0;
  const int warps = (blockDim.x + 31) / 32;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}
__device__ inline float block_max(float v) {
  __shared__ float shared[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float m = -INFINITY;
  const int warps = (blockDim.x + 31) / 32;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, shared[w]);
  return m;
}

#define COSHARD_GRID_STRIDE(i, n) \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x)

}  // namespace coshard::modules::cuda
