// CPU reductions for the Local backend (private).
#pragma once

#include <cstddef>
#include <span>

#include "coshard/collectives/dtype.hpp"

namespace coshard::collectives::detail {

// out[0..n) = op(inputs[0][0..n), inputs[1][0..n), ...), combined in input order (so every rank
// that computes it gets the same bits). avg divides the sum by `world`. f16/bf16 accumulate in
// f32 and round once. `out` must not alias any input.
void reduce(DataType dtype, ReduceOp op, void* out, std::span<const void* const> inputs, std::size_t n, int world);

}  // namespace coshard::collectives::detail
