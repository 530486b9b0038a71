// CUDA kernels of block int8 and int4 quantization (kernel_args.hpp: the formats and their
// segments; ZeRO++'s quantized weight gathers and gradient reduction): one thread block per
// quantization block, which finds its segment by a binary search of the segments' first blocks,
// its max|x| by a block reduction, and writes its values (quantize) or reads them back (dequantize). f32 arithmetic as the CPU's (cpu/quantize.hpp):
// a division rounded as IEEE says (nvcc's default), rintf's nearest even, so both give the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

using detail::QuantSegment;
constexpr float kFloatMax = 3.402823466e38f;

// The segment holding global block b: the last whose first_block is at most b.
__device__ __forceinline__ std::int64_t segment_of(const QuantSegment* segments, std::int64_t count, std::int64_t b) {
  std::int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    if (segments[mid].first_block <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The formats (kernel_args.hpp): int8 a value a byte; int4 two a byte, the first in the low nibble.
template <int Bits>
__device__ __forceinline__ std::int64_t values_bytes(std::int64_t n) { return Bits == 8 ? n : (n + 1) / 2; }
template <int Bits>
__device__ __forceinline__ std::int64_t scales_offset(std::int64_t n) { return (values_bytes<Bits>(n) + 15) / 16 * 16; }
template <int Bits>
__device__ __forceinline__ std::int64_t packed_bytes(std::int64_t n, std::int64_t block) {
  return scales_offset<Bits>(n) + (((n + block - 1) / block) * 4 + 15) / 16 * 16;
}
template <int Bits>
__device__ __forceinline__ int packed_value(const std::int8_t* q, std::int64_t i) {
  if constexpr (Bits == 8) {
    return q[i];
  } else {  // (the nibble's sign extended: shifted to the top of a signed byte and back)
    const unsigned byte = static_cast<std::uint8_t>(q[i / 2]);
    return static_cast<std::int8_t>(static_cast<std::uint8_t>(i % 2 == 0 ? byte << 4 : byte & 0xF0u)) >> 4;
  }
}

template <int Bits>
__device__ __forceinline__ float quantized(float v, float scale) {
  constexpr float qmax = Bits == 8 ? 127.0f : 7.0f;
  return scale > 0 ? fminf(fmaxf(rintf(v / scale), -qmax), qmax) : 0.0f;
}

template <int Bits, class T>
__global__ void quantize_kernel(const T* x, std::int8_t* packed, const QuantSegment* segments, std::int64_t count,
                                std::int64_t blocks, std::int64_t block) {
  constexpr float qmax = Bits == 8 ? 127.0f : 7.0f;
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const QuantSegment g = segments[segment_of(segments, count, b)];
    const std::int64_t j = b - g.first_block, n = g.count;
    std::int8_t* q = packed + g.packed;
    float* scales = reinterpret_cast<float*>(q + scales_offset<Bits>(n));
    if (j == 0) {  // the segment's padding travels with it: zeroed, so the bytes sent follow the input alone
      for (std::int64_t i = values_bytes<Bits>(n) + threadIdx.x; i < scales_offset<Bits>(n); i += blockDim.x) q[i] = 0;
      const std::int64_t own = (n + block - 1) / block, slots = (packed_bytes<Bits>(n, block) - scales_offset<Bits>(n)) / 4;
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
    const float scale = bad > 0 ? __int_as_float(0x7fc00000) : amax / qmax;
    if (threadIdx.x == 0) scales[j] = scale;
    if constexpr (Bits == 8) {
      for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
        q[i] = static_cast<std::int8_t>(quantized<8>(load(v, i), scale));
    } else {  // a byte a thread: its two values (an even block starts each block on a byte of its own)
      for (std::int64_t i = begin + 2 * threadIdx.x; i < end; i += 2 * blockDim.x) {
        const auto lo = static_cast<int>(quantized<4>(load(v, i), scale));
        const auto hi = i + 1 < end ? static_cast<int>(quantized<4>(load(v, i + 1), scale)) : 0;
        q[i / 2] = static_cast<std::int8_t>(static_cast<std::uint8_t>((lo & 0xF) | ((hi & 0xF) << 4)));
      }
    }
  }
}

template <int Bits, class T>
__global__ void dequantize_kernel(const std::int8_t* packed, T* out, const QuantSegment* segments,
                                  std::int64_t count, std::int64_t blocks, std::int64_t block) {
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const QuantSegment g = segments[segment_of(segments, count, b)];
    const std::int64_t j = b - g.first_block, n = g.count;
    const std::int8_t* q = packed + g.packed;
    const float scale = reinterpret_cast<const float*>(q + scales_offset<Bits>(n))[j];
    const std::int64_t begin = j * block, end = begin + block < n ? begin + block : n;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      store(out, g.value + i, static_cast<float>(packed_value<Bits>(q, i)) * scale);
  }
}

template <int Bits, class T>
__global__ void dequantize_sum_kernel(const std::int8_t* packed, std::int64_t pieces, std::int64_t stride, T* out,
                                      const QuantSegment* segments, std::int64_t count, std::int64_t blocks,
                                      std::int64_t block, float factor) {
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const QuantSegment g = segments[segment_of(segments, count, b)];
    const std::int64_t j = b - g.first_block, n = g.count;
    const std::int64_t begin = j * block, end = begin + block < n ? begin + block : n;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float sum = 0;
      for (std::int64_t p = 0; p < pieces; ++p) {
        const std::int8_t* q = packed + p * stride + g.packed;
        sum += static_cast<float>(packed_value<Bits>(q, i)) * reinterpret_cast<const float*>(q + scales_offset<Bits>(n))[j];
      }
      store(out, g.value + i, sum * factor);
    }
  }
}

