// Trainable and frozen parameters, parameter groups and unused units, as the engine sees them: the
// optimizer gets each unit's block cut into runs of one setting (a frozen parameter's run is never
// stepped), a unit whose parameters are all frozen has no gradient at all, and a unit that got no
// gradient in a step is left as it is (PyTorch's rule for a parameter whose gradient is None).
//
// A view over the engine's units, their parameters' names and the optimizer's groups, made where
// it is used (Engine::State::settings()); what it keeps between steps lives in the units'
// parameters (left_out, steps_missed). Private: not installed.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/modules/optimizer.hpp"
#include "fetch_unit.hpp"
#include "rank_exchange.hpp"

namespace coshard::zero::detail {

// Where a unit's optimizer group is: the device part's for a unit stepped on the device.
struct GroupRef {
  modules::Optimizer& optimizer;
  std::size_t index;
};

struct ParameterSettings {
  const std::vector<std::unique_ptr<FetchUnit>>& units;
  const std::unordered_map<const modules::Parameter*, std::string>& names;
  modules::Optimizer& optimizer;
  std::size_t first_group;  // the optimizer's group of unit i is first_group + i
  modules::Optimizer* device_optimizer;  // (HostSide::device_optimizer; null without one)
  // Whether each parameter trained when the engine was made.
  const std::vector<std::pair<const modules::Parameter*, bool>>& planned_trainable;

  GroupRef group_of(const FetchUnit& u) const noexcept {
    if (device_optimizer && !u.info.optimizer_offloaded && !u.info.frozen) return {*device_optimizer, u.device_group};
    return {optimizer, first_group + u.index};
  }
  // The optimizer's segments of this rank's block of u: each parameter's run with its settings
  // (frozen, or its parameter group's), clipped to the block.
  std::vector<modules::Optimizer::Segment> segments_of(const FetchUnit& u) const;
  // Whether each parameter trains as it did when the engine was made: a change since is refused,
  // naming the parameter (the gradients, reductions and optimizer groups were planned for it).
  Result<void> check_trainability() const;
  // Coalesced unit u: the elements of its modules whose flag in `used` (one a module) is 0 are left
  // untouched by the coming step (empty `used`: every module steps).
  Result<void> skip_unused_modules(FetchUnit& u, std::span<const double> used) const;
  // step_in_backward: a coalesced unit steps before the ranks could agree on which of its modules
  // got gradients, so this rank's modules decide.
  Result<void> skip_modules_unused_here(FetchUnit& u) const;
  // After a step that counted (not skipped for a non-finite gradient): each parameter left out of
  // it missed one more step; the optimizer's groups are told where that changed anything.
  Result<void> count_steps_missed() const;
  // Every unit's runs of parameters that missed steps, to its optimizer group (after a load too).
  Result<void> set_steps_missed() const;
  // Before a step ends: no parameter's gradient was asked for without one bound (an undeclared
  // read of another module's parameter: Parameter::grad), else an error naming each.
  Result<void> check_no_gradient_missed() const;
  void clear_gradients_missed() const;
};

// Before the optimizer steps: units that got no gradient this step on any rank are left
// untouched, as PyTorch leaves a parameter whose gradient is None. `ranks` asks the others when
// `reduces_every_unit` (stage 1: a unit may be reduced where another rank did not use it) or a
// coalesced unit's modules may differ between ranks, with more than one rank.
async::Task<Result<void>> skip_units_without_gradients(ParameterSettings settings, RankExchange& ranks,
                                                       bool reduces_every_unit, int world);

}  // namespace coshard::zero::detail
