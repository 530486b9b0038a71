#include "shard_groups.hpp"

#include <algorithm>
#include <set>
#include <string>

namespace coshard::zero::detail {

Result<std::unique_ptr<ShardGroups>> ShardGroups::create(collectives::Communicator& world,
                                                         std::span<const FetchUnitInfo> units, bool sharded,
                                                         int secondary_ranks) {
  auto groups = std::make_unique<ShardGroups>();
  const int rank = world.rank(), n = world.size();
  std::set<int> sizes;  // (in order: every rank splits alike)
  for (const auto& u : units) sizes.insert(u.shard_ranks);
  for (const int size : sizes) {
    if (size < 1 || n % size != 0)
      return fail(ErrorCode::invalid_argument, "shard group size ", size, ": expected a divisor of the world size ", n);
    ShardGroup g;
    if (!sharded) {  // stage 0: every rank holds the whole unit
      g = {.ranks = 1, .rank = 0, .replicas = n, .replica = rank};
      groups->groups_.emplace(size, g);
      continue;
    }
    g = {.ranks = size, .rank = rank % size, .replicas = n / size, .replica = rank / size, .shard = &world};
    if (size < n) {
      // Shard groups are runs of consecutive ranks (a node's, under a launcher that numbers ranks
      // node by node); the copies of a block are the ranks at the same place in each run.
      COSHARD_TRY_ASSIGN(auto shard, world.split(rank / size, rank));
      COSHARD_TRY(collectives::label_split(world, *shard, "shard" + std::to_string(size) + "-" + std::to_string(rank / size)));
      g.shard = shard.get();
      groups->split_.push_back(std::move(shard));
    }
    if (g.replicas > 1) {
      COSHARD_TRY_ASSIGN(auto copies, world.split(rank % size, rank));
      COSHARD_TRY(collectives::label_split(world, *copies, "copies" + std::to_string(size) + "-" + std::to_string(rank % size)));
      g.replicate = copies.get();
      groups->split_.push_back(std::move(copies));
    }
    if (g.shard->size() != size || (g.replicate && g.replicate->size() != g.replicas))
      return fail(ErrorCode::internal, "shard group size ", size, ": the split gave groups of ", g.shard->size(), " and ",
                  g.replicate ? g.replicate->size() : 1, " ranks");
    groups->groups_.emplace(size, g);
  }
  if (sharded && secondary_ranks > 1 && secondary_ranks < n) {
    if (n % secondary_ranks != 0)
      return fail(ErrorCode::invalid_argument, "secondary partition of ", secondary_ranks,
                  " ranks: expected a divisor of the world size ", n);
    if (const auto same = groups->groups_.find(secondary_ranks); same != groups->groups_.end()) {
      groups->secondary_ = same->second;
    } else {  // (runs of consecutive ranks, as the shard groups: a node's)
      COSHARD_TRY_ASSIGN(auto within, world.split(rank / secondary_ranks, rank));
      COSHARD_TRY(collectives::label_split(world, *within,
                                           "secondary" + std::to_string(secondary_ranks) + "-" + std::to_string(rank / secondary_ranks)));
      groups->secondary_ = ShardGroup{.ranks = secondary_ranks, .rank = rank % secondary_ranks,
                                      .replicas = n / secondary_ranks, .replica = rank / secondary_ranks,
                                      .shard = within.get()};
      groups->split_.push_back(std::move(within));
    }
  }
  return groups;
}

Result<async::Event> launch_within(collectives::Communicator& world, collectives::Communicator& sub,
                                   const collectives::Coalesced& group) {
  if (&sub == &world) return world.launch(group);
  auto& stream = world.stream();
  COSHARD_TRY_ASSIGN(auto before, stream.record());
  COSHARD_TRY(sub.stream().wait(before));
  COSHARD_TRY_ASSIGN(auto done, sub.launch(group));
  COSHARD_TRY(stream.wait(done));
  return stream.record();
}

Result<void> check_ranks_agree(collectives::Communicator& world, std::span<const FetchUnitInfo> units) {
  if (world.size() == 1) return {};
  // FNV-1a over what every rank must share: each unit's name, size and shard group.
  std::uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&](const void* data, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) hash = (hash ^ static_cast<const unsigned char*>(data)[i]) * 0x100000001b3ull;
  };
  for (const auto& u : units) {
    mix(u.name.data(), u.name.size() + 1);
    mix(&u.numel, sizeof u.numel);
    mix(&u.shard_ranks, sizeof u.shard_ranks);
  }
  COSHARD_TRY_ASSIGN(auto same, world.split(static_cast<int>(hash & 0x3fffffff), world.rank()));
  if (same && same->size() == world.size()) return {};
  std::string groups;
  int shown = 0;
  for (const auto& u : units)
    if (u.shard_ranks != world.size() && shown++ < 4) groups += (groups.empty() ? "" : ", ") + u.name + " over " + std::to_string(u.shard_ranks);
  if (groups.empty()) groups = "every unit over the whole world";
  return fail(ErrorCode::invalid_argument, "Engine: the ranks planned different units or shard groups: this rank's plan (",
              units.size(), " units; ", groups, ") is shared by ", same ? same->size() : 0, " of ", world.size(),
              " ranks (the model, module_granularity_bytes, shard_group_size and shard_group_size_of must be the same "
              "on every rank)");
}

}  // namespace coshard::zero::detail
