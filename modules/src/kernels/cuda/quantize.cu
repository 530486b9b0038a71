// CUDA kernels of block int8 quantization (kernel_args.hpp: the format; ZeRO++'s quantized weight
// gathers): one thread block per quantization block finds its max|x| and writes its values; the
// dequantization is element by element. f32 arithmetic as the CPU's (cpu/quantize.hpp): a
// division rounded as IEEE says (nvcc's default), rintf's nearest even, so both give the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

constexpr float kFloatMax = 3.402823466e38f;

template <class T>
__global__ void quantize_int8_kernel(const T* x, std::int8_t* q, float* scales, std::int64_t n, std::int64_t block,
                                     std::int64_t blocks, std::int64_t q_pad_end, std::int64_t scales_pad_end) {
  // The padding travels with the piece: zeroed, so the bytes sent are a function of the input.
  if (blockIdx.x == 0) {
    for (std::int64_t i = n + threadIdx.x; i < q_pad_end; i += blockDim.x) q[i] = 0;
    for (std::int64_t i = blocks + threadIdx.x; i < scales_pad_end; i += blockDim.x) scales[i] = 0;
  }
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::int64_t begin = b * block, end = begin + block < n ? begin + block : n;
    float amax = 0, bad = 0;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float a = fabsf(load(x, i));
      if (!(a <= kFloatMax)) bad = 1;  // inf or NaN
      amax = fmaxf(amax, a);
    }
    amax = block_max(amax);
    bad = block_max(bad);
    const float scale = bad > 0 ? __int_as_float(0x7fc00000) : amax / 127.0f;
    if (threadIdx.x == 0) scales[b] = scale;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      q[i] = scale > 0 ? static_cast<std::int8_t>(fminf(fmaxf(rintf(load(x, i) / scale), -127.0f), 127.0f)) : 0;
  }
}

template <class T>
__global__ void dequantize_int8_kernel(const std::int8_t* packed, std::int64_t pieces, T* out, std::int64_t n,
                                       std::int64_t block, std::int64_t stride, std::int64_t scales_offset) {
  COSHARD_GRID_STRIDE(i, pieces * n) {
    const std::int64_t p = i / n, j = i - p * n;
    const std::int8_t* base = packed + p * stride;
    const float scale = reinterpret_cast<const float*>(base + scales_offset)[j / block];
    store(out, i, static_cast<float>(base[j]) * scale);
  }
}

}  // namespace

int quantize_int8(void* s, int dt, const void* x, void* packed, std::int64_t n, std::int64_t block) {
  const std::int64_t blocks = detail::int8_block_count(n, block);
  const std::int64_t offset = detail::int8_scales_offset(n);
  const std::int64_t scale_slots = (detail::int8_packed_bytes(n, block) - offset) / 4;
  auto* q = static_cast<std::int8_t*>(packed);
  auto* scales = reinterpret_cast<float*>(q + offset);
  const unsigned grid = static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
  return with_type(dt, [&]<class E>() {
    quantize_int8_kernel<E><<<grid, kThreads, 0, as_stream(s)>>>(static_cast<const E*>(x), q, scales, n, block,
                                                                 blocks, offset, scale_slots);
  });
}

int dequantize_int8(void* s, const void* packed, std::int64_t pieces, int dt, void* out, std::int64_t n,
                    std::int64_t block) {
  if (pieces * n == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    dequantize_int8_kernel<E><<<grid_for(pieces * n), kThreads, 0, as_stream(s)>>>(
        static_cast<const std::int8_t*>(packed), pieces, static_cast<E*>(out), n, block,
        detail::int8_packed_bytes(n, block), detail::int8_scales_offset(n));
  });
}

}  // namespace coshard::modules::cuda
