// The optimizer's settings behind Optimizer::Impl, shared by its files: optimizer.cpp (making
// one, its groups), parameter_groups.cpp (the rules that give each parameter its settings) and
// optimizer_step.cpp (the step: statistics, the update, the loss scale). Private.
#pragma once

#include "coshard/modules/optimizer.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules {

struct Optimizer::Impl {
  bool adam = true;
  detail::AdamArgs adam_args;
  detail::SgdArgs sgd_args;
  StepControlOptions control;
  detail::LossScaleArgs scale_args() const {
    return {.dynamic = control.loss_scaling == LossScaling::dynamic,
            .growth_factor = control.growth_factor,
            .backoff_factor = control.backoff_factor,
            .growth_interval = control.growth_interval};
  }
};

}  // namespace coshard::modules
