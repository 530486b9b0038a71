#include "plan/fetch_units.hpp"
#include "plan/quantized_gathers.hpp"
#include "plan/secondary_partition.hpp"

#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/moe.hpp"
#include "coshard/offload/pinned_pool.hpp"

#include <algorithm>
#include <functional>
#include <limits>
#include <unordered_map>
#include <unordered_set>

namespace coshard::zero::detail {

using namespace modules;

Result<int> shard_group_size(const EngineOptions& o, int world_size, std::string_view module_path) {
  const int asked = o.shard_group_size_of ? o.shard_group_size_of(module_path) : 0;
  const int size = asked != 0 ? asked : o.shard_group_size != 0 ? o.shard_group_size : world_size;
  if (size >= 1 && size <= world_size && world_size % size == 0) return size;
  const std::string where = asked != 0 ? "shard_group_size_of(\"" + std::string(module_path) + "\")=" : "shard_group_size=";
  return fail(ErrorCode::invalid_argument, where, size, ": expected a divisor of the world size ", world_size,
              " (the ranks a unit is sharded over, in world / size groups of consecutive ranks; 0: the whole world)");
}

namespace {

// A module with parameters of its own, as the planning sees it.
struct Candidate {
  std::string path;
  Module* module;
  std::size_t bytes;
  bool leaf;
  bool alone;  // runs more than once a pass: its own unit
  int region;  // the checkpointed block it lies in (0: none)
  int shard_ranks;  // its shard group's size
  bool split;       // its parameters are tensor-parallel parts
  int expert_parallel = 1;  // its parameters' Parameter::expert_parallel
};

// An expert-parallel module's shard group: within its run of world / expert_parallel consecutive
// ranks (the ranks holding the same experts), hybrid sharding's size where it divides the run.
Result<int> expert_shard_group_size(const EngineOptions& o, int world_size, int expert_parallel,
                                    std::string_view module_path) {
  if (world_size % expert_parallel != 0)
    return fail(ErrorCode::invalid_argument, "Engine: module ", module_path, " is expert-parallel over ", expert_parallel,
                " ranks, which does not divide the world size ", world_size, " (expected a divisor of ", world_size, ")");
  const int run = world_size / expert_parallel;
  const int asked = o.shard_group_size_of ? o.shard_group_size_of(module_path) : 0;
  if (asked != 0 && (asked < 1 || run % asked != 0))
    return fail(ErrorCode::invalid_argument, "shard_group_size_of(\"", module_path, "\")=", asked,
                ": expected a divisor of ", run, ", the ranks holding this expert (world ", world_size,
                " / expert-parallel ", expert_parallel, ")");
  if (asked != 0) return asked;
  return o.shard_group_size != 0 && run % o.shard_group_size == 0 ? o.shard_group_size : run;
}

// A unit never spans two checkpointed blocks, or one and the rest of the model: a recompute
// runs the block's modules alone, and must meet each of its units' first and last module. The
// same holds for a container that runs more than once a pass: each use meets its units whole,
// and for a mixture-of-experts layer's experts (below).
// Each module's region (0: none).
std::unordered_map<const Module*, int> regions_of(Module& model) {
  std::unordered_map<const Module*, int> region;
  int regions = 0;
  // Each expert of a mixture-of-experts layer too: it runs only where tokens are routed to it, so
  // a unit holding a part of two experts (or of one and its router) would be gathered for either.
  std::unordered_set<const Module*> experts;
  model.for_each_module([&](const std::string&, Module& m) {
    if (auto* moe = dynamic_cast<const SparseMoe*>(&m))
      for (std::int64_t e = 0; e < moe->options().experts; ++e)
        if (const Module* expert = moe->expert(e)) experts.insert(expert);
  });
  std::function<void(Module&, int)> mark = [&](Module& m, int r) {
    if (dynamic_cast<const Checkpointed*>(&m) || (!m.children().empty() && m.runs_more_than_once_per_pass()) ||
        experts.contains(&m))
      r = ++regions;
    region[&m] = r;
    for (const auto& c : m.children()) mark(*c.module, r);
  };
  mark(model, 0);
  return region;
}

// The modules with parameters, in execution (pre-order) order; a module mixing tensor-parallel
// parts with replicated parameters, or given a shard group size that does not divide the world,
// is refused by name.
Result<std::vector<Candidate>> candidates_of(Module& model, int world_size, const EngineOptions& o) {
  const std::size_t element_size = size_of(o.dtype);
  const auto region = regions_of(model);
  // A module whose parameters another one declares it uses is fetched for that one too: its own unit.
  std::unordered_set<const Module*> borrowed;
  model.for_each_module([&](const std::string&, Module& m) {
    for (const Module* owner : m.borrowed()) borrowed.insert(owner);
  });
  std::vector<Candidate> candidates;
  Result<void> sized;
  model.for_each_module([&](const std::string& path, Module& m) {
    if (m.parameters().empty()) return;
    std::int64_t n = 0;
    std::size_t split = 0;
    for (const auto& p : m.parameters()) {
      n += p->numel();
      split += p->split() ? 1 : 0;
    }
    if (split != 0 && split != m.parameters().size()) {
      // (the norm counts a unit's elements on every tensor rank or on rank 0 only: not a mix)
      if (sized) {
        std::string names;
        for (const auto& p : m.parameters()) names += (names.empty() ? "" : ", ") + p->name() + (p->split() ? " (split)" : " (replicated)");
        sized = fail(ErrorCode::invalid_argument, "Engine: module ", path.empty() ? "(the model)" : path,
                     " mixes tensor-parallel parts and replicated parameters (", names,
                     "): give the replicated ones a module of their own");
      }
      return;
    }
    const int expert_parallel = m.parameters().front()->expert_parallel();
    for (const auto& p : m.parameters())
      if (p->expert_parallel() != expert_parallel) {
        if (sized)
          sized = fail(ErrorCode::invalid_argument, "Engine: module ", path.empty() ? "(the model)" : path,
                       " mixes expert-parallel parameters (over ", expert_parallel, " and ", p->expert_parallel(),
                       " ranks): give each its own module");
        return;
      }
    auto ranks = expert_parallel > 1 ? expert_shard_group_size(o, world_size, expert_parallel, path)
                                     : shard_group_size(o, world_size, path);
    if (!ranks) {
      if (sized) sized = fail(std::move(ranks).error());
      return;
    }
    candidates.push_back({path.empty() ? m.type_name().data() : path, &m, static_cast<std::size_t>(n) * element_size,
                          m.children().empty(), m.runs_more_than_once_per_pass() || borrowed.contains(&m),
                          region.at(&m), o.zero_stage == 0 ? 1 : *ranks, split != 0, expert_parallel});
  });
  COSHARD_TRY(sized);
  if (candidates.empty()) return fail(ErrorCode::invalid_argument, "Engine: the model has no parameters");
  return candidates;
}

// The candidates grouped into units: consecutive small leaves of one region, shard group and
// split merge up to module_granularity_bytes.
std::vector<std::vector<Candidate>> group_candidates(const std::vector<Candidate>& candidates, const EngineOptions& o) {
  std::vector<std::vector<Candidate>> groups;
  std::size_t group_bytes = 0;
  for (const auto& c : candidates) {
    const bool small = c.leaf && !c.alone && c.bytes < o.module_granularity_bytes;
    const bool open = !groups.empty() && groups.back().back().leaf && !groups.back().back().alone &&
                      groups.back().back().region == c.region && groups.back().back().shard_ranks == c.shard_ranks &&
                      groups.back().back().split == c.split && groups.back().back().expert_parallel == c.expert_parallel &&
                      groups.back().back().bytes < o.module_granularity_bytes && group_bytes < o.module_granularity_bytes;
    if (small && open) {
      groups.back().push_back(c);
      group_bytes += c.bytes;
    } else {
      groups.push_back({c});
      group_bytes = c.bytes;
    }
  }
  return groups;
}

}  // namespace

Result<FetchPlan> plan_fetch_units(Module& model, int world_size, const EngineOptions& o, std::size_t optimizer_states) {
  COSHARD_TRY(check_secondary_partition(o, world_size));  // (Engine::create and the estimates plan here)
  FetchPlan plan;
  const std::size_t element_size = size_of(o.dtype);
  model.for_each_parameter([&](const std::string& name, Parameter& p) { plan.names.emplace(&p, name); });
  COSHARD_TRY_ASSIGN(const auto candidates, candidates_of(model, world_size, o));
  const auto groups = group_candidates(candidates, o);

  // Stage 0 keeps each unit whole on every rank: no padding, one block (shard_ranks 1).
  const bool stage3 = o.zero_stage == 3;
  for (const auto& g : groups) {
    PlannedUnit u;
    u.info.name = g.front().path;
    u.info.shard_ranks = g.front().shard_ranks;
    u.info.tensor_split = g.front().split;
    u.info.expert_parallel = g.front().expert_parallel;
    const std::int64_t W = u.info.shard_ranks;
    std::int64_t offset = 0;
    for (const auto& c : g) {
      u.modules.push_back(c.module);
      for (const auto& p : c.module->parameters()) {
        u.parameters.push_back({p.get(), offset});
        u.info.parameters.push_back(plan.names.at(p.get()));
        offset += p->numel();
      }
    }
    u.info.frozen = std::all_of(u.parameters.begin(), u.parameters.end(),
                                [](const PlannedParameter& p) { return !p.parameter->trainable(); });
    u.info.numel = offset;
    u.info.padded = (offset + W - 1) / W * W;
    u.info.shard = u.info.padded / W;
    u.info.padded_bytes = static_cast<std::size_t>(u.info.padded) * element_size;
    u.info.persistent = stage3 && u.info.padded_bytes < o.persistence_threshold_bytes;
    u.info.gather_int8_block = int8_block_for(o, u.info);
    u.info.reduce_quant_block = int8_gradient_block_for(o, u.info);
    u.info.secondary_ranks = secondary_ranks_for(o, u.info);
    COSHARD_TRY(check_secondary_group(o, u.info));
    plan.largest_unit_bytes = std::max(plan.largest_unit_bytes, u.info.padded_bytes);
    plan.units.push_back(std::move(u));
  }
  COSHARD_TRY(place_by_budget(plan.units, o, optimizer_states));
  if (stage3 && o.max_live_bytes < plan.largest_unit_bytes) {
    std::string largest;
    for (const auto& u : plan.units)
      if (u.info.padded_bytes == plan.largest_unit_bytes) largest = u.info.name;
    return fail(ErrorCode::invalid_argument, "max_live_bytes=", o.max_live_bytes,
                ": must be at least the largest fetch unit (", plan.largest_unit_bytes, " bytes, unit ", largest, ")");
  }
  return plan;
}

}  // namespace coshard::zero::detail
