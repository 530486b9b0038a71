// CUDA kernels of mixture-of-experts routing (kernels.hpp: moe_route, moe_route_backward,
// moe_dispatch_plan, and the dispatch and combine of the rows): a thread a token for the router (its experts' softmax, top k and
// renormalisation in the CPU's order, cpu/moe_routing.hpp: the emulation gives its bits; a GPU's
// expf may differ in the last place), and a thread an expert for the dispatch plan's stable order
// (a pass over the slots each: no atomics, no order to depend on).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

template <class T>
__global__ void moe_route_kernel(const T* logits, std::int64_t tokens, std::int64_t experts, std::int64_t k,
                                 bool renormalize, float* probs, std::int32_t* chosen, float* weights) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < tokens;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const T* x = logits + t * experts;
    float* p = probs + t * experts;
    std::int32_t* c = chosen + t * k;
    float* w = weights + t * k;
    float top = load(x, 0);
    for (std::int64_t e = 1; e < experts; ++e) top = fmaxf(top, load(x, e));
    float sum = 0;
    for (std::int64_t e = 0; e < experts; ++e) {
      p[e] = expf(load(x, e) - top);
      sum += p[e];
    }
    for (std::int64_t e = 0; e < experts; ++e) p[e] = p[e] / sum;
    float picked = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      std::int64_t best = -1;
      for (std::int64_t e = 0; e < experts; ++e) {
        bool taken = false;
        for (std::int64_t i = 0; i < j; ++i) taken = taken || c[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      c[j] = static_cast<std::int32_t>(best);
      w[j] = p[best];
      picked += p[best];
    }
    if (renormalize)
      for (std::int64_t j = 0; j < k; ++j) w[j] = w[j] / picked;
  }
}

template <class T>
__global__ void moe_route_backward_kernel(const float* probs, const std::int32_t* chosen, const float* weights,
                                          const float* dweights, const float* dprob_extra, std::int64_t tokens,
                                          std::int64_t experts, std::int64_t k, bool renormalize, T* dlogits) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < tokens;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float* p = probs + t * experts;
    const std::int32_t* c = chosen + t * k;
    float picked = 0, dot = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      picked += p[c[j]];
      dot += dweights[t * k + j] * weights[t * k + j];
    }
    // g(e): the loss's gradient on probability e (the chosen ones' through the renormalisation)
    auto g = [&](std::int64_t e) {
      float v = dprob_extra ? dprob_extra[e] : 0.0f;
      for (std::int64_t j = 0; j < k; ++j)
        if (c[j] == e) v += renormalize ? (dweights[t * k + j] - dot) / picked : dweights[t * k + j];
      return v;
    };
    float inner = 0;
    for (std::int64_t e = 0; e < experts; ++e) inner += p[e] * g(e);
    for (std::int64_t e = 0; e < experts; ++e) store(dlogits, t * experts + e, p[e] * (g(e) - inner));
  }
}

// A thread an expert: its slots' place (the slots of lower experts before it) and its slots in
// order, in one pass over the slots each.
__global__ void moe_place_kernel(const std::int32_t* chosen, std::int64_t slots, std::int64_t experts,
                                 std::int32_t* counts, std::int32_t* order, std::int32_t* inverse) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < experts;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::int64_t at = 0, own = 0;
    for (std::int64_t s = 0; s < slots; ++s) {
      at += chosen[s] < e ? 1 : 0;
      own += chosen[s] == e ? 1 : 0;
    }
    counts[e] = static_cast<std::int32_t>(own);
    for (std::int64_t s = 0; s < slots; ++s)
      if (chosen[s] == e) {
        order[at] = static_cast<std::int32_t>(s);
        inverse[s] = static_cast<std::int32_t>(at);
        ++at;
      }
  }
}

// A thread an element of the rows (dispatch: a token's row once for each of its experts).
template <class T>
__global__ void moe_gather_rows_kernel(const T* x, const std::int32_t* order, std::int64_t rows, std::int64_t k,
                                       std::int64_t width, T* out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows * width;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / width, c = i % width;
    out[i] = x[(order[r] / k) * width + c];
  }
}

