// Quantized weight gathers and gradient reduction (ZeRO++'s qwZ and qgZ, EngineOptions::
// quantize_weights and quantize_gradients): which units carry quantized blocks, in which format,
// and the memory their bytes take beside the gathered parameters and gradients. Private.
#pragma once

#include <cstddef>
#include <cstdint>

#include "coshard/zero/engine.hpp"
#include "kernels/kernel_args.hpp"

namespace coshard::zero::detail {

// The int8 block a unit's gathers for compute carry (quantize_weights, or quantize_frozen_weights
// for a frozen unit), 0 for exact gathers (and for a unit sharded over one rank: nothing crosses).
std::int64_t int8_block_for(const EngineOptions& o, const FetchUnitInfo& info);
// The block a trained unit's gradient reduction carries (quantize_gradients), 0 for exact, and
// its format (int8 or int4).
std::int64_t int8_gradient_block_for(const EngineOptions& o, const FetchUnitInfo& info);
modules::detail::BlockBits gradient_block_bits(const EngineOptions& o);
// The bytes quantized pieces of blocks of `block` elements in `bits`' format take for `bytes` bytes
// of `dtype` values (a gather's pieces beside its gathered parameters, a reduction's beside its
// gradient).
std::size_t int8_staging_bytes(std::int64_t block, DataType dtype, std::size_t bytes,
                               modules::detail::BlockBits bits = modules::detail::BlockBits::int8);

}  // namespace coshard::zero::detail
