// Where each unit's parameter shard lives: off the device with parameter offload, and with a
// device_memory_budget, on the device for as many units as fit beside the rest of the plan
// (EngineOptions::device_memory_budget). Decided with the units, before anything is allocated,
// so the memory estimate, the pinned plan and the engine see one placement.
#include <algorithm>

#include "fetch_units.hpp"

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

Result<void> place_shards(std::vector<PlannedUnit>& units, const EngineOptions& o) {
  for (auto& u : units) u.info.shard_offloaded = o.offload_params != OffloadTarget::none;
  if (o.device_memory_budget == 0) return {};
  if (o.offload_params != OffloadTarget::cpu)
    return fail(ErrorCode::invalid_argument, "device_memory_budget=", o.device_memory_budget, " with offload_params=",
                to_string(o.offload_params),
                ": the budget places parameter shards between the device and pinned host memory "
                "(expected offload_params=cpu)");
  // Everything else the plan keeps on the device, with every shard offloaded (the optimizer is
  // offloaded too, so its state count does not matter here).
  const std::size_t rest = estimate_for_units(infos_of(units), o, 0).bytes(MemoryPlace::device);
  if (rest > o.device_memory_budget)
    return fail(ErrorCode::out_of_memory, "device_memory_budget=", o.device_memory_budget, " (",
                format_bytes(o.device_memory_budget), "): the plan needs ", rest, " bytes (", format_bytes(rest),
                ") on the device with every parameter shard offloaded (gathered parameters, gradient buffers); "
                "raise the budget, or lower max_live_bytes");
  std::size_t used = rest;
  const std::size_t element_size = size_of(o.dtype);
  for (const std::size_t i : keep_order(units.size())) {
    const auto bytes = static_cast<std::size_t>(units[i].info.shard) * element_size;
    if (used + bytes > o.device_memory_budget) continue;  // a smaller one further in may still fit
    used += bytes;
    units[i].info.shard_offloaded = false;
  }
  return {};
}

}  // namespace coshard::zero::detail
