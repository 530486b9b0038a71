// The optimizer's CUDA kernels: gradient statistics, AdamW and SGD over fp32 master weights, and
// the step control (clipping, overflow skip, dynamic loss scaling) read and written on the device
// only. AdamW and the gradient statistics also come multi-tensor: one launch for a list of
// tensors (up to kMaxTensors tensors and kMaxBlocks chunks of kChunk elements, passed by value
// in the kernel's parameters), with the same arithmetic per element as the one-tensor kernels.
#include <cuda_runtime.h>

#include <cmath>

#include "common.cuh"
#include "kernels.cuh"

namespace coshard::modules::cuda {
namespace {

// ---- optimizer ----

__global__ void step_begin_kernel(detail::StepState* st) {
  st->grad_sumsq = 0;
  st->found_inf = 0;
}

__global__ void grad_stats_kernel(int gdt, const void* grad, std::int64_t n, detail::StepState* st) {
  float s = 0;
  COSHARD_GRID_STRIDE(i, n) {
    const float g = load_any(gdt, grad, i);
    s += g * g;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) {
    if (!isfinite(s)) st->found_inf = 1.0f;
    atomicAdd(&st->grad_sumsq, s);
  }
}

__device__ float grad_factor(const detail::StepState& st, float max_grad_norm) {
  const float inv_scale = 1.0f / st.loss_scale;
  float factor = inv_scale;
  if (max_grad_norm > 0) {
    const float norm = sqrtf(st.grad_sumsq) * inv_scale;
    if (norm > max_grad_norm) factor *= max_grad_norm / (norm + 1e-6f);
  }
  return factor;
}

// AdamW's constants for a step, and its update of one element (shared by the one-tensor and the
// multi-tensor kernels, so both give the same bits).
struct AdamStep {
  float factor, bc1, bc2, decay;
  __device__ AdamStep(const detail::AdamArgs& a, const detail::StepState& st)
      : factor(grad_factor(st, a.max_grad_norm)),
        bc1(1.0f - powf(a.beta1, static_cast<float>(st.step + 1))),
        bc2(1.0f - powf(a.beta2, static_cast<float>(st.step + 1))),
        decay(1.0f - a.lr * a.weight_decay) {}
  __device__ void update(const detail::AdamArgs& a, float* master, int gdt, const void* grad, float* m, float* v,
                         int pdt, void* param_out, std::int64_t i) const {
    const float g = load_any(gdt, grad, i) * factor;
    const float mi = a.beta1 * m[i] + (1.0f - a.beta1) * g;
    const float vi = a.beta2 * v[i] + (1.0f - a.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float w = master[i] * decay - a.lr * (mi / bc1) / (sqrtf(vi / bc2) + a.eps);
    master[i] = w;
    if (param_out) store_any(pdt, param_out, i, w);
  }
};

__global__ void adamw_kernel(float* master, int gdt, const void* grad, float* m, float* v, int pdt, void* param_out,
                             std::int64_t n, detail::AdamArgs a, const detail::StepState* st) {
  if (st->found_inf > 0) return;
  const AdamStep step(a, *st);
  COSHARD_GRID_STRIDE(i, n) step.update(a, master, gdt, grad, m, v, pdt, param_out, i);
}

// ---- multi-tensor ----

constexpr int kMaxTensors = 32;
constexpr int kMaxBlocks = 320;
constexpr std::int64_t kChunk = 65536;  // elements a block

// A launch's tensors and, per block, the tensor and the chunk of it that block serves: 3.4 KB,
// inside the 4 KB of kernel parameters every CUDA version takes.
struct TensorList {
  detail::OptimizerTensor tensors[kMaxTensors];
  std::int32_t block_chunk[kMaxBlocks];
  std::uint8_t block_tensor[kMaxBlocks];
};
static_assert(sizeof(TensorList) < 4000);

struct ChunkRange {
  const detail::OptimizerTensor& t;
  std::int64_t begin, end;
};
__device__ ChunkRange chunk_of_block(const TensorList& list) {
  const detail::OptimizerTensor& t = list.tensors[list.block_tensor[blockIdx.x]];
  const std::int64_t begin = static_cast<std::int64_t>(list.block_chunk[blockIdx.x]) * kChunk;
  return {t, begin, begin + kChunk < t.n ? begin + kChunk : t.n};
}

__global__ void grad_stats_multi_kernel(TensorList list, detail::StepState* st) {
  const ChunkRange r = chunk_of_block(list);
  float s = 0;
  for (std::int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const float g = load_any(r.t.gdt, r.t.grad, i);
    s += g * g;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) {
    if (!isfinite(s)) st->found_inf = 1.0f;
    atomicAdd(&st->grad_sumsq, s);
  }
}

__global__ void adamw_multi_kernel(TensorList list, detail::AdamArgs a, const detail::StepState* st) {
  if (st->found_inf > 0) return;
  const AdamStep step(a, *st);
  const ChunkRange r = chunk_of_block(list);
  for (std::int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x)
    step.update(a, r.t.master, r.t.gdt, r.t.grad, r.t.state1, r.t.state2, r.t.pdt, r.t.param_out, i);
}

// Packs `tensors` into lists of at most kMaxTensors tensors and kMaxBlocks chunks, calling
// launch(list, blocks) for each (a tensor may continue into the next list).
template <class Launch>
int for_each_list(const detail::OptimizerTensor* tensors, int count, Launch&& launch) {
  TensorList list{};
  int in_list = 0, blocks = 0;
  for (int k = 0; k < count; ++k) {
    const std::int64_t chunks = (tensors[k].n + kChunk - 1) / kChunk;
    if (chunks == 0) continue;
    for (std::int64_t c = 0; c < chunks;) {
      list.tensors[in_list] = tensors[k];
      while (c < chunks && blocks < kMaxBlocks) {
        list.block_tensor[blocks] = static_cast<std::uint8_t>(in_list);
        list.block_chunk[blocks] = static_cast<std::int32_t>(c);
        ++blocks;
        ++c;
      }
      ++in_list;
      if (blocks == kMaxBlocks || in_list == kMaxTensors) {
        if (const int e = launch(list, blocks); e != 0) return e;
        in_list = blocks = 0;
      }
    }
  }
  return blocks > 0 ? launch(list, blocks) : 0;
}

__global__ void sgd_kernel(float* master, int gdt, const void* grad, float* buf, int pdt, void* param_out,
                           std::int64_t n, detail::SgdArgs a, const detail::StepState* st) {
  if (st->found_inf > 0) return;
  const float factor = grad_factor(*st, a.max_grad_norm);
  const bool first = st->step == 0;
  COSHARD_GRID_STRIDE(i, n) {
    float g = load_any(gdt, grad, i) * factor + a.weight_decay * master[i];
    if (a.momentum != 0.0f) {
      const float b = first ? g : a.momentum * buf[i] + g;
      buf[i] = b;
      g = a.nesterov ? g + a.momentum * b : b;
    }
    const float w = master[i] - a.lr * g;
    master[i] = w;
    if (param_out) store_any(pdt, param_out, i, w);
  }
}

__global__ void step_end_kernel(detail::StepState* st, detail::LossScaleArgs a) {
  st->last_grad_norm = sqrtf(st->grad_sumsq) / st->loss_scale;
  st->last_skipped = st->found_inf > 0 ? 1 : 0;
  if (st->found_inf > 0) {
    ++st->skipped_steps;
    st->good_steps = 0;
    if (a.dynamic) st->loss_scale = fmaxf(a.min_scale, st->loss_scale * a.backoff_factor);
    return;
  }
  ++st->step;
  if (a.dynamic && ++st->good_steps >= a.growth_interval) {
    st->loss_scale = fminf(a.max_scale, st->loss_scale * a.growth_factor);
    st->good_steps = 0;
  }
}

}  // namespace

int step_begin(void* s, detail::StepState* state) {
  step_begin_kernel<<<1, 1, 0, as_stream(s)>>>(state);
  return static_cast<int>(cudaGetLastError());
}

int grad_stats(void* s, int gdt, const void* grad, std::int64_t n, detail::StepState* state) {
  grad_stats_kernel<<<grid_for(n), kThreads, 0, as_stream(s)>>>(gdt, grad, n, state);
  return static_cast<int>(cudaGetLastError());
}

int adamw(void* s, float* master, int gdt, const void* grad, float* m, float* v, int pdt, void* param_out,
          std::int64_t n, detail::AdamArgs args, const detail::StepState* state) {
  adamw_kernel<<<grid_for(n), kThreads, 0, as_stream(s)>>>(master, gdt, grad, m, v, pdt, param_out, n, args, state);
  return static_cast<int>(cudaGetLastError());
}

int grad_stats_multi(void* s, const detail::OptimizerTensor* tensors, int count, detail::StepState* state) {
  return for_each_list(tensors, count, [&](const TensorList& list, int blocks) {
    grad_stats_multi_kernel<<<blocks, kThreads, 0, as_stream(s)>>>(list, state);
    return static_cast<int>(cudaGetLastError());
  });
}

int adamw_multi(void* s, const detail::OptimizerTensor* tensors, int count, detail::AdamArgs args,
                const detail::StepState* state) {
  return for_each_list(tensors, count, [&](const TensorList& list, int blocks) {
    adamw_multi_kernel<<<blocks, kThreads, 0, as_stream(s)>>>(list, args, state);
    return static_cast<int>(cudaGetLastError());
  });
}

int sgd(void* s, float* master, int gdt, const void* grad, float* momentum_buf, int pdt, void* param_out,
        std::int64_t n, detail::SgdArgs args, const detail::StepState* state) {
  sgd_kernel<<<grid_for(n), kThreads, 0, as_stream(s)>>>(master, gdt, grad, momentum_buf, pdt, param_out, n, args,
                                                          state);
  return static_cast<int>(cudaGetLastError());
}

int step_end(void* s, detail::StepState* state, detail::LossScaleArgs args) {
  step_end_kernel<<<1, 1, 0, as_stream(s)>>>(state, args);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace coshard::modules::cuda
