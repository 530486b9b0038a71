// The offloaded optimizer's host buffers (offload_sizes.hpp).
#include "placement/offload_sizes.hpp"

#include <algorithm>
#include <limits>

#include "coshard/offload/pinned_pool.hpp"

namespace coshard::zero::detail {

bool shards_staged(std::span<const FetchUnitInfo> units, const EngineOptions& o) {
  if (o.offload_params == OffloadTarget::nvme) return true;
  return std::any_of(units.begin(), units.end(), [](const FetchUnitInfo& u) { return !u.shard_offloaded; });
}

std::int64_t swap_piece_elements(const EngineOptions& o) {
  const std::size_t page_floats = offload::page_rounded(1) / sizeof(float);
  if (o.sub_group_size == 0 || o.sub_group_size > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max() / 2))
    return std::numeric_limits<std::int64_t>::max();
  return static_cast<std::int64_t>((o.sub_group_size + page_floats - 1) / page_floats * page_floats);
}

std::size_t swap_piece_bytes(std::int64_t count, std::size_t regions) {
  return regions * offload::page_rounded(static_cast<std::size_t>(count) * sizeof(float));
}

std::vector<std::size_t> offload_pinned_sizes(std::span<const FetchUnitInfo> units, const EngineOptions& o,
                                              std::size_t optimizer_states) {
  std::vector<std::size_t> sizes;
  if (o.offload_optimizer == OffloadTarget::none) return sizes;
  const bool swapped = o.offload_optimizer == OffloadTarget::nvme;
  const bool narrow = o.dtype != DataType::f32;
  const bool staged = swapped && narrow && shards_staged(units, o);
  const std::size_t element_size = size_of(o.dtype);
  std::size_t largest_group = 0, largest_shard = 0, largest_master = 0;
  for (const auto& u : units) {
    const auto shard_bytes = static_cast<std::size_t>(u.shard) * element_size;
    const auto f32_bytes = static_cast<std::size_t>(u.shard) * sizeof(float);
    largest_shard = std::max(largest_shard, shard_bytes);
    largest_master = std::max(largest_master, f32_bytes);
    const bool pinned_shard = o.offload_params == OffloadTarget::cpu && u.shard_offloaded;
    if (pinned_shard && swapped) sizes.push_back(shard_bytes);  // the pinned shard
    if (!u.frozen && !u.optimizer_offloaded) continue;  // stepped on the device (a budget kept it there)
    const std::int64_t piece = std::min<std::int64_t>(u.shard, swap_piece_elements(o));
    if (u.frozen) {  // never stepped: no gradient, master or state (its file holds the master only)
      if (swapped) largest_group = std::max(largest_group, swap_piece_bytes(piece, 1));
      else if (pinned_shard) sizes.push_back(shard_bytes);  // the pinned shard
      continue;
    }
    if (swapped && (o.step_in_backward || o.swap_gradients)) {  // the gradient goes through the swap buffer
      largest_group = std::max(largest_group, swap_piece_bytes(piece, 2 + optimizer_states));
    } else if (swapped) {  // a resident gradient shard; master and state stream through buffers
      sizes.push_back(f32_bytes);
      largest_group = std::max(largest_group, swap_piece_bytes(piece, 1 + optimizer_states));
    } else if (narrow) {
      // The gradient shard and the bf16/f16 copy the step writes; the fp32 master never goes to
      // the device, so the optimizer keeps it in ordinary host memory.
      sizes.insert(sizes.end(), {f32_bytes, shard_bytes});
    } else {
      sizes.insert(sizes.end(), {f32_bytes, f32_bytes});  // the master (the shard's copy) and the gradient
    }
  }
  if (staged) sizes.push_back(largest_shard);
  if (swapped)
    for (int b = 0; b < o.offload_optimizer.buffer_count; ++b) sizes.push_back(largest_group);
  if (o.offload_params == OffloadTarget::nvme)  // the read-ahead buffers, read as the fp32 master
    for (int b = 0; b < o.offload_params.buffer_count; ++b) sizes.push_back(largest_master);
  sizes.push_back(2 * sizeof(float));  // the gradient statistics on their way to the device and back
  sizes.push_back(kStepStateBytes);    // the host's step state on its way to the device (the loss scale)
  return sizes;
}

}  // namespace coshard::zero::detail
