#include "shard_groups.hpp"

#include <algorithm>
#include <set>
#include <string>

namespace coshard::zero::detail {

Result<collectives::Communicator*> ShardGroups::split_once(collectives::Communicator& world, const std::string& name,
                                                           int color) {
  if (auto it = by_name_.find(name); it != by_name_.end()) return it->second;
  COSHARD_TRY_ASSIGN(auto comm, world.split(color, world.rank()));
  COSHARD_TRY(collectives::label_split(world, *comm, name));
  collectives::Communicator* c = comm.get();
  split_.push_back(std::move(comm));
  by_name_.emplace(name, c);
  return c;
}

Result<std::unique_ptr<ShardGroups>> ShardGroups::create(collectives::Communicator& world,
                                                         std::span<const FetchUnitInfo> units, bool sharded,
                                                         int secondary_ranks) {
  auto groups = std::make_unique<ShardGroups>();
  const int rank = world.rank(), n = world.size();
  std::set<std::pair<int, int>> keys;  // (in order: every rank splits alike)
  for (const auto& u : units) keys.insert({u.expert_parallel, u.shard_ranks});
  for (const auto& [experts, size] : keys) {
    if (experts < 1 || n % experts != 0)
      return fail(ErrorCode::invalid_argument, "expert-parallel size ", experts, ": expected a divisor of the world size ", n);
    // The ranks holding such a unit: runs of `run` consecutive ranks (the world without experts).
    const int run = n / experts, run_index = rank / run, in_run = rank % run;
    if (size < 1 || run % size != 0)
      return fail(ErrorCode::invalid_argument, "shard group size ", size, ": expected a divisor of ", run,
                  experts > 1 ? " (the ranks holding an expert: world / expert-parallel size)" : " (the world size)");
    collectives::Communicator* holders = &world;
    if (run < n) {
      COSHARD_TRY_ASSIGN(holders, groups->split_once(world, "experts" + std::to_string(experts) + "-" + std::to_string(run_index), run_index));
    }
    ShardGroup g;
    if (!sharded) {  // stage 0: every rank holds the whole unit
      g = {.ranks = 1, .rank = 0, .replicas = run, .replica = in_run, .holders = holders, .expert_parallel = experts};
      groups->groups_.emplace(std::pair{experts, size}, g);
      continue;
    }
    g = {.ranks = size, .rank = rank % size, .replicas = run / size, .replica = in_run / size, .shard = &world,
         .holders = holders, .expert_parallel = experts};
    if (size < n) {
      // Shard groups are runs of consecutive ranks (a node's, under a launcher that numbers ranks
      // node by node); the copies of a block are the ranks at the same place in each run.
      COSHARD_TRY_ASSIGN(g.shard, groups->split_once(world, "shard" + std::to_string(size) + "-" + std::to_string(rank / size), rank / size));
    }
    if (g.replicas > 1) {
      // (within the run of holders: copy q of block b is rank run_index * run + q * size + b)
      const int color = run_index * size + rank % size;
      COSHARD_TRY_ASSIGN(g.replicate, groups->split_once(world, (experts > 1 ? "expert-copies" + std::to_string(experts) + "-" : std::string("copies")) +
                                                                    std::to_string(size) + "-" + std::to_string(color), color));
    }
    if (g.shard->size() != size || (g.replicate && g.replicate->size() != g.replicas))
      return fail(ErrorCode::internal, "shard group size ", size, ": the split gave groups of ", g.shard->size(), " and ",
                  g.replicate ? g.replicate->size() : 1, " ranks");
    groups->groups_.emplace(std::pair{experts, size}, g);
  }
  if (sharded && secondary_ranks > 1 && secondary_ranks < n) {
    if (n % secondary_ranks != 0)
      return fail(ErrorCode::invalid_argument, "secondary partition of ", secondary_ranks,
                  " ranks: expected a divisor of the world size ", n);
    if (const auto same = groups->groups_.find({1, secondary_ranks}); same != groups->groups_.end()) {
      groups->secondary_ = same->second;
    } else {  // (runs of consecutive ranks, as the shard groups: a node's)
      COSHARD_TRY_ASSIGN(auto* within, groups->split_once(world, "secondary" + std::to_string(secondary_ranks) + "-" +
                                                                     std::to_string(rank / secondary_ranks),
                                                          rank / secondary_ranks));
      groups->secondary_ = ShardGroup{.ranks = secondary_ranks, .rank = rank % secondary_ranks,
                                      .replicas = n / secondary_ranks, .replica = rank / secondary_ranks,
                                      .shard = within, .holders = &world};
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
    // (an expert-parallel unit holds other experts on other runs of ranks: its name differs)
    if (u.expert_parallel == 1) mix(u.name.data(), u.name.size() + 1);
    mix(&u.numel, sizeof u.numel);
    mix(&u.shard_ranks, sizeof u.shard_ranks);
    mix(&u.expert_parallel, sizeof u.expert_parallel);
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
