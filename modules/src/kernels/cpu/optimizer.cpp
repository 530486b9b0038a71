// The optimizer's CPU kernels (see optimizer.hpp). Each is one closure on the CPU stream, so it
// runs in stream order on the stream's worker; the element-wise loops split across cores
// (parallel.hpp) where the split changes no bit.
#include "kernels/cpu/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/operands.hpp"
#include "kernels/cpu/parallel.hpp"
#include "kernels/half_convert.hpp"

namespace coshard::modules::detail::cpu {
namespace {

using async::Stream;

// The optimizer's element-wise kernels split across cores in chunks of whole grains (a chunk
// below this is not worth a hand-off), each grain whole blocks of the gradient norm's sum.
constexpr std::int64_t kSumBlock = 4096;
constexpr std::int64_t kParallelGrain = 64 * kSumBlock;

// The clip-and-unscale factor for this step's gradients (the step kernels skip when 0 means inf).
inline float grad_factor(const StepState& st, float max_grad_norm) {
  const float inv_scale = 1.0f / st.loss_scale;
  float factor = inv_scale;
  if (max_grad_norm > 0) {
    const float norm = std::sqrt(st.grad_sumsq) * inv_scale;
    if (norm > max_grad_norm) factor *= max_grad_norm / (norm + 1e-6f);
  }
  return factor;
}

// Elements [begin, end) of the updated masters into the parameters (one loop per type, so that
// it vectorises).
inline void store_range(DataType pdt, void* out, const float* master, std::int64_t begin, std::int64_t end) {
  if (is_half(pdt))
    narrow_half(pdt, master + begin, static_cast<std::uint16_t*>(out) + begin, static_cast<std::size_t>(end - begin));
  else
    for (std::int64_t i = begin; i < end; ++i) store(pdt, out, i, master[i]);
}

// `fn` on the gradients as f64 or f32 (bf16/f16 widened to an f32 copy first).
template <class Fn>
void with_grad(DataType gdt, const void* grad, std::int64_t n, Fn&& fn) {
  if (gdt == DataType::f64) {
    fn(static_cast<const double*>(grad));
  } else if (is_half(gdt)) {
    Operands<float> io(gdt);
    fn(io.in(grad, n));
  } else {
    fn(static_cast<const float*>(grad));
  }
}

}  // namespace

Result<void> step_begin(Stream& s, StepState* state) {
  return s.launch([state] {
    state->grad_sumsq = 0;
    state->found_inf = 0;
  });
}

Result<void> grad_stats(Stream& s, DataType gdt, const void* grad, std::int64_t n, StepState* state) {
  return s.launch([=] {
    // f32 partial sums in blocks of 4096 (vectorised; the blocks split across cores), added up
    // in f64 in block order: fixed, so the norm is the same every run and on any core count.
    auto sum_squares = [n](const auto* g) {
      std::vector<float> parts(static_cast<std::size_t>((n + kSumBlock - 1) / kSumBlock));
      parallel_for(n, kParallelGrain, [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t begin = first; begin < last; begin += kSumBlock) {
          const std::int64_t end = std::min(last, begin + kSumBlock);
          float part = 0;
          for (std::int64_t i = begin; i < end; ++i) part += static_cast<float>(g[i]) * static_cast<float>(g[i]);
          parts[static_cast<std::size_t>(begin / kSumBlock)] = part;
        }
      });
      double total = 0;
      for (const float part : parts) total += part;
      return total;
    };
    double sumsq = 0;
    with_grad(gdt, grad, n, [&](const auto* g) { sumsq = sum_squares(g); });
    if (!std::isfinite(sumsq)) state->found_inf = 1;
    state->grad_sumsq += static_cast<float>(sumsq);
  });
}

Result<void> adamw(Stream& s, float* master, DataType gdt, const void* grad, float* m, float* v, DataType pdt,
                   void* param_out, std::int64_t n, const AdamArgs& a, const StepState* state) {
  return s.launch([=] {
    if (state->found_inf > 0) return;
    const float factor = grad_factor(*state, a.max_grad_norm);
    const int t = state->step + 1 - a.steps_missed;
    const float bc1 = 1.0f - std::pow(a.beta1, static_cast<float>(t));
    const float bc2 = 1.0f - std::pow(a.beta2, static_cast<float>(t));
    const float decay = 1.0f - a.lr * a.weight_decay;
    // One tight loop per gradient type, so that it vectorises; element-wise, so the chunks
    // across cores change no bit.
    auto update = [&](const auto* g) {
      const float b1 = a.beta1, b2 = a.beta2, lr = a.lr, eps = a.eps;
      const float inv_bc1 = 1.0f / bc1, inv_bc2 = 1.0f / bc2;
      parallel_for(n, kParallelGrain, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) {
          const float gi = static_cast<float>(g[i]) * factor;
          const float mi = b1 * m[i] + (1.0f - b1) * gi;
          const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
          m[i] = mi;
          v[i] = vi;
          master[i] = master[i] * decay - lr * (mi * inv_bc1) / (std::sqrt(vi * inv_bc2) + eps);
        }
        if (param_out) store_range(pdt, param_out, master, begin, end);
      });
    };
    with_grad(gdt, grad, n, update);
  });
}

Result<void> sgd(Stream& s, float* master, DataType gdt, const void* grad, float* buf, DataType pdt,
                 void* param_out, std::int64_t n, const SgdArgs& a, const StepState* state) {
  return s.launch([=] {
    if (state->found_inf > 0) return;
    const float factor = grad_factor(*state, a.max_grad_norm);
    const bool first = state->step == 0;
    parallel_for(n, kParallelGrain, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        float g = static_cast<float>(load(gdt, grad, i)) * factor + a.weight_decay * master[i];
        if (a.momentum != 0.0f) {
          buf[i] = first ? g : a.momentum * buf[i] + g;
          g = a.nesterov ? g + a.momentum * buf[i] : buf[i];
        }
        master[i] -= a.lr * g;
        if (param_out) store(pdt, param_out, i, master[i]);
      }
    });
  });
}

Result<void> step_end(Stream& s, StepState* state, const LossScaleArgs& a) {
  return s.launch([=] {
    StepState& st = *state;
    st.last_grad_norm = std::sqrt(st.grad_sumsq) / st.loss_scale;
    st.last_skipped = st.found_inf > 0 ? 1 : 0;
    if (st.found_inf > 0) {
      ++st.skipped_steps;
      st.good_steps = 0;
      if (a.dynamic) st.loss_scale = std::max(a.min_scale, st.loss_scale * a.backoff_factor);
      return;
    }
    ++st.step;
    if (a.dynamic && ++st.good_steps >= a.growth_interval) {
      st.loss_scale = std::min(a.max_scale, st.loss_scale * a.growth_factor);
      st.good_steps = 0;
    }
  });
}

}  // namespace coshard::modules::detail::cpu
