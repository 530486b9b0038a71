// CUDA kernels of the materialized attention's causal softmax (Kernels::causal_softmax and
// _backward), between cuBLAS's products (cuda_kernels.cpp) where neither cuDNN's nor attention.cu's
// fused attention serves: one block per row of a [T, T] score matrix, in place. f32, bf16 and f16
// storage; all arithmetic in f32, each row's max and sums reduced over its block in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

template <class T>
__global__ void causal_softmax_kernel(T* scores, std::int64_t T_, float scale) {
  const std::int64_t row = blockIdx.x;  // over matrices * T
  const std::int64_t i = row % T_;
  T* r = scores + row * T_;
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, load(r, j) * scale);
  mx = block_max(mx);
  float sum = 0;
  for (std::int64_t j = threadIdx.x; j <= i; j += blockDim.x) sum += __expf(load(r, j) * scale - mx);
  const float inv = 1.0f / block_sum(sum);
  for (std::int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    store(r, j, j <= i ? __expf(load(r, j) * scale - mx) * inv : 0.0f);
}

template <class T>
__global__ void causal_softmax_backward_kernel(const T* probs, T* dprobs, std::int64_t T_) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t i = row % T_;
  const T* p = probs + row * T_;
  T* d = dprobs + row * T_;
  float dot = 0;
  for (std::int64_t j = threadIdx.x; j <= i; j += blockDim.x) dot += load(p, j) * load(d, j);
  dot = block_sum(dot);
  for (std::int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    store(d, j, j <= i ? load(p, j) * (load(d, j) - dot) : 0.0f);
}

}  // namespace

int causal_softmax(void* s, int dt, void* scores, std::int64_t matrices, std::int64_t T, float scale) {
  return with_type(dt, [&]<class E>() {
    causal_softmax_kernel<E><<<static_cast<unsigned>(matrices * T), kThreads, 0, as_stream(s)>>>(
        static_cast<E*>(scores), T, scale);
  });
}

int causal_softmax_backward(void* s, int dt, const void* probs, void* dprobs, std::int64_t matrices,
                            std::int64_t T) {
  return with_type(dt, [&]<class E>() {
    causal_softmax_backward_kernel<E><<<static_cast<unsigned>(matrices * T), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(probs), static_cast<E*>(dprobs), T);
  });
}

}  // namespace coshard::modules::cuda
