// CUDA kernel of decoding with a key/value cache (Kernels::attention_decode); training's fused
// attention is attention.cu's. f32, bf16 and f16 storage; all arithmetic in f32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

// Decoding with a key/value cache (Kernels::attention_decode): one block per (row b, new position
// i, head h); its threads score the keys 0..first+i into scratch, the block reduces the maximum and
// the sum, then each thread sums the values for its columns. Plain, not fast: one query a block.
inline constexpr int kDecodeThreads = 128;

template <class T>
__global__ void attention_decode_kernel(const T* cache, T* out, float* scratch, std::int64_t Tmax, std::int64_t first,
                                        std::int64_t Tn, std::int64_t H, std::int64_t KVH, std::int64_t hd) {
  __shared__ float reduce[kDecodeThreads];
  const std::int64_t h = blockIdx.x % H, i = (blockIdx.x / H) % Tn, b = blockIdx.x / (H * Tn);
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, kv = C + (h / (H / KVH)) * hd, at = first + i;
  const T* rows = cache + b * Tmax * W;
  const T* q = rows + at * W + h * hd;
  float* scores = scratch + static_cast<std::int64_t>(blockIdx.x) * (first + Tn);
  const float scale = rsqrtf(static_cast<float>(hd));
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j <= at; j += blockDim.x) {
    float dot = 0;
    for (std::int64_t d = 0; d < hd; ++d) dot += load(q, d) * load(rows, j * W + kv + d);
    scores[j] = dot * scale;
    mx = fmaxf(mx, scores[j]);
  }
  reduce[threadIdx.x] = mx;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) reduce[threadIdx.x] = fmaxf(reduce[threadIdx.x], reduce[threadIdx.x + stride]);
    __syncthreads();
  }
  mx = reduce[0];
  __syncthreads();
  float sum = 0;
  for (std::int64_t j = threadIdx.x; j <= at; j += blockDim.x) {
    scores[j] = __expf(scores[j] - mx);
    sum += scores[j];
  }
  reduce[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) reduce[threadIdx.x] += reduce[threadIdx.x + stride];
    __syncthreads();
  }
  const float inv = 1.0f / reduce[0];
  T* o = out + (b * Tn + i) * C + h * hd;
  for (std::int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0;
    for (std::int64_t j = 0; j <= at; ++j) acc += scores[j] * load(rows, j * W + kv + KVH * hd + d);
    store(o, d, acc * inv);
  }
}

}  // namespace

int attention_decode(void* s, int dt, const void* cache, void* out, float* scratch, std::int64_t B, std::int64_t Tmax,
                     std::int64_t first, std::int64_t Tn, std::int64_t H, std::int64_t KVH, std::int64_t hd) {
  const auto blocks = static_cast<unsigned>(B * Tn * H);
  return with_type(dt, [&]<class E>() {
    attention_decode_kernel<E><<<blocks, kDecodeThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(cache), static_cast<E*>(out), scratch, Tmax, first, Tn, H, KVH, hd);
  });
}

}  // namespace coshard::modules::cuda
