// The CPU kernels of the token and position embeddings (private), on tables and activations of
// storage type S (elements.hpp: f32, f64, or bf16/f16 in place with f32 math). A vocabulary-
// parallel table holds rows [first, first + rows); a token outside them is another rank's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/elements.hpp"

namespace coshard::modules::detail {

template <class S>
void embedding_fwd(const std::int32_t* tokens, const S* wte, const S* wpe, S* out, std::int64_t B, std::int64_t T,
                   std::int64_t C, std::int64_t first, std::int64_t rows) {
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t row = tokens[b * T + t] - first;
      S* o = out + (b * T + t) * C;
      if (row < 0 || row >= rows) {  // another rank's row of a vocabulary-parallel table
        for (std::int64_t c = 0; c < C; ++c) o[c] = wpe ? wpe[t * C + c] : narrow<S>(0);
        continue;
      }
      const S* e = wte + row * C;
      if (wpe) {
        const S* p = wpe + t * C;
        for (std::int64_t c = 0; c < C; ++c) o[c] = narrow<S>(widen(e[c]) + widen(p[c]));
      } else {
        for (std::int64_t c = 0; c < C; ++c) o[c] = e[c];
      }
    }
}

// dwte's rows and dwpe's positions accumulate the tokens' gradients, each row in compute_t<S>
// from its value, adding its tokens in token order (the order one loop over the tokens adds
// them in), rounded once. Throws std::bad_alloc where its lists cannot be had.
template <class S>
void embedding_bwd(const std::int32_t* tokens, const S* dout, S* dwte, S* dwpe, std::int64_t B, std::int64_t T,
                   std::int64_t C, std::int64_t first, std::int64_t rows) {
  using V = compute_t<S>;
  std::vector<std::int64_t> order;  // this table's tokens, by row, in token order within a row
  order.reserve(static_cast<std::size_t>(B * T));
  for (std::int64_t i = 0; i < B * T; ++i)
    if (tokens[i] - first >= 0 && tokens[i] - first < rows) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return tokens[a] < tokens[b]; });
  std::vector<V> acc(static_cast<std::size_t>(C));
  for (std::size_t at = 0; at < order.size();) {
    S* e = dwte + (tokens[order[at]] - first) * C;
    for (std::int64_t c = 0; c < C; ++c) acc[static_cast<std::size_t>(c)] = widen(e[c]);
    const std::int32_t token = tokens[order[at]];
    for (; at < order.size() && tokens[order[at]] == token; ++at) {
      const S* g = dout + order[at] * C;
      for (std::int64_t c = 0; c < C; ++c) acc[static_cast<std::size_t>(c)] += widen(g[c]);
    }
    for (std::int64_t c = 0; c < C; ++c) e[c] = narrow<S>(acc[static_cast<std::size_t>(c)]);
  }
  if (dwpe == nullptr) return;
  for (std::int64_t t = 0; t < T; ++t) {
    S* p = dwpe + t * C;
    for (std::int64_t c = 0; c < C; ++c) acc[static_cast<std::size_t>(c)] = widen(p[c]);
    for (std::int64_t b = 0; b < B; ++b) {
      const S* g = dout + (b * T + t) * C;
      for (std::int64_t c = 0; c < C; ++c) acc[static_cast<std::size_t>(c)] += widen(g[c]);
    }
    for (std::int64_t c = 0; c < C; ++c) p[c] = narrow<S>(acc[static_cast<std::size_t>(c)]);
  }
}

}  // namespace coshard::modules::detail