// A thread an element of the tokens' rows: its k places in ascending place (its experts' order),
// each weight as T holds it (or 1), summed in f32, rounded once (the CPU's order: its bits).
template <class T>
__global__ void moe_combine_rows_kernel(const T* rows, const std::int32_t* inverse, const float* weights,
                                        std::int64_t tokens, std::int64_t k, std::int64_t width, T* out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < tokens * width;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / width, c = i % width;
    float sum = 0;
    std::int64_t last = -1;
    for (std::int64_t n = 0; n < k; ++n) {  // (the next place above `last`: k is small)
      std::int64_t j = -1;
      for (std::int64_t l = 0; l < k; ++l)
        if (inverse[t * k + l] > last && (j < 0 || inverse[t * k + l] < inverse[t * k + j])) j = l;
      last = inverse[t * k + j];
      const float w = weights ? rounded<T>(weights[t * k + j]) : 1.0f;
      sum += w * load(rows, last * width + c);
    }
    store(out, i, sum);
  }
}

// A thread a (token, expert) slot: its rows' gradient and its weight's, the dot in c order.
template <class T>
__global__ void moe_combine_backward_kernel(const T* dy, const T* rows, const std::int32_t* inverse,
                                            const float* weights, std::int64_t tokens, std::int64_t k,
                                            std::int64_t width, T* d_rows, float* dweights) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < tokens * k;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / k, place = inverse[i];
    const float w = rounded<T>(weights[i]);
    float dot = 0;
    for (std::int64_t c = 0; c < width; ++c) {
      const float g = load(dy, t * width + c);
      dot += g * load(rows, place * width + c);
      store(d_rows, place * width + c, w * g);
    }
    dweights[i] = dot;
  }
}

}  // namespace

int moe_route(void* s, int dt, const void* logits, std::int64_t tokens, std::int64_t experts, std::int64_t k,
              bool renormalize, float* probs, std::int32_t* chosen, float* weights) {
  if (tokens == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    moe_route_kernel<E><<<grid_for(tokens), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(logits), tokens, experts,
                                                                         k, renormalize, probs, chosen, weights);
  });
}

int moe_route_backward(void* s, const float* probs, const std::int32_t* chosen, const float* weights,
                       const float* dweights, const float* dprob_extra, std::int64_t tokens, std::int64_t experts,
                       std::int64_t k, bool renormalize, int dt, void* dlogits) {
  if (tokens == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    moe_route_backward_kernel<E><<<grid_for(tokens), kThreads, 0, as_stream(s)>>>(
        probs, chosen, weights, dweights, dprob_extra, tokens, experts, k, renormalize, static_cast<E*>(dlogits));
  });
}

int moe_dispatch_plan(void* s, const std::int32_t* chosen, std::int64_t slots, std::int64_t experts,
                      std::int32_t* counts, std::int32_t* order, std::int32_t* inverse) {
  if (experts == 0) return static_cast<int>(cudaSuccess);
  moe_place_kernel<<<grid_for(experts), kThreads, 0, as_stream(s)>>>(chosen, slots, experts, counts, order, inverse);
  return static_cast<int>(cudaGetLastError());
}

int moe_gather_rows(void* s, int dt, const void* x, const std::int32_t* order, std::int64_t rows, std::int64_t k,
                    std::int64_t width, void* out) {
  if (rows * width == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    moe_gather_rows_kernel<E><<<grid_for(rows * width), kThreads, 0, as_stream(s)>>>(static_cast<const E*>(x), order,
                                                                                     rows, k, width, static_cast<E*>(out));
  });
}

int moe_combine_rows(void* s, int dt, const void* rows, const std::int32_t* inverse, const float* weights,
                     std::int64_t tokens, std::int64_t k, std::int64_t width, void* out) {
  if (tokens * width == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    moe_combine_rows_kernel<E><<<grid_for(tokens * width), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(rows), inverse, weights, tokens, k, width, static_cast<E*>(out));
  });
}

int moe_combine_backward(void* s, int dt, const void* dy, const void* rows, const std::int32_t* inverse,
                         const float* weights, std::int64_t tokens, std::int64_t k, std::int64_t width, void* d_rows,
                         float* dweights) {
  if (tokens * k == 0) return static_cast<int>(cudaSuccess);
  return with_type(dt, [&]<class E>() {
    moe_combine_backward_kernel<E><<<grid_for(tokens * k), kThreads, 0, as_stream(s)>>>(
        static_cast<const E*>(dy), static_cast<const E*>(rows), inverse, weights, tokens, k, width,
        static_cast<E*>(d_rows), dweights);
  });
}

}  // namespace coshard::modules::cuda
