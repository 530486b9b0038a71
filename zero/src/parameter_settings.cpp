// Trainable and frozen parameters, parameter groups and unused units, as the engine sees them: the
// optimizer gets each unit's block cut into runs of one setting (a frozen parameter's run is never
// stepped), a unit whose parameters are all frozen has no gradient at all, and a unit that got no
// gradient in a step is left as it is (PyTorch's rule for a parameter whose gradient is None).
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

std::vector<Optimizer::Segment> Engine::State::segments_of(const Unit& u) const {
  const std::int64_t begin = block_offset(u), end = begin + u.info.shard;
  std::vector<Optimizer::Segment> segments;
  for (const auto& p : u.params) {
    const std::int64_t from = std::max(begin, p.offset), to = std::min(end, p.offset + p.parameter->numel());
    if (from >= to) continue;
    Optimizer::Segment seg = optimizer->settings_for(names.at(p.parameter), *p.parameter);
    seg.begin = from - begin;
    seg.end = to - begin;
    segments.push_back(seg);
  }
  return segments;
}

Result<void> Engine::State::check_trainability() const {
  for (const auto& [parameter, trainable] : planned_trainable)
    if (parameter->trainable() != trainable)
      return fail(ErrorCode::invalid_argument, "Engine: parameter ", names.at(parameter), " was ",
                  trainable ? "frozen" : "unfrozen", " after the engine was built (its gradient, reduction and ",
                  "optimizer state are planned when the engine is made: set trainable before Engine::create)");
  return {};
}

async::Task<Result<void>> Engine::State::skip_units_without_gradients() {
  std::vector<double> used(units.size());
  for (std::size_t i = 0; i < units.size(); ++i) used[i] = units[i]->grads_this_step > 0 ? 1.0 : 0.0;
  // A reduction per unit reduces a unit only where it got a gradient (a unit reduced on one rank
  // and not another is a collective mismatch), so the local count agrees across ranks. One that
  // reduces every unit after backward (stage 1) allows a rank-dependent branch: which units no rank used takes
  // one all-reduce of a flag per unit, awaited (the only host wait it adds; the optimizer waits for
  // the reduction anyway), and only with more than one rank.
  if (reduction->reduces_every_unit() && comm->size() > 1) {
    COSHARD_CO_TRY_ASSIGN(used, co_await all_reduce_values(used, ReduceOp::sum, "which units got gradients"));
  }
  for (std::size_t i = 0; i < units.size(); ++i) {
    const auto group = group_of(*units[i]);
    COSHARD_CO_TRY(group.optimizer.set_group_skipped(group.index, used[i] == 0.0));
  }
  co_return Result<void>{};
}

Result<void> Engine::State::check_no_gradient_missed() const {
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

void Engine::State::clear_gradients_missed() {
  for (const auto& u : units)
    for (const auto& p : u->params) p.parameter->clear_gradient_missed();
}

}  // namespace coshard::zero
