// A batch of next-token rows for the engine tests: rows [first, first + rows), row s the tokens
// sequence(s) gives (seq + 1 of them): the inputs its first seq, the targets its last seq.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "coshard/modules/module.hpp"

namespace coshard::testing {

template <class Sequence>
Result<modules::Batch> token_batch(modules::Context& ctx, std::int64_t first, std::int64_t rows, std::int64_t seq,
                                   Sequence&& sequence) {
  std::vector<std::int32_t> inputs, targets;
  for (std::int64_t s = first; s < first + rows; ++s) {
    const std::vector<std::int32_t> t = sequence(s);
    inputs.insert(inputs.end(), t.begin(), t.end() - 1);
    targets.insert(targets.end(), t.begin() + 1, t.end());
  }
  modules::Batch b;
  COSHARD_TRY_ASSIGN(b.inputs, ctx.upload(std::as_bytes(std::span(inputs)), modules::Shape{rows, seq},
                                          modules::DataType::i32));
  COSHARD_TRY_ASSIGN(b.targets, ctx.upload(std::as_bytes(std::span(targets)), modules::Shape{rows * seq},
                                           modules::DataType::i32));
  return b;
}

}  // namespace coshard::testing
