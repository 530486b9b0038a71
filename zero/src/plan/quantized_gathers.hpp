// Quantized weight gathers (ZeRO++'s qwZ, EngineOptions::quantize_weights): which units gather
// int8 blocks, and the memory their bytes take beside the gathered parameters. Private.
#pragma once

#include <cstddef>
#include <cstdint>

#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

// The int8 block a unit's gathers for compute carry (quantize_weights, or quantize_frozen_weights
// for a frozen unit), 0 for exact gathers (and for a unit sharded over one rank: nothing crosses).
std::int64_t int8_block_for(const EngineOptions& o, const FetchUnitInfo& info);
// The int8 block a trained unit's gradient reduction carries (quantize_gradients), 0 for exact.
std::int64_t int8_gradient_block_for(const EngineOptions& o, const FetchUnitInfo& info);
// The bytes int8 pieces of blocks of `block` elements take for `bytes` bytes of `dtype` values (a
// gather's pieces beside its gathered parameters, a reduction's beside its gradient).
std::size_t int8_staging_bytes(std::int64_t block, DataType dtype, std::size_t bytes);

}  // namespace coshard::zero::detail
