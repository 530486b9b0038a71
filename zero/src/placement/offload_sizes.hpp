// The host buffers of an offloaded optimizer (and offloaded parameters), sized from the units'
// descriptions alone: the placements take them, and the plan's memory estimate counts them, from
// the same functions. Private: not installed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

// With the optimizer on nvme and a bf16/f16 dtype: whether the step rounds into a pinned staging
// buffer (a shard on the device, or a shard on nvme that a checkpoint visits).
bool shards_staged(std::span<const FetchUnitInfo> units, const EngineOptions& o);

// offload_optimizer=nvme: the most elements of a unit's shard one sub-group holds
// (EngineOptions::sub_group_size rounded up to whole pages of fp32; 0: a whole shard).
std::int64_t swap_piece_elements(const EngineOptions& o);
// The pinned bytes of a sub-group of `count` elements: each of its `regions` arrays (the master
// and the optimizer's state tensors; a frozen unit's master alone) from a page boundary.
std::size_t swap_piece_bytes(std::int64_t count, std::size_t regions);

// The optimizer's step state (Optimizer::step_state(): f32[8]), which an offloaded optimizer
// sends to the device through pinned memory at each step's start (the loss scale; the device part
// of the optimizer when a budget keeps units on the device).
inline constexpr std::size_t kStepStateBytes = 8 * sizeof(float);

// The pinned buffers an offloaded optimizer (and offloaded parameters) take, in bytes, each as
// the pool reserves it (optimizer_states: Optimizer::state_tensors()). Empty without offload.
std::vector<std::size_t> offload_pinned_sizes(std::span<const FetchUnitInfo> units, const EngineOptions& o,
                                              std::size_t optimizer_states);

}  // namespace coshard::zero::detail
