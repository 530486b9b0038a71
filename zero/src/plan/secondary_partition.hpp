// The secondary weight partition (ZeRO++'s hpZ, EngineOptions::secondary_partition_ranks): which
// units keep one, and the device memory their slices take. Private.
#pragma once

#include <cstddef>
#include <span>

#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

// The ranks a unit's later gathers of a step go over (EngineOptions::secondary_partition_ranks),
// 0 where it keeps no secondary slice: a unit sharded over that many ranks or fewer (nothing to
// save), a persistent one (never gathered again), a frozen one under keep_frozen_gathered (kept
// gathered through the step; where the budget has no room it gathers over its whole group, as
// without a secondary partition), stages 0-2.
int secondary_ranks_for(const EngineOptions& o, const FetchUnitInfo& info);
// The bytes every rank's slices take (each such unit's padded bytes / N), on the device.
std::size_t secondary_partition_bytes(const EngineOptions& o, std::span<const FetchUnitInfo> units);
// A unit's group nests the secondary groups (N divides it), or the unit is named (plan_fetch_units
// checks every unit as it plans it).
Result<void> check_secondary_group(const EngineOptions& o, const FetchUnitInfo& u);

}  // namespace coshard::zero::detail
