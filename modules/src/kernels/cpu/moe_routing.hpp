// The CPU's mixture-of-experts routing (kernels.hpp: moe_route, moe_route_backward,
// moe_dispatch_plan), in f32 arithmetic in the order CUDA's (cuda/moe_routing.cu) takes, so both
// give the same bits: per token, the softmax over the experts (max subtracted, exp, summed in
// expert order), the top k (ties to the lower expert), their renormalisation.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

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

// v as dt holds it, read back as f32 (a routing weight in the dtype the experts' rows are: as
// transformers casts it before the product).
inline float round_to(DataType dt, float v) {
  if (dt == DataType::bf16) return async::bf16_to_float(async::float_to_bf16(v));
  if (dt == DataType::f16) return async::f16_to_float(async::float_to_f16(v));
  return v;
}

// Dispatch: out[i, :] = x[order[i] / k, :] (the rows of a token, once for each of its experts).
inline void moe_gather_rows(DataType dt, const void* x, const std::int32_t* order, std::int64_t rows, std::int64_t k,
                            std::int64_t width, void* out) {
  const auto bytes = static_cast<std::size_t>(width) * size_of(dt);
  for (std::int64_t i = 0; i < rows; ++i)
    std::memcpy(static_cast<std::byte*>(out) + static_cast<std::size_t>(i) * bytes,
                static_cast<const std::byte*>(x) + static_cast<std::size_t>(order[i] / k) * bytes, bytes);
}

// A token's k slots in ascending place (= its experts' order: the places are sorted by expert).
inline void token_places(const std::int32_t* inverse, std::int64_t t, std::int64_t k, std::int64_t* places,
                         std::int64_t* slots) {
  for (std::int64_t j = 0; j < k; ++j) {
    places[j] = inverse[t * k + j];
    slots[j] = j;
  }
  for (std::int64_t a = 1; a < k; ++a)
    for (std::int64_t b = a; b > 0 && places[b] < places[b - 1]; --b) {
      std::swap(places[b], places[b - 1]);
      std::swap(slots[b], slots[b - 1]);
    }
}

// Dispatch's backward and the combine: dx[t, :] = the sum over t's slots, in its experts' order,
// of d[place, :] (scale: none) or of w[t, j] (rounded to dt) * d[place, :], in f32, rounded once.
inline void moe_combine_rows(DataType dt, const void* rows_in, const std::int32_t* inverse, const float* weights,
                             std::int64_t tokens, std::int64_t k, std::int64_t width, void* out) {
  std::vector<std::int64_t> places(static_cast<std::size_t>(k)), slots(static_cast<std::size_t>(k));
  for (std::int64_t t = 0; t < tokens; ++t) {
    token_places(inverse, t, k, places.data(), slots.data());
    for (std::int64_t c = 0; c < width; ++c) {
      float sum = 0;
      for (std::int64_t j = 0; j < k; ++j) {
        const auto v = static_cast<float>(load(dt, rows_in, places[static_cast<std::size_t>(j)] * width + c));
        const float w = weights ? round_to(dt, weights[t * k + slots[static_cast<std::size_t>(j)]]) : 1.0f;
        sum += w * v;
      }
      store(dt, out, t * width + c, sum);
    }
  }
}

// The combine's backward: d_rows[place, :] = w[t, j] (rounded to dt) * dy[t, :], and dweights[t, j]
// = the f32 sum over the width of dy[t, c] * rows[place, c].
inline void moe_combine_backward(DataType dt, const void* dy, const void* rows_in, const std::int32_t* inverse,
                                 const float* weights, std::int64_t tokens, std::int64_t k, std::int64_t width,
                                 void* d_rows, float* dweights) {
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t place = inverse[t * k + j];
      const float w = round_to(dt, weights[t * k + j]);
      float dot = 0;
      for (std::int64_t c = 0; c < width; ++c) {
        const auto g = static_cast<float>(load(dt, dy, t * width + c));
        dot += g * static_cast<float>(load(dt, rows_in, place * width + c));
        store(dt, d_rows, place * width + c, w * g);
      }
      dweights[t * k + j] = dot;
    }
}

}  // namespace coshard::modules::detail::cpu
