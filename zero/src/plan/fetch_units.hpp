// What an engine over a model will hold, known before it holds anything: its fetch units, where
// each one's shard and optimizer state live (device_budget.cpp), and the memory that takes
// (memory_estimate.cpp; the offloaded optimizer's pinned buffers are placement/offload_sizes.hpp).
// Engine::create builds from it, and the memory estimate counts from it, so the two cannot drift
// apart. Private: not installed.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "coshard/zero/engine.hpp"
#include "coshard/zero/memory_estimate.hpp"

namespace coshard::zero::detail {

struct PlannedParameter {
  Parameter* parameter;
  std::int64_t offset;  // elements into the unit's buffer
};

struct PlannedUnit {
  FetchUnitInfo info;
  std::vector<Module*> modules;            // forward order
  std::vector<PlannedParameter> parameters;
};

struct FetchPlan {
  std::unordered_map<const Parameter*, std::string> names;
  std::vector<PlannedUnit> units;
  std::size_t largest_unit_bytes = 0;
};

// The shard group size of the module at `module_path` (EngineOptions::shard_group_size_of, else
// shard_group_size, else the world), or an error naming the value when it does not divide the world.
Result<int> shard_group_size(const EngineOptions& o, int world_size, std::string_view module_path);

// Units: modules with direct parameters, in execution (pre-order) order; consecutive small leaves
// merge (module_granularity_bytes). Fails on a model without parameters, and at stage 3 when
// max_live_bytes cannot hold the largest unit.
// optimizer_states (Optimizer::state_tensors()) sizes the optimizer state a device budget places.
Result<FetchPlan> plan_fetch_units(Module& model, int world_size, const EngineOptions& o, std::size_t optimizer_states);

// The units' descriptions alone.
std::vector<FetchUnitInfo> infos_of(std::span<const PlannedUnit> units);

// Where each unit's shard and optimizer state live (FetchUnitInfo::shard_offloaded,
// optimizer_offloaded): off the device with offload, and with a device_memory_budget, on the
// device for as many units as fit (device_budget.cpp; optimizer_states: Optimizer::state_tensors()).
Result<void> place_by_budget(std::vector<PlannedUnit>& units, const EngineOptions& o, std::size_t optimizer_states);

// The memory estimate of a plan already made (estimate_engine_memory plans first; Engine::create
// has its units and estimates from them, without walking the model again).
MemoryEstimate estimate_for_units(std::span<const FetchUnitInfo> units, const EngineOptions& o,
                                  std::size_t optimizer_states);

}  // namespace coshard::zero::detail
