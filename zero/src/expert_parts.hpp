// Expert parallelism's whole model (Engine's export and load): each run of ranks holds other
// experts of every SparseMoe (their Parameter::expert_parallel), under their own names
// ("h0.mlp.moe.experts.5.down.weight"). An export puts every run's experts together; a load from a
// whole model's file takes this rank's. Private: not installed.
#pragma once

#include <string>
#include <unordered_set>
#include <vector>

#include "coshard/modules/moe.hpp"
#include "coshard/zero/engine.hpp"
#include "rank_exchange.hpp"

namespace coshard::zero::detail {

// Each expert rank's `mine` (the same length on every rank), as the first rank of its run of
// world / `expert_ranks` consecutive ranks gave it (every rank of a run holds the same experts): one
// all-gather over `world`. [q]: expert rank q's; this rank's own entry is empty.
async::Task<Result<std::vector<std::vector<std::int64_t>>>> from_every_expert_rank(RankExchange& world, int rank,
                                                                                   int expert_ranks,
                                                                                   std::vector<std::int64_t> mine);

// The names of the experts other expert-parallel ranks hold (in a whole model's file, not this
// rank's model): empty without expert parallelism.
std::unordered_set<std::string> experts_elsewhere(modules::Module& model);

// `mine` (this rank's gathered parameters: the dense ones and its run's experts) with every other
// run's experts added (the run of world / P consecutive ranks q holds expert rank q's): one
// all-gather of the expert bytes over `world`. Unchanged without expert parallelism.
async::Task<Result<std::vector<GatheredParameter>>> with_every_expert(RankExchange& world, int rank, modules::Module& model,
                                                                      std::vector<GatheredParameter> mine);

}  // namespace coshard::zero::detail
