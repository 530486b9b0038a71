// The units a checkpoint lists (Engine::save_checkpoint): this rank's plan, but for expert
// parallelism, where each run of world / P ranks holds other experts: each of this rank's
// expert-parallel units is listed once for every expert rank q, under q's names, its blocks in
// the files of q's run (CheckpointManifest::Unit::first_file), in the order the experts have in
// the whole model (expert 0 first), so that a run without expert parallelism finds its units in
// its own order. Private: not installed.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/modules/module.hpp"
#include "coshard/zero/engine.hpp"
#include "rank_exchange.hpp"

namespace coshard::zero::detail {

struct SavedUnits {
  struct Entry {
    std::size_t unit = 0;  // the plan unit it describes (for another expert rank: the one in the same place)
    int first_file = 0;
    std::string name;
    std::vector<std::string> parameters;
  };
  std::vector<Entry> entries;       // the manifest's units, in order
  std::vector<std::size_t> key_of;  // per plan unit: its entry (its blocks are "u<key>" in the files)
};

SavedUnits saved_units(std::span<const FetchUnitInfo> units, modules::Module& model, int rank, int world);

// The steps each expert parameter of the other expert ranks missed, by name (rank 0's manifest
// lists every expert): one exchange over `world` of every rank's counts. `own`: this rank's
// parameters' counts by name. Empty without expert parallelism.
async::Task<Result<std::map<std::string, std::int64_t>>> steps_missed_elsewhere(
    RankExchange& world, int rank, modules::Module& model, std::map<std::string, std::int64_t> own);

}  // namespace coshard::zero::detail
