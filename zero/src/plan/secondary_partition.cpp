#include "plan/secondary_partition.hpp"

#include <string>

namespace coshard::zero {

Result<void> check_secondary_partition(const EngineOptions& o, int world) {
  const int n = o.secondary_partition_ranks;
  if (n < 1)
    return fail(ErrorCode::invalid_argument, "secondary_partition_ranks=", n,
                ": expected 1 (none) or a whole number that divides the world size (the ranks of a node)");
  if (n == 1) return {};
  if (o.zero_stage != 3)
    return fail(ErrorCode::invalid_argument, "secondary_partition_ranks=", n, " with zero_stage=", o.zero_stage,
                ": stages 0-2 keep whole copies and gather no weights within a step (expected zero_stage 3)");
  if (world > 0 && world % n != 0)
    return fail(ErrorCode::invalid_argument, "secondary_partition_ranks=", n, ": expected a divisor of the world size ",
                world, " (the engine's ranks: with tensor parallelism, the data ranks)");
  if (o.shard_group_size > n && o.shard_group_size % n != 0)
    return fail(ErrorCode::invalid_argument, "secondary_partition_ranks=", n, " with shard_group_size=",
                o.shard_group_size, ": expected a divisor of the shard group size (the slices are held within it)");
  return {};
}

namespace detail {

int secondary_ranks_for(const EngineOptions& o, const FetchUnitInfo& info) {
  const int n = o.secondary_partition_ranks;
  // (a frozen unit under keep_frozen_gathered stays gathered through the step where the budget
  // has room: a slice of it would only take memory)
  const bool kept = info.persistent || (info.frozen && o.keep_frozen_gathered);
  return o.zero_stage == 3 && n > 1 && info.shard_ranks > n && !kept ? n : 0;
}

std::size_t secondary_partition_bytes(const EngineOptions& o, std::span<const FetchUnitInfo> units) {
  std::size_t bytes = 0;
  for (const auto& u : units)
    if (const int n = secondary_ranks_for(o, u); n > 0) bytes += u.padded_bytes / static_cast<std::size_t>(n);
  return bytes;
}

Result<void> check_secondary_group(const EngineOptions& o, const FetchUnitInfo& u) {
  if (const int n = secondary_ranks_for(o, u); n > 0 && u.shard_ranks % n != 0)
    return fail(ErrorCode::invalid_argument, "secondary_partition_ranks=", n, ": unit ", u.name, " is sharded over ",
                u.shard_ranks, " ranks (shard_group_size_of), which ", n,
                " does not divide (expected a divisor of every shard group larger than it)");
  return {};
}

}  // namespace detail
}  // namespace coshard::zero
