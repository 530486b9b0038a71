// CUDA kernels of the embeddings (Kernels::embedding_forward and _backward): token rows of a
// table, which may hold only this rank's rows of a vocabulary-parallel one, plus learned
// positions. f32, bf16 and f16 storage; all arithmetic in f32. The position gradient adds over
// the batch in a fixed order, so it is deterministic; the token gradient uses atomics (a token
// may repeat) and is not bit-reproducible run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

template <class T>
__global__ void embedding_forward_kernel(const std::int32_t* tokens, const T* wte, const T* wpe, T* out,
                                         std::int64_t BT, std::int64_t T_, std::int64_t C, std::int64_t vocab,
                                         std::int64_t first, std::int64_t rows) {
  COSHARD_GRID_STRIDE(i, BT * C) {
    const std::int64_t row = i / C, c = i % C;
    const std::int32_t tok = tokens[row];
    const std::int64_t at = tok - first;  // this table's row (another rank's: zeros)
    const float e = !(tok >= 0 && tok < vocab) ? NAN : (at >= 0 && at < rows) ? load(wte, at * C + c) : 0.0f;
    store(out, i, wpe ? e + load(wpe, (row % T_) * C + c) : e);
  }
}

template <class T>
__global__ void embedding_token_grad_kernel(const std::int32_t* tokens, const T* dout, T* dwte, std::int64_t BT,
                                            std::int64_t C, std::int64_t first, std::int64_t rows) {
  COSHARD_GRID_STRIDE(i, BT * C) {
    const std::int64_t row = i / C, c = i % C;
    const std::int64_t at = tokens[row] - first;
    if (at >= 0 && at < rows) atomicAdd(dwte + at * C + c, dout[i]);
  }
}

// One thread per (position, column), summing over the batch in order.
template <class T>
__global__ void embedding_position_grad_kernel(const T* dout, T* dwpe, std::int64_t B, std::int64_t T_,
                                               std::int64_t C) {
  COSHARD_GRID_STRIDE(i, T_ * C) {
    float sum = 0;
    for (std::int64_t b = 0; b < B; ++b) sum += load(dout, b * T_ * C + i);
    store(dwpe, i, load(dwpe, i) + sum);
  }
}

}  // namespace

int embedding_forward(void* s, int dt, const std::int32_t* tokens, const void* wte, const void* wpe, void* out,
                      std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t vocab, std::int64_t first,
                      std::int64_t rows) {
  return with_type(dt, [&]<class E>() {
    embedding_forward_kernel<E><<<grid_for(B * T * C), kThreads, 0, as_stream(s)>>>(
        tokens, static_cast<const E*>(wte), static_cast<const E*>(wpe), static_cast<E*>(out), B * T, T, C, vocab,
        first, rows);
  });
}

int embedding_backward(void* s, int dt, const std::int32_t* tokens, const void* dout, void* dwte, void* dwpe,
                       std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t first, std::int64_t rows) {
  return with_type(dt, [&]<class E>() {
    embedding_token_grad_kernel<E><<<grid_for(B * T * C), kThreads, 0, as_stream(s)>>>(
        tokens, static_cast<const E*>(dout), static_cast<E*>(dwte), B * T, C, first, rows);
    if (dwpe)
      embedding_position_grad_kernel<E><<<grid_for(T * C), kThreads, 0, as_stream(s)>>>(
          static_cast<const E*>(dout), static_cast<E*>(dwpe), B, T, C);
  });
}

}  // namespace coshard::modules::cuda
