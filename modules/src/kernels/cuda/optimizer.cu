// The optimizer's CUDA kernels: gradient statistics, AdamW and SGD over fp32 master weights, and
// the step control (clipping, overflow skip, dynamic loss scaling) read and written on the device
// only. AdamW and the gradient statistics also come multi-tensor: one launch for a list of
// tensors (up to kMaxTensors tensors, passed by value in the kernel's parameters, a block for each
// chunk of kChunk elements), with the same arithmetic per element as the one-tensor kernels;
// AdamW moves four elements a thread at a time through vector accesses where the tensor's
// pointers allow (the step is memory-bound: a device copy's bandwidth is its limit).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

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
        bc1(1.0f - powf(a.beta1, static_cast<float>(st.step + 1 - a.steps_missed))),
        bc2(1.0f - powf(a.beta2, static_cast<float>(st.step + 1 - a.steps_missed))),
        decay(1.0f - a.lr * a.weight_decay) {}
  // One element: the gradient as stored (unscaled) and the element's moments and master in, the
  // new master out (the moments updated in place). Every operation is an explicit round-to-nearest
  // intrinsic, which the compiler never fuses or reorders: the vector and the element-by-element
  // paths then give the same bits wherever they are inlined (with plain expressions, nvcc
  // contracted them into different FMAs in the two, and the H200 saw last-bit differences).
  __device__ __forceinline__ float apply(const detail::AdamArgs& a, float stored_grad, float& m, float& v,
                                        float w) const {
    const float g = __fmul_rn(stored_grad, factor);
    const float mi = __fmaf_rn(a.beta1, m, __fmul_rn(1.0f - a.beta1, g));
    const float vi = __fmaf_rn(a.beta2, v, __fmul_rn(__fmul_rn(1.0f - a.beta2, g), g));
    m = mi;
    v = vi;
    const float denominator = __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, bc2)), a.eps);
    return __fmaf_rn(w, decay, -__fdiv_rn(__fmul_rn(a.lr, __fdiv_rn(mi, bc1)), denominator));
  }
  __device__ void update(const detail::AdamArgs& a, float* master, int gdt, const void* grad, float* m, float* v,
                         int pdt, void* param_out, std::int64_t i) const {
    float mi = m[i], vi = v[i];
    const float w = apply(a, load_any(gdt, grad, i), mi, vi, master[i]);
    m[i] = mi;
    v[i] = vi;
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
constexpr std::int64_t kChunk = 65536;  // elements a block

// A launch's tensors: blocks [block_start[k], block_start[k + 1]) serve tensor k's chunks from
// first_chunk[k] on (a tensor may continue from the list before). 2 KB, inside the 4 KB of kernel
// parameters every CUDA version takes; the block count is not bounded by it (a block finds its
// tensor by scanning block_start), so one launch covers up to kMaxTensors whole tensors.
struct TensorList {
  detail::OptimizerTensor tensors[kMaxTensors];
  std::int32_t first_chunk[kMaxTensors];
  std::int32_t block_start[kMaxTensors + 1];
};
static_assert(sizeof(TensorList) < 4000);

struct ChunkRange {
  const detail::OptimizerTensor& t;
  std::int64_t begin, end;
};
__device__ ChunkRange chunk_of_block(const TensorList& list) {
  const auto block = static_cast<std::int32_t>(blockIdx.x);
  int k = 0;
  while (block >= list.block_start[k + 1]) ++k;
  const detail::OptimizerTensor& t = list.tensors[k];
  const std::int64_t begin = (static_cast<std::int64_t>(list.first_chunk[k]) + (block - list.block_start[k])) * kChunk;
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

// Four consecutive elements of storage type E, moved as one 8- or 16-byte access.
template <class E>
struct alignas(4 * sizeof(E)) Four {
  E e[4];
};

template <class E>
__device__ __forceinline__ bool aligned_for_four(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % (4 * sizeof(E)) == 0;
}

// AdamW over [begin, end) of one tensor, four elements a thread at a time through vector
// accesses (masters, moments and gradients read before any is written, so the loads of a group
// are in flight together); G and P are the gradient's and the parameter copy's storage types.
// The same arithmetic per element as AdamStep::update (the same bits). Every pointer is aligned
// for its four-element accesses and `begin` is a multiple of 4 (the caller checks).
template <class G, class P>
__device__ void adamw_fours(const AdamStep& step, const detail::AdamArgs& a, const detail::OptimizerTensor& t,
                            std::int64_t begin, std::int64_t end) {
  float* __restrict__ master = t.master;
  float* __restrict__ m = t.state1;
  float* __restrict__ v = t.state2;
  const G* __restrict__ grad = static_cast<const G*>(t.grad);
  P* __restrict__ out = static_cast<P*>(t.param_out);
  const std::int64_t whole = begin + (end - begin) / 4 * 4;
  for (std::int64_t i = begin + 4 * static_cast<std::int64_t>(threadIdx.x); i < whole; i += 4 * blockDim.x) {
    const Four<G> g = *reinterpret_cast<const Four<G>*>(grad + i);
    Four<float> w = *reinterpret_cast<const Four<float>*>(master + i);
    Four<float> mi = *reinterpret_cast<const Four<float>*>(m + i);
    Four<float> vi = *reinterpret_cast<const Four<float>*>(v + i);
    Four<P> p;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w.e[j] = step.apply(a, load(g.e, j), mi.e[j], vi.e[j], w.e[j]);
      store(p.e, j, w.e[j]);
    }
    *reinterpret_cast<Four<float>*>(master + i) = w;
    *reinterpret_cast<Four<float>*>(m + i) = mi;
    *reinterpret_cast<Four<float>*>(v + i) = vi;
    if (out) *reinterpret_cast<Four<P>*>(out + i) = p;
  }
  for (std::int64_t i = whole + threadIdx.x; i < end; i += blockDim.x)
    step.update(a, t.master, t.gdt, t.grad, t.state1, t.state2, t.pdt, t.param_out, i);
}

// adamw_fours<G, P> for the tensor's storage types; false where it does not serve them (the
// caller then goes element by element).
template <class G>
__device__ bool adamw_fours_as(const AdamStep& step, const detail::AdamArgs& a, const detail::OptimizerTensor& t,
                               std::int64_t begin, std::int64_t end) {
  const bool base = aligned_for_four<float>(t.master) && aligned_for_four<float>(t.state1) &&
                    aligned_for_four<float>(t.state2) && aligned_for_four<G>(t.grad) && begin % 4 == 0;
  if (!base) return false;
  switch (t.pdt) {
    case kF16:
      if (t.param_out && !aligned_for_four<__half>(t.param_out)) return false;
      adamw_fours<G, __half>(step, a, t, begin, end);
      return true;
    case kBF16:
      if (t.param_out && !aligned_for_four<__nv_bfloat16>(t.param_out)) return false;
      adamw_fours<G, __nv_bfloat16>(step, a, t, begin, end);
      return true;
    case kF32:
      if (t.param_out && !aligned_for_four<float>(t.param_out)) return false;
      adamw_fours<G, float>(step, a, t, begin, end);
      return true;
    default: return false;
  }
}

__global__ void adamw_multi_kernel(TensorList list, detail::AdamArgs a, const detail::StepState* st) {
  if (st->found_inf > 0) return;
  const AdamStep step(a, *st);
  const ChunkRange r = chunk_of_block(list);
  bool done = false;
  switch (r.t.gdt) {  // the same for every thread of the block: no divergence
    case kF16: done = adamw_fours_as<__half>(step, a, r.t, r.begin, r.end); break;
    case kBF16: done = adamw_fours_as<__nv_bfloat16>(step, a, r.t, r.begin, r.end); break;
    case kF32: done = adamw_fours_as<float>(step, a, r.t, r.begin, r.end); break;
    default: break;
  }
  if (done) return;
  for (std::int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x)
    step.update(a, r.t.master, r.t.gdt, r.t.grad, r.t.state1, r.t.state2, r.t.pdt, r.t.param_out, i);
}

// Packs `tensors` into lists of at most kMaxTensors tensors (and 2^31 - 1 blocks), calling
// launch(list, blocks) for each.
template <class Launch>
int for_each_list(const detail::OptimizerTensor* tensors, int count, Launch&& launch) {
  constexpr std::int64_t kMaxBlocks = 0x7fffffff;
  TensorList list{};
  int in_list = 0;
  std::int64_t blocks = 0;
  for (int k = 0; k < count; ++k) {
    const std::int64_t chunks = (tensors[k].n + kChunk - 1) / kChunk;
    for (std::int64_t c = 0; c < chunks;) {
      const std::int64_t take = chunks - c < kMaxBlocks - blocks ? chunks - c : kMaxBlocks - blocks;
      list.tensors[in_list] = tensors[k];
      list.first_chunk[in_list] = static_cast<std::int32_t>(c);
      list.block_start[in_list] = static_cast<std::int32_t>(blocks);
      blocks += take;
      c += take;
      ++in_list;
      list.block_start[in_list] = static_cast<std::int32_t>(blocks);
      if (blocks == kMaxBlocks || in_list == kMaxTensors) {
        if (const int e = launch(list, static_cast<unsigned>(blocks)); e != 0) return e;
        in_list = 0;
        blocks = 0;
      }
    }
  }
  return blocks > 0 ? launch(list, static_cast<unsigned>(blocks)) : 0;
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
  return for_each_list(tensors, count, [&](const TensorList& list, unsigned blocks) {
    grad_stats_multi_kernel<<<blocks, kThreads, 0, as_stream(s)>>>(list, state);
    return static_cast<int>(cudaGetLastError());
  });
}

int adamw_multi(void* s, const detail::OptimizerTensor* tensors, int count, detail::AdamArgs args,
                const detail::StepState* state) {
  return for_each_list(tensors, count, [&](const TensorList& list, unsigned blocks) {
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
