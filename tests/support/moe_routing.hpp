// Mixture-of-experts routing (modules/src/kernels/kernels.hpp: moe_route, moe_route_backward,
// moe_dispatch_plan) written plainly from transformers' router for the kernels' tests, CPU and
// emulated CUDA alike: the forward in f32 in the documented order (so both kernels give its bits),
// the backward from its definition in f64 (a tolerance), the dispatch plan as a stable sort. Nothing
// of coshard's, so the emulated-kernel test uses it too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace coshard::testing {

struct Routing {
  std::vector<float> probs;          // [T, E]
  std::vector<std::int32_t> chosen;  // [T, k]
  std::vector<float> weights;        // [T, k]
};

// softmax(x) in f32 (max subtracted, exp, the sum in expert order, each divided by it), the top k
// by probability (ties to the lower expert), renormalised by their f32 sum.
inline Routing route_reference(const std::vector<float>& x, std::int64_t tokens, std::int64_t experts, std::int64_t k,
                               bool renormalize) {
  Routing r{std::vector<float>(static_cast<std::size_t>(tokens * experts)),
            std::vector<std::int32_t>(static_cast<std::size_t>(tokens * k)),
            std::vector<float>(static_cast<std::size_t>(tokens * k))};
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* row = x.data() + t * experts;
    float* p = r.probs.data() + t * experts;
    const float top = *std::max_element(row, row + experts);
    float sum = 0;
    for (std::int64_t e = 0; e < experts; ++e) sum += (p[e] = std::exp(row[e] - top));
    for (std::int64_t e = 0; e < experts; ++e) p[e] /= sum;
    std::vector<std::int64_t> order(static_cast<std::size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return p[a] > p[b]; });
    float picked = 0;
    for (std::int64_t j = 0; j < k; ++j) picked += p[order[static_cast<std::size_t>(j)]];
    for (std::int64_t j = 0; j < k; ++j) {
      const auto e = order[static_cast<std::size_t>(j)];
      r.chosen[static_cast<std::size_t>(t * k + j)] = static_cast<std::int32_t>(e);
      r.weights[static_cast<std::size_t>(t * k + j)] = renormalize ? p[e] / picked : p[e];
    }
  }
  return r;
}