unsigned grid_for_blocks(std::int64_t blocks) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

}  // namespace

// `launch` with the format's bits as a template argument (8 or 4: the caller checked them).
template <class Launch>
void with_bits(int bits, Launch&& launch) {
  if (bits == 8) launch.template operator()<8>();
  else launch.template operator()<4>();
}

int quantize_blocks(void* s, int bits, int dt, const void* x, void* packed, const detail::QuantSegment* segments,
                    std::int64_t count, std::int64_t blocks, std::int64_t block) {
  if (count == 0 || blocks == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    with_bits(bits, [&]<int Bits>() {
      quantize_kernel<Bits, E><<<grid_for_blocks(blocks), kThreads, 0, as_stream(s)>>>(
          static_cast<const E*>(x), static_cast<std::int8_t*>(packed), segments, count, blocks, block);
    });
  });
}

int dequantize_blocks(void* s, int bits, const void* packed, int dt, void* out, const detail::QuantSegment* segments,
                      std::int64_t count, std::int64_t blocks, std::int64_t block) {
  if (count == 0 || blocks == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    with_bits(bits, [&]<int Bits>() {
      dequantize_kernel<Bits, E><<<grid_for_blocks(blocks), kThreads, 0, as_stream(s)>>>(
          static_cast<const std::int8_t*>(packed), static_cast<E*>(out), segments, count, blocks, block);
    });
  });
}

int dequantize_sum_blocks(void* s, int bits, const void* packed, std::int64_t pieces, std::int64_t stride, int dt,
                          void* out, const detail::QuantSegment* segments, std::int64_t count, std::int64_t blocks,
                          std::int64_t block, float factor) {
  if (count == 0 || blocks == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    with_bits(bits, [&]<int Bits>() {
      dequantize_sum_kernel<Bits, E><<<grid_for_blocks(blocks), kThreads, 0, as_stream(s)>>>(
          static_cast<const std::int8_t*>(packed), pieces, stride, static_cast<E*>(out), segments, count, blocks, block,
          factor);
    });
  });
}

}  // namespace coshard::modules::cuda
