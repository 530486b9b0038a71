// Where each unit's parameter shard and optimizer state live: off the device with offload, and
// with a device_memory_budget, on the device for as many units as fit beside the rest of the plan
// (EngineOptions::device_memory_budget). Decided with the units, before anything is allocated,
// so the memory estimate, the pinned plan and the engine see one placement.
#include <algorithm>

#include "plan/fetch_units.hpp"

namespace coshard::zero::detail {

namespace {

// The first and the last units first, alternating inwards: the gathers that open forward and
// backward have no compute before them to hide behind; the middle ones are prefetched.
std::vector<std::size_t> keep_order(std::size_t n) {
  std::vector<std::size_t> order;
  for (std::size_t lo = 0, hi = n; lo < hi;) {
    order.push_back(lo++);
    if (lo < hi) order.push_back(--hi);
  }
  return order;
}

}  // namespace

std::vector<FetchUnitInfo> infos_of(std::span<const PlannedUnit> units) {
  std::vector<FetchUnitInfo> infos;
  infos.reserve(units.size());
  for (const auto& u : units) infos.push_back(u.info);
  return infos;
}

Result<void> place_by_budget(std::vector<PlannedUnit>& units, const EngineOptions& o, std::size_t optimizer_states) {
  for (auto& u : units) {
    u.info.shard_offloaded = o.offload_params != OffloadTarget::none;
    u.info.optimizer_offloaded = o.offload_optimizer != OffloadTarget::none;
  }
  if (o.device_memory_budget == 0) return {};
  const bool places_shards = o.offload_params == OffloadTarget::cpu;
  const bool places_state = o.offload_optimizer == OffloadTarget::cpu;
  if (!places_shards && !places_state)
    return fail(ErrorCode::invalid_argument, "device_memory_budget=", o.device_memory_budget, " with offload_params=",
                to_string(o.offload_params), " and offload_optimizer=", to_string(o.offload_optimizer),
                ": the budget places parameter shards and optimizer state between the device and pinned host "
                "memory (expected offload_params=cpu, or offload_optimizer=cpu)");
  // Everything else the plan keeps on the device, with everything offloaded that may be.
  auto infos = infos_of(units);
  const auto device_bytes = [&] { return estimate_for_units(infos, o, optimizer_states).bytes(MemoryPlace::device); };
  const std::size_t rest = device_bytes();
  if (rest > o.device_memory_budget)
    return fail(ErrorCode::out_of_memory, "device_memory_budget=", o.device_memory_budget, " (",
                format_bytes(o.device_memory_budget), "): the plan needs ", rest, " bytes (", format_bytes(rest),
                ") on the device with every parameter shard and optimizer state offloaded that may be (gathered "
                "parameters, gradient buffers", places_shards ? "" : ", parameter shards",
                "); raise the budget, or lower max_live_bytes");
  // Shards first: their bytes are the same in every line but their own.
  std::size_t used = rest;
  const std::size_t element_size = size_of(o.dtype);
  if (places_shards) {
    for (const std::size_t i : keep_order(units.size())) {
      const auto bytes = static_cast<std::size_t>(units[i].info.shard) * element_size;
      if (used + bytes > o.device_memory_budget) continue;  // a smaller one further in may still fit
      used += bytes;
      units[i].info.shard_offloaded = infos[i].shard_offloaded = false;
    }
  }
  // Then the optimizer state of units whose shards are on the device: what keeping one adds (its
  // state, master and resident gradient shard, less what the gradients in flight no longer hold)
  // is the estimate's own difference.
  if (places_state) {
    for (const std::size_t i : keep_order(units.size())) {
      if (infos[i].shard_offloaded || infos[i].frozen) continue;
      infos[i].optimizer_offloaded = false;
      if (device_bytes() > o.device_memory_budget) {
        infos[i].optimizer_offloaded = true;
        continue;
      }
      units[i].info.optimizer_offloaded = false;
    }
  }
  return {};
}

}  // namespace coshard::zero::detail