// d logits of L = sum dweights[t, j] * w[t, j] + sum extra[e] * p[t, e], the chosen experts held,
// in f64 from the definition: the renormalised weights' and the softmax's Jacobians.
inline std::vector<double> route_backward_reference(const std::vector<float>& x, const std::vector<std::int32_t>& chosen,
                                                    const std::vector<float>& dweights, const std::vector<float>& extra,
                                                    std::int64_t tokens, std::int64_t experts, std::int64_t k,
                                                    bool renormalize) {
  std::vector<double> out(static_cast<std::size_t>(tokens * experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<double> p(static_cast<std::size_t>(experts));
    double top = -INFINITY, sum = 0;
    for (std::int64_t e = 0; e < experts; ++e) top = std::max(top, static_cast<double>(x[static_cast<std::size_t>(t * experts + e)]));
    for (std::int64_t e = 0; e < experts; ++e) sum += (p[static_cast<std::size_t>(e)] = std::exp(x[static_cast<std::size_t>(t * experts + e)] - top));
    for (auto& v : p) v /= sum;
    double picked = 0;
    for (std::int64_t j = 0; j < k; ++j) picked += p[static_cast<std::size_t>(chosen[static_cast<std::size_t>(t * k + j)])];
    // dL/dp_e
    std::vector<double> g(static_cast<std::size_t>(experts), 0.0);
    for (std::int64_t e = 0; e < experts; ++e) g[static_cast<std::size_t>(e)] = extra.empty() ? 0.0 : extra[static_cast<std::size_t>(e)];
    for (std::int64_t j = 0; j < k; ++j) {
      const auto cj = static_cast<std::size_t>(chosen[static_cast<std::size_t>(t * k + j)]);
      for (std::int64_t l = 0; l < k; ++l) {
        const auto cl = static_cast<std::size_t>(chosen[static_cast<std::size_t>(t * k + l)]);
        const double dw = dweights[static_cast<std::size_t>(t * k + l)];
        // w_l = p_cl / S (or p_cl): d w_l / d p_cj
        const double dwl_dpj = renormalize ? ((cl == cj ? 1.0 : 0.0) / picked - p[cl] / (picked * picked)) : (cl == cj ? 1.0 : 0.0);
        g[cj] += dw * dwl_dpj;
      }
    }
    double inner = 0;
    for (std::int64_t e = 0; e < experts; ++e) inner += p[static_cast<std::size_t>(e)] * g[static_cast<std::size_t>(e)];
    for (std::int64_t e = 0; e < experts; ++e)
      out[static_cast<std::size_t>(t * experts + e)] = p[static_cast<std::size_t>(e)] * (g[static_cast<std::size_t>(e)] - inner);
  }
  return out;
}

// The slots t * k + j sorted by expert, stably: counts, order, inverse.
struct DispatchPlan {
  std::vector<std::int32_t> counts, order, inverse;
};
inline DispatchPlan dispatch_reference(const std::vector<std::int32_t>& chosen, std::int64_t experts) {
  DispatchPlan d{std::vector<std::int32_t>(static_cast<std::size_t>(experts), 0), {}, std::vector<std::int32_t>(chosen.size())};
  for (auto c : chosen) ++d.counts[static_cast<std::size_t>(c)];
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::size_t s = 0; s < chosen.size(); ++s)
      if (chosen[s] == e) {
        d.inverse[s] = static_cast<std::int32_t>(d.order.size());
        d.order.push_back(static_cast<std::int32_t>(s));
      }
  return d;
}

// The combine in f32: out[t, c] = the sum over t's places in ascending order of round(w[t, j])
// (or 1 without weights) * rows[place, c]; `round` is the rows' dtype's rounding of a weight.
template <class Round>
std::vector<float> combine_reference(const std::vector<float>& rows, const std::vector<std::int32_t>& inverse,
                                     const std::vector<float>* weights, std::int64_t tokens, std::int64_t k,
                                     std::int64_t width, Round round) {
  std::vector<float> out(static_cast<std::size_t>(tokens * width));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<std::int64_t> slots(static_cast<std::size_t>(k));
    std::iota(slots.begin(), slots.end(), 0);
    std::sort(slots.begin(), slots.end(), [&](std::int64_t a, std::int64_t b) {
      return inverse[static_cast<std::size_t>(t * k + a)] < inverse[static_cast<std::size_t>(t * k + b)];
    });
    for (std::int64_t c = 0; c < width; ++c) {
      float sum = 0;
      for (const auto j : slots) {
        const float w = weights ? round((*weights)[static_cast<std::size_t>(t * k + j)]) : 1.0f;
        sum += w * rows[static_cast<std::size_t>(inverse[static_cast<std::size_t>(t * k + j)] * width + c)];
      }
      out[static_cast<std::size_t>(t * width + c)] = sum;
    }
  }
  return out;
}

// Chosen experts, k distinct ones a token, from a seed.
inline std::vector<std::int32_t> distinct_choices(std::int64_t tokens, std::int64_t experts, std::int64_t k,
                                                  unsigned seed) {
  std::vector<std::int32_t> chosen;
  std::uint64_t state = seed;
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<std::int32_t> all(static_cast<std::size_t>(experts));
    std::iota(all.begin(), all.end(), 0);
    for (std::int64_t j = 0; j < k; ++j) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const auto pick = static_cast<std::size_t>(j + static_cast<std::int64_t>((state >> 33) % static_cast<std::uint64_t>(experts - j)));
      std::swap(all[static_cast<std::size_t>(j)], all[pick]);
      chosen.push_back(all[static_cast<std::size_t>(j)]);
    }
  }
  return chosen;
}

}  // namespace coshard::testing
