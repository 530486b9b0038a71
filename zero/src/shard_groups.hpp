// Shard groups (hybrid sharding): the ranks a unit is sharded over and the ranks holding the same
// block, as communicators split from the world once, at create. Their collectives are ordered
// within the world communicator's stream, so the rest of the engine keeps one communication
// stream and one order of collectives. Private: not installed.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "coshard/collectives/communicator.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

struct ShardGroup {
  int ranks = 1;     // the ranks a unit is sharded over
  int rank = 0;      // this rank's block among them
  int replicas = 1;  // the groups holding a copy of every block (world / ranks)
  int replica = 0;   // this rank's copy: copy 0 is the one a checkpoint writes and the norm counts
  collectives::Communicator* shard = nullptr;      // the group (the world itself when it is the world)
  collectives::Communicator* replicate = nullptr;  // the holders of the same block; null with one copy
  // Every rank holding the unit: the world, or an expert-parallel unit's run of world /
  // expert_parallel consecutive ranks (stage 0's all-reduce goes over it).
  collectives::Communicator* holders = nullptr;
  // FetchUnitInfo::expert_parallel: the copies above are within the run; the other runs hold
  // other experts, never reduced with these.
  int expert_parallel = 1;
};

class ShardGroups {
 public:
  // The groups of these units' sizes (FetchUnitInfo::shard_ranks, each dividing the world; every
  // rank plans the same): the world is split once for each size below it, into its shard groups
  // and, with several copies, the copies. `sharded` false (stage 0): nothing is split; a unit is
  // whole on every rank (one block, as many copies as ranks).
  // `secondary_ranks` above 1 (EngineOptions::secondary_partition_ranks): also the groups of
  // that many consecutive ranks a secondary partition gathers within (a shard group of that size
  // where units have one; else a split of its own, without copies).
  static Result<std::unique_ptr<ShardGroups>> create(collectives::Communicator& world,
                                                     std::span<const FetchUnitInfo> units, bool sharded,
                                                     int secondary_ranks = 1);
  // A unit's groups (by its shard_ranks and expert_parallel).
  const ShardGroup& of(const FetchUnitInfo& unit) const { return groups_.at({unit.expert_parallel, unit.shard_ranks}); }
  // The secondary partition's group (its `shard`), null without one.
  const ShardGroup* secondary() const noexcept { return secondary_ ? &*secondary_ : nullptr; }
  // Groups launched on the split communicators so far (the world's own are the world's).
  std::uint64_t launches() const noexcept {
    std::uint64_t n = 0;
    for (const auto& c : split_) n += c->launches();
    return n;
  }

 private:
  // The world split by `color` once (the same colors give the same communicator).
  Result<collectives::Communicator*> split_once(collectives::Communicator& world, const std::string& name, int color);
  std::vector<std::unique_ptr<collectives::Communicator>> split_;
  std::map<std::string, collectives::Communicator*> by_name_;
  std::map<std::pair<int, int>, ShardGroup> groups_;  // by (expert_parallel, shard ranks)
  std::optional<ShardGroup> secondary_;
};

// `group` enqueued on `sub`, ordered within `world`'s stream: after what that stream holds, and
// what is enqueued there next waits for it. Launched as it is when sub is the world.
Result<async::Event> launch_within(collectives::Communicator& world, collectives::Communicator& sub,
                                   const collectives::Coalesced& group);

// Whether every rank planned the same units (names, sizes, shard groups), before anything is
// allocated: a split by a hash of the plan (a setup collective), and an error on every rank
// naming how many ranks share this one's plan when they do not all agree.
Result<void> check_ranks_agree(collectives::Communicator& world, std::span<const FetchUnitInfo> units);

}  // namespace coshard::zero::detail
