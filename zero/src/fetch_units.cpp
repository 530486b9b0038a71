#include "fetch_units.hpp"

#include "coshard/modules/checkpointing.hpp"
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

Result<FetchPlan> plan_fetch_units(Module& model, int world_size, const EngineOptions& o, std::size_t optimizer_states) {
  FetchPlan plan;
  const std::size_t element_size = size_of(o.dtype);
  model.for_each_parameter([&](const std::string& name, Parameter& p) { plan.names.emplace(&p, name); });

  struct Candidate {
    std::string path;
    Module* module;
    std::size_t bytes;
    bool leaf;
    bool alone;  // runs more than once a pass: its own unit
    int region;  // the checkpointed block it lies in (0: none)
    int shard_ranks;  // its shard group's size
    bool split;       // its parameters are tensor-parallel parts
  };
  // A unit never spans two checkpointed blocks, or one and the rest of the model: a recompute
  // runs the block's modules alone, and must meet each of its units' first and last module. The
  // same holds for a container that runs more than once a pass: each use meets its units whole.
  std::unordered_map<const Module*, int> region;
  int regions = 0;
  std::function<void(Module&, int)> mark = [&](Module& m, int r) {
    if (dynamic_cast<const Checkpointed*>(&m) || (!m.children().empty() && m.runs_more_than_once_per_pass()))
      r = ++regions;
    region[&m] = r;
    for (const auto& c : m.children()) mark(*c.module, r);
  };
  mark(model, 0);
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
    auto ranks = shard_group_size(o, world_size, path);
    if (!ranks) {
      if (sized) sized = fail(std::move(ranks).error());
      return;
    }
    candidates.push_back({path.empty() ? m.type_name().data() : path, &m, static_cast<std::size_t>(n) * element_size,
                          m.children().empty(), m.runs_more_than_once_per_pass() || borrowed.contains(&m),
                          region.at(&m), o.zero_stage == 0 ? 1 : *ranks, split != 0});
  });
  COSHARD_TRY(sized);
  if (candidates.empty()) return fail(ErrorCode::invalid_argument, "Engine: the model has no parameters");
  std::vector<std::vector<Candidate>> groups;
  std::size_t group_bytes = 0;
  for (const auto& c : candidates) {
    const bool small = c.leaf && !c.alone && c.bytes < o.module_granularity_bytes;
    const bool open = !groups.empty() && groups.back().back().leaf && !groups.back().back().alone &&
                      groups.back().back().region == c.region && groups.back().back().shard_ranks == c.shard_ranks &&
                      groups.back().back().split == c.split &&
                      groups.back().back().bytes < o.module_granularity_bytes && group_bytes < o.module_granularity_bytes;
    if (small && open) {
      groups.back().push_back(c);
      group_bytes += c.bytes;
    } else {
      groups.push_back({c});
      group_bytes = c.bytes;
    }
  }

  // Stage 0 keeps each unit whole on every rank: no padding, one block (shard_ranks 1).
  const bool stage3 = o.zero_stage == 3;
  for (const auto& g : groups) {
    PlannedUnit u;
    u.info.name = g.front().path;
    u.info.shard_ranks = g.front().shard_ranks;
    u.info.tensor_split = g.front().split;
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
