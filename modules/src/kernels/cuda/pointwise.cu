// CUDA kernels of the element-wise operations: the activations (GELU, SwiGLU), rotary position
// embeddings, add, mul and scale, the bias (its add, and its gradient: a column sum, see
// column_sum.cuh) and casts between storage types. f32, bf16 and f16 storage; all arithmetic in
// f32. Each thread's elements are its own, so every result is deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "column_sum.cuh"
#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

// GPT-2's tanh approximation of GELU: sqrt(2 / pi), and the cube's weight.
constexpr float kGeluScale = 0.7978845608028654f;
constexpr float kGeluCube = 0.044715f;

// SwiGLU over rows of gate | up: element k of the output is row k / I, column k % I.
template <class T>
__global__ void swiglu_forward_kernel(const T* gate_up, T* out, std::int64_t N, std::int64_t I) {
  COSHARD_GRID_STRIDE(k, N * I) {
    const std::int64_t row = k / I, j = k % I;
    const float g = load(gate_up, row * 2 * I + j), u = load(gate_up, row * 2 * I + I + j);
    store(out, k, g / (1.0f + __expf(-g)) * u);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* gate_up, const T* dout, T* dgate_up, std::int64_t N, std::int64_t I) {
  COSHARD_GRID_STRIDE(k, N * I) {
    const std::int64_t row = k / I, j = k % I;
    const float g = load(gate_up, row * 2 * I + j), u = load(gate_up, row * 2 * I + I + j), d = load(dout, k);
    const float sg = 1.0f / (1.0f + __expf(-g));
    store(dgate_up, row * 2 * I + j, d * u * sg * (1.0f + g * (1.0f - sg)));
    store(dgate_up, row * 2 * I + I + j, d * g * sg);
  }
}

// RoPE: one thread per (row, head, pair); heads past `rotated` are copied.
template <class T>
__global__ void rope_kernel(const T* x, T* out, const float* inv_freq, std::int64_t B, std::int64_t T_,
                            std::int64_t heads, std::int64_t rotated, std::int64_t hd, bool inverse, std::int64_t first) {
  const std::int64_t half = hd / 2;
  COSHARD_GRID_STRIDE(k, B * T_ * heads * half) {
    const std::int64_t i = k % half, h = (k / half) % heads, row = k / (half * heads), t = row % T_;
    const std::int64_t at = (row * heads + h) * hd + i;
    const float x1 = load(x, at), x2 = load(x, at + half);
    if (h >= rotated) {
      store(out, at, x1);
      store(out, at + half, x2);
    } else {
      float sn = 0, c = 0;
      sincosf(static_cast<float>(first + t) * inv_freq[i], &sn, &c);
      if (inverse) sn = -sn;
      store(out, at, x1 * c - x2 * sn);
      store(out, at + half, x2 * c + x1 * sn);
    }
  }
}

template <class T>
__global__ void gelu_forward_kernel(const T* x, T* out, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) {
    const float v = load(x, i);
    store(out, i, 0.5f * v * (1.0f + tanhf(kGeluScale * (v + kGeluCube * v * v * v))));
  }
}

template <class T>
__global__ void gelu_backward_kernel(const T* x, const T* dout, T* dx, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) {
    const float v = load(x, i);
    const float th = tanhf(kGeluScale * (v + kGeluCube * v * v * v));
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCube * v * v);
    store(dx, i, load(dout, i) * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du));
  }
}

template <class T>
__global__ void add_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) { store(out, i, load(a, i) + load(b, i)); }
}

template <class T>
__global__ void mul_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) { store(out, i, load(a, i) * load(b, i)); }
}

template <class T>
__global__ void scale_kernel(T* x, float factor, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) { store(x, i, load(x, i) * factor); }
}

