// The units a checkpoint lists (checkpoint/saved_units.hpp).
#include "checkpoint/saved_units.hpp"

#include <unordered_map>

#include "expert_parts.hpp"

namespace coshard::zero::detail {

namespace {

// The layer a unit of experts belongs to: its name up to ".experts." (the SparseMoe's path).
std::string experts_of(const std::string& name) {
  const auto at = name.find("experts.");
  return at == std::string::npos ? name : name.substr(0, at);
}

// `unit`'s name as another expert rank holds it: the unit's name is its first parameter's path
// up to that parameter's own name, so the same cut of the renamed parameter.
std::string renamed_unit(const FetchUnitInfo& unit, const std::string& first_parameter) {
  const std::string& own = unit.parameters.front();
  if (own.size() < unit.name.size() || own.compare(0, unit.name.size(), unit.name) != 0) return unit.name;
  const std::string rest = own.substr(unit.name.size());
  if (first_parameter.size() < rest.size() ||
      first_parameter.compare(first_parameter.size() - rest.size(), rest.size(), rest) != 0)
    return unit.name;
  return first_parameter.substr(0, first_parameter.size() - rest.size());
}

}  // namespace

SavedUnits saved_units(std::span<const FetchUnitInfo> units, modules::Module& model, int rank, int world) {
  SavedUnits out;
  out.key_of.assign(units.size(), 0);
  std::unordered_map<std::string, std::vector<std::string>> names;  // own name -> [expert rank q]'s
  for (auto& e : modules::expert_places(model)) names.emplace(e.name, std::move(e.names_by_rank));
  for (std::size_t i = 0; i < units.size();) {
    const FetchUnitInfo& u = units[i];
    if (u.expert_parallel == 1) {
      out.key_of[i] = out.entries.size();
      out.entries.push_back({i, 0, u.name, u.parameters});
      ++i;
      continue;
    }
    // This layer's units of experts, listed for each expert rank in turn (expert order).
    std::size_t end = i;
    while (end < units.size() && units[end].expert_parallel == u.expert_parallel &&
           experts_of(units[end].name) == experts_of(u.name))
      ++end;
    const int experts = u.expert_parallel, run = world / experts, own = rank / run;
    for (int q = 0; q < experts; ++q)
      for (std::size_t j = i; j < end; ++j) {
        SavedUnits::Entry entry{j, q * run, units[j].name, {}};
        for (const auto& p : units[j].parameters) {
          const auto it = names.find(p);
          entry.parameters.push_back(it == names.end() ? p : it->second[static_cast<std::size_t>(q)]);
        }
        if (!entry.parameters.empty()) entry.name = renamed_unit(units[j], entry.parameters.front());
        if (q == own) out.key_of[j] = out.entries.size();
        out.entries.push_back(std::move(entry));
      }
    i = end;
  }
  return out;
}

async::Task<Result<std::map<std::string, std::int64_t>>> steps_missed_elsewhere(
    RankExchange& world, int rank, modules::Module& model, std::map<std::string, std::int64_t> own) {
  std::map<std::string, std::int64_t> out;
  const auto experts = modules::expert_places(model);
  if (experts.empty()) co_return out;
  std::vector<std::int64_t> mine;
  for (const auto& e : experts) {
    const auto it = own.find(e.name);
    mine.push_back(it == own.end() ? 0 : it->second);
  }
  const int groups = static_cast<int>(experts.front().names_by_rank.size());
  COSHARD_CO_TRY_ASSIGN(const auto theirs, co_await from_every_expert_rank(world, rank, groups, std::move(mine)));
  for (int q = 0; q < groups; ++q) {
    if (q == rank / (world.size() / groups)) continue;  // (this rank's own)
    for (std::size_t i = 0; i < experts.size(); ++i)
      if (const std::int64_t n = theirs[static_cast<std::size_t>(q)][i]; n > 0)
        out[experts[i].names_by_rank[static_cast<std::size_t>(q)]] = n;
  }
  co_return out;
}

}  // namespace coshard::zero::detail
