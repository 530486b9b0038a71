// Sampling tokens from a model (Trainer::generate): the options, and the choice of one token from
// one row of logits, on the host.
//
// temperature 0 is greedy: the most likely token (the lowest id among equals), the same text for
// the same weights at any world size and stage. Otherwise softmax(logits / temperature) over the
// top_k most likely tokens (0: all), drawn with a generator seeded by `seed`, so a sample is
// reproducible.
#pragma once

#include <cstdint>
#include <random>
#include <span>

#include "coshard/async/result.hpp"

namespace coshard::trainer {

struct SampleOptions {
  std::int64_t tokens = 32;   // new tokens after the prompt
  float temperature = 1.0f;   // 0: greedy
  std::int64_t top_k = 0;     // 0: every token
  std::uint64_t seed = 1;
  // The model's vocabulary: prompt ids are checked below it before anything runs (0: the
  // embedding checks them).
  std::int64_t vocab = 0;
  // Each value in its range (tokens 1 to 2^20, temperature finite >= 0, top_k >= 0), named.
  Result<void> validate() const;
};

// The next token from one row of logits. Fails on an empty row or a row with no finite logit.
Result<std::int32_t> choose_token(std::span<const double> logits, const SampleOptions& options, std::mt19937_64& rng);

}  // namespace coshard::trainer