// Rows over the grid's y, columns over its x: no 64-bit division per element (which made this
// add, over a vocabulary-wide head, cost as much as the head's matrix product).
template <class T>
__global__ void bias_add_kernel(T* out, const T* bias, std::int64_t N, std::int64_t C) {
  for (std::int64_t row = blockIdx.y; row < N; row += gridDim.y)
    for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < C;
         j += static_cast<std::int64_t>(blockDim.x) * gridDim.x)
      store(out, row * C + j, load(out, row * C + j) + load(bias, j));
}

__global__ void cast_kernel(int from, const void* src, int to, void* dst, std::int64_t n) {
  COSHARD_GRID_STRIDE(i, n) { store_any(to, dst, i, load_any(from, src, i)); }
}

}  // namespace

int swiglu_forward(void* s, int dt, const void* gate_up, void* out, std::int64_t N, std::int64_t I) {
  return with_type(dt, [&]<class E>() {
    swiglu_forward_kernel<E><<<grid_for(N * I), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(gate_up),
                                                                            static_cast<E*>(out), N, I);
  });
}

int swiglu_backward(void* s, int dt, const void* gate_up, const void* dout, void* dgate_up, std::int64_t N,
                    std::int64_t I) {
  return with_type(dt, [&]<class E>() {
    swiglu_backward_kernel<E><<<grid_for(N * I), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(gate_up), static_cast<const E*>(dout), static_cast<E*>(dgate_up), N, I);
  });
}

int rope(void* s, int dt, const void* x, void* out, const float* inv_freq, std::int64_t B, std::int64_t T,
         std::int64_t heads, std::int64_t rotated, std::int64_t hd, bool inverse, std::int64_t first) {
  return with_type(dt, [&]<class E>() {
    rope_kernel<E><<<grid_for(B * T * heads * (hd / 2)), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(x), static_cast<E*>(out), inv_freq, B, T, heads, rotated, hd, inverse, first);
  });
}

int gelu_forward(void* s, int dt, const void* x, void* out, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    gelu_forward_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(x),
                                                                        static_cast<E*>(out), n);
  });
}

int gelu_backward(void* s, int dt, const void* x, const void* dout, void* dx, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    gelu_backward_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(x), static_cast<const E*>(dout), static_cast<E*>(dx), n);
  });
}

int add(void* s, int dt, const void* a, const void* b, void* out, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    add_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(a), static_cast<const E*>(b),
                                                              static_cast<E*>(out), n);
  });
}

int mul(void* s, int dt, const void* a, const void* b, void* out, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    mul_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(a), static_cast<const E*>(b),
                                                              static_cast<E*>(out), n);
  });
}

int scale(void* s, int dt, void* x, float factor, std::int64_t n) {
  return with_type(dt, [&]<class E>() {
    scale_kernel<E><<<grid_for(n), kThreads, 0, as_stream(s)>>>(static_cast<E*>(x), factor, n);
  });
}

int bias_add(void* s, int dt, void* out, const void* bias, std::int64_t N, std::int64_t C) {
  return with_type(dt, [&]<class E>() {
    const dim3 grid(grid_for(C), static_cast<unsigned>(N < 1 ? 1 : (N > 65535 ? 65535 : N)));
    bias_add_kernel<E><<<grid, kThreads, 0, as_stream(s)>>>(static_cast<E*>(out), static_cast<const E*>(bias), N, C);
  });
}

int bias_grad(void* s, int dt, const void* dout, void* dbias, std::int64_t N, std::int64_t C) {
  return with_type(dt, [&]<class E>() {
    launch_column_grad<E, E, ColumnGrad::bias>(as_stream(s), static_cast<const E*>(dout), nullptr, nullptr, nullptr,
                                               nullptr, static_cast<E*>(dbias), N, C);
  });
}

int cast(void* s, int from, const void* src, int to, void* dst, std::int64_t n) {
  cast_kernel<<<grid_for(n), kThreads, 0, as_stream(s)>>>(from, src, to, dst, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace coshard::modules::cuda
