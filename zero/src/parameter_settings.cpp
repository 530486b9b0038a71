// Trainable and frozen parameters, parameter groups and unused units (parameter_settings.hpp).
#include "parameter_settings.hpp"

namespace coshard::zero::detail {

using namespace modules;
using collectives::ReduceOp;

std::vector<Optimizer::Segment> ParameterSettings::segments_of(const FetchUnit& u) const {
  const std::int64_t begin = u.block_offset, end = begin + u.info.shard;
  std::vector<Optimizer::Segment> segments;
  for (const auto& p : u.params) {
    const std::int64_t from = std::max(begin, p.offset), to = std::min(end, p.offset + p.parameter->numel());
    if (from >= to) continue;
    Optimizer::Segment seg = optimizer.settings_for(names.at(p.parameter), *p.parameter);
    seg.begin = from - begin;
    seg.end = to - begin;
    segments.push_back(seg);
  }
  return segments;
}

Result<void> ParameterSettings::check_trainability() const {
  for (const auto& [parameter, trainable] : planned_trainable)
    if (parameter->trainable() != trainable)
      return fail(ErrorCode::invalid_argument, "Engine: parameter ", names.at(parameter), " was ",
                  trainable ? "frozen" : "unfrozen", " after the engine was built (its gradient, reduction and ",
                  "optimizer state are planned when the engine is made: set trainable before Engine::create)");
  return {};
}

async::Task<Result<void>> skip_units_without_gradients(ParameterSettings settings, RankExchange& ranks,
                                                       bool reduces_every_unit, int world) {
  const auto& units = settings.units;
  // A flag per unit, then one per module of each coalesced unit.
  std::vector<double> used(units.size());
  bool any_coalesced = false;
  for (std::size_t i = 0; i < units.size(); ++i) used[i] = units[i]->grads_this_step > 0 ? 1.0 : 0.0;
  for (const auto& u : units)
    if (u->coalesced()) {
      any_coalesced = true;
      for (const auto& run : u->module_runs) used.push_back(run.used ? 1.0 : 0.0);
    }
  // A reduction per unit reduces a unit only where it got a gradient (a unit reduced on one rank
  // and not another is a collective mismatch), so the local count agrees across ranks. One that
  // reduces every unit after backward (stage 1) allows a rank-dependent branch, and so does a
  // module within a coalesced unit at any stage (the unit is reduced either way): which units and
  // modules no rank used takes one all-reduce of their flags, awaited (the only host wait it adds;
  // the optimizer waits for the reduction anyway), and only with more than one rank.
  if ((reduces_every_unit || any_coalesced) && world > 1) {
    COSHARD_CO_TRY_ASSIGN(used, co_await ranks.all_reduce_values(used, ReduceOp::sum, "which units got gradients"));
  }
  std::size_t next_module = units.size();
  for (std::size_t i = 0; i < units.size(); ++i) {
    FetchUnit& u = *units[i];
    const auto group = settings.group_of(u);
    COSHARD_CO_TRY(group.optimizer.set_group_skipped(group.index, used[i] == 0.0));
    for (auto& p : u.params) p.left_out = used[i] == 0.0 && p.parameter->trainable();
    if (!u.coalesced()) continue;
    const std::span<const double> modules_used(used.data() + next_module, u.modules.size());
    next_module += u.modules.size();
    COSHARD_CO_TRY(settings.skip_unused_modules(u, modules_used));
  }
  co_return Result<void>{};
}

Result<void> ParameterSettings::skip_unused_modules(FetchUnit& u, std::span<const double> used) const {
  if (u.info.frozen) return {};
  if (!used.empty())
    for (auto& p : u.params) p.left_out = used[p.module] == 0.0 && p.parameter->trainable();
  const auto group = group_of(u);
  // This rank's block of the unit, [begin, end): the group's elements.
  const std::int64_t begin = u.block_offset, end = begin + u.info.shard;
  std::vector<std::pair<std::int64_t, std::int64_t>> runs;
  for (std::size_t k = 0; k < used.size(); ++k) {
    if (used[k] != 0.0) continue;
    const std::int64_t from = std::max(begin, u.module_runs[k].begin), to = std::min(end, u.module_runs[k].end);
    if (from >= to) continue;
    if (!runs.empty() && runs.back().second == from - begin) runs.back().second = to - begin;  // (adjacent modules)
    else runs.emplace_back(from - begin, to - begin);
  }
  return group.optimizer.set_group_skipped_runs(group.index, std::move(runs));
}

Result<void> ParameterSettings::skip_modules_unused_here(FetchUnit& u) const {
  if (!u.coalesced()) return {};
  std::vector<double> used;
  for (const auto& run : u.module_runs) used.push_back(run.used ? 1.0 : 0.0);
  return skip_unused_modules(u, used);
}

Result<void> ParameterSettings::count_steps_missed() const {
  bool changed = false;
  for (auto& u : units)
    for (auto& p : u->params)
      if (p.left_out) {
        ++p.steps_missed;
        changed = true;
      }
  return changed ? set_steps_missed() : Result<void>{};
}

Result<void> ParameterSettings::set_steps_missed() const {
  for (auto& u : units) {
    if (u->info.frozen) continue;
    // This rank's block of the unit, [begin, end): the group's elements.
    const std::int64_t begin = u->block_offset, end = begin + u->info.shard;
    std::vector<Optimizer::MissedSteps> runs;
    for (const auto& p : u->params) {
      const std::int64_t from = std::max(begin, p.offset), to = std::min(end, p.offset + p.parameter->numel());
      if (p.steps_missed == 0 || from >= to) continue;
      if (!runs.empty() && runs.back().end == from - begin && runs.back().steps == p.steps_missed) runs.back().end = to - begin;
      else runs.push_back({from - begin, to - begin, p.steps_missed});
    }
    const auto group = group_of(*u);
    if (runs.empty() && group.optimizer.groups()[group.index].steps_missed.empty()) continue;
    COSHARD_TRY(group.optimizer.set_group_steps_missed(group.index, std::move(runs)));
  }
  return {};
}

Result<void> ParameterSettings::check_no_gradient_missed() const {
  std::string missed;
  int count = 0;
  for (const auto& u : units)
    for (const auto& p : u->params)
      if (p.parameter->gradient_missed() && ++count <= 4)
        missed += (missed.empty() ? "" : ", ") + names.at(p.parameter) + " (unit " + u->info.name + ")";
  if (count == 0) return {};
  return fail(ErrorCode::invalid_argument, "Engine: the gradient of ", missed, count > 4 ? " and " + std::to_string(count - 4) + " more" : "",
              " was asked for while none was bound, so it would be lost: a module read a parameter it does not own "
              "(declare it: reader.use_parameters_of(owner)), or a module ran more than once in a pass (declare it: "
              "module.set_runs_more_than_once_per_pass()); the step is abandoned, nothing updated");
}

void ParameterSettings::clear_gradients_missed() const {
  for (const auto& u : units)
    for (const auto& p : u->params) p.parameter->clear_gradient_missed();
}

}  // namespace coshard::zero::detail
