// CUDA kernels of block int8 quantization (kernel_args.hpp: the format and its segments; ZeRO++'s
// quantized weight gathers): one thread block per quantization block, which finds its segment by a
// binary search of the segments' first blocks, its max|x| by a block reduction, and writes its
// values (quantize) or reads them back (dequantize). f32 arithmetic as the CPU's (cpu/quantize.hpp):
// a division rounded as IEEE says (nvcc's default), rintf's nearest even, so both give the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

using detail::Int8Segment;
constexpr float kFloatMax = 3.402823466e38f;

// The segment holding global block b: the last whose first_block is at most b.
__device__ __forceinline__ std::int64_t segment_of(const Int8Segment* segments, std::int64_t count, std::int64_t b) {
  std::int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    if (segments[mid].first_block <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ std::int64_t scales_offset(std::int64_t n) { return (n + 15) / 16 * 16; }
__device__ __forceinline__ std::int64_t packed_bytes(std::int64_t n, std::int64_t block) {
  return scales_offset(n) + (((n + block - 1) / block) * 4 + 15) / 16 * 16;
}

template <class T>
__global__ void quantize_int8_kernel(const T* x, std::int8_t* packed, const Int8Segment* segments, std::int64_t count,
                                     std::int64_t blocks, std::int64_t block) {
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const Int8Segment g = segments[segment_of(segments, count, b)];
    const std::int64_t j = b - g.first_block, n = g.count;
    std::int8_t* q = packed + g.packed;
    float* scales = reinterpret_cast<float*>(q + scales_offset(n));
    if (j == 0) {  // the segment's padding travels with it: zeroed, so the bytes sent follow the input alone
      for (std::int64_t i = n + threadIdx.x; i < scales_offset(n); i += blockDim.x) q[i] = 0;
      const std::int64_t own = (n + block - 1) / block, slots = (packed_bytes(n, block) - scales_offset(n)) / 4;
      for (std::int64_t i = own + threadIdx.x; i < slots; i += blockDim.x) scales[i] = 0;
    }
    const T* v = x + g.value;
    const std::int64_t begin = j * block, end = begin + block < n ? begin + block : n;
    float amax = 0, bad = 0;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float a = fabsf(load(v, i));
      if (!(a <= kFloatMax)) bad = 1;  // inf or NaN
      amax = fmaxf(amax, a);
    }
    amax = block_max(amax);
    bad = block_max(bad);
    const float scale = bad > 0 ? __int_as_float(0x7fc00000) : amax / 127.0f;
    if (threadIdx.x == 0) scales[j] = scale;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      q[i] = scale > 0 ? static_cast<std::int8_t>(fminf(fmaxf(rintf(load(v, i) / scale), -127.0f), 127.0f)) : 0;
  }
}

template <class T>
__global__ void dequantize_int8_kernel(const std::int8_t* packed, T* out, const Int8Segment* segments,
                                       std::int64_t count, std::int64_t blocks, std::int64_t block) {
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const Int8Segment g = segments[segment_of(segments, count, b)];
    const std::int64_t j = b - g.first_block, n = g.count;
    const std::int8_t* q = packed + g.packed;
    const float scale = reinterpret_cast<const float*>(q + scales_offset(n))[j];
    const std::int64_t begin = j * block, end = begin + block < n ? begin + block : n;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      store(out, g.value + i, static_cast<float>(q[i]) * scale);
  }
}

template <class T>
__global__ void dequantize_sum_int8_kernel(const std::int8_t* packed, std::int64_t pieces, std::int64_t stride, T* out,
                                           const Int8Segment* segments, std::int64_t count, std::int64_t blocks,
                                           std::int64_t block, float factor) {
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const Int8Segment g = segments[segment_of(segments, count, b)];
    const std::int64_t j = b - g.first_block, n = g.count;
    const std::int64_t begin = j * block, end = begin + block < n ? begin + block : n;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float sum = 0;
      for (std::int64_t p = 0; p < pieces; ++p) {
        const std::int8_t* q = packed + p * stride + g.packed;
        sum += static_cast<float>(q[i]) * reinterpret_cast<const float*>(q + scales_offset(n))[j];
      }
      store(out, g.value + i, sum * factor);
    }
  }
}

unsigned grid_for_blocks(std::int64_t blocks) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

}  // namespace

int quantize_int8(void* s, int dt, const void* x, void* packed, const detail::Int8Segment* segments,
                  std::int64_t count, std::int64_t blocks, std::int64_t block) {
  if (count == 0 || blocks == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    quantize_int8_kernel<E><<<grid_for_blocks(blocks), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(x), static_cast<std::int8_t*>(packed), segments, count, blocks, block);
  });
}

int dequantize_int8(void* s, const void* packed, int dt, void* out, const detail::Int8Segment* segments,
                    std::int64_t count, std::int64_t blocks, std::int64_t block) {
  if (count == 0 || blocks == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    dequantize_int8_kernel<E><<<grid_for_blocks(blocks), kThreads, 0, as_stream(s)>>>(
        static_cast<const std::int8_t*>(packed), static_cast<E*>(out), segments, count, blocks, block);
  });
}

int dequantize_sum_int8(void* s, const void* packed, std::int64_t pieces, std::int64_t stride, int dt, void* out,
                        const detail::Int8Segment* segments, std::int64_t count, std::int64_t blocks,
                        std::int64_t block, float factor) {
  if (count == 0 || blocks == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    dequantize_sum_int8_kernel<E><<<grid_for_blocks(blocks), kThreads, 0, as_stream(s)>>>(
        static_cast<const std::int8_t*>(packed), pieces, stride, static_cast<E*>(out), segments, count, blocks, block,
        factor);
  });
}

}  // namespace coshard::modules::cuda
