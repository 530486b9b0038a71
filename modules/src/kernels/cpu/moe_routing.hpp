// The CPU's mixture-of-experts routing (kernels.hpp: moe_route, moe_route_backward,
// moe_dispatch_plan), in f32 arithmetic in the order CUDA's (cuda/moe_routing.cu) takes, so both
// give the same bits: per token, the softmax over the experts (max subtracted, exp, summed in
// expert order), the top k (ties to the lower expert), their renormalisation.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cpu/operands.hpp"

namespace coshard::modules::detail::cpu {

inline void moe_route_token(const float* x, std::int64_t experts, std::int64_t k, bool renormalize, float* probs,
                            std::int32_t* chosen, float* weights) {
  float top = x[0];
  for (std::int64_t e = 1; e < experts; ++e) top = std::fmax(top, x[e]);
  float sum = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    probs[e] = std::exp(x[e] - top);
    sum += probs[e];
  }
  for (std::int64_t e = 0; e < experts; ++e) probs[e] = probs[e] / sum;
  float picked = 0;
  for (std::int64_t j = 0; j < k; ++j) {
    std::int64_t best = -1;
    for (std::int64_t e = 0; e < experts; ++e) {
      bool taken = false;
      for (std::int64_t i = 0; i < j; ++i) taken = taken || chosen[i] == e;
      if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
    }
    chosen[j] = static_cast<std::int32_t>(best);
    weights[j] = probs[best];
    picked += probs[best];
  }
  if (renormalize)
    for (std::int64_t j = 0; j < k; ++j) weights[j] = weights[j] / picked;
}

inline void moe_route(DataType dt, const void* logits, std::int64_t tokens, std::int64_t experts, std::int64_t k,
                      bool renormalize, float* probs, std::int32_t* chosen, float* weights) {
  std::vector<float> row(static_cast<std::size_t>(experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t e = 0; e < experts; ++e) row[static_cast<std::size_t>(e)] = static_cast<float>(load(dt, logits, t * experts + e));
    moe_route_token(row.data(), experts, k, renormalize, probs + t * experts, chosen + t * k, weights + t * k);
  }
}

// d logits from d weights: through the renormalisation (dw_j - sum_l dw_l w_l) / S onto the chosen
// probabilities, plus `dprob_extra[e]` on every probability (an auxiliary loss's, or none), then
// through the softmax, p_e (g_e - sum_e' p_e' g_e').
inline void moe_route_backward(const float* probs, const std::int32_t* chosen, const float* weights,
                               const float* dweights, const float* dprob_extra, std::int64_t tokens,
                               std::int64_t experts, std::int64_t k, bool renormalize, DataType dt, void* dlogits) {
  std::vector<float> g(static_cast<std::size_t>(experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* p = probs + t * experts;
    const std::int32_t* c = chosen + t * k;
    for (std::int64_t e = 0; e < experts; ++e) g[static_cast<std::size_t>(e)] = dprob_extra ? dprob_extra[e] : 0.0f;
    float picked = 0, dot = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      picked += p[c[j]];
      dot += dweights[t * k + j] * weights[t * k + j];
    }
    for (std::int64_t j = 0; j < k; ++j)
      g[static_cast<std::size_t>(c[j])] += renormalize ? (dweights[t * k + j] - dot) / picked : dweights[t * k + j];
    float inner = 0;
    for (std::int64_t e = 0; e < experts; ++e) inner += p[e] * g[static_cast<std::size_t>(e)];
    for (std::int64_t e = 0; e < experts; ++e)
      store(dt, dlogits, t * experts + e, p[e] * (g[static_cast<std::size_t>(e)] - inner));
  }
}

// Slots s = t * k + j ordered by expert, stably (a counting sort): counts[e], order[pos] = s,
// inverse[s] = pos.
inline void moe_dispatch_plan(const std::int32_t* chosen, std::int64_t slots, std::int64_t experts,
                              std::int32_t* counts, std::int32_t* order, std::int32_t* inverse) {
  for (std::int64_t e = 0; e < experts; ++e) counts[e] = 0;
  for (std::int64_t s = 0; s < slots; ++s) ++counts[chosen[s]];
  std::vector<std::int64_t> next(static_cast<std::size_t>(experts));
  std::int64_t at = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    next[static_cast<std::size_t>(e)] = at;
    at += counts[e];
  }
  for (std::int64_t s = 0; s < slots; ++s) {
    const auto pos = next[static_cast<std::size_t>(chosen[s])]++;
    order[pos] = static_cast<std::int32_t>(s);
    inverse[s] = static_cast<std::int32_t>(pos);
  }
}

}  // namespace coshard::modules::detail::cpu
