// A step's mixture-of-experts statistics over the ranks (StepStats::aux_loss, experts_used,
// largest_expert_share), from what the trainer's RouterAuxLoss totalled over the step's
// micro-batches: one all-reduce of a few values per step, awaited (private to the trainer).
#pragma once

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/moe.hpp"
#include "coshard/trainer/trainer.hpp"

namespace coshard::trainer::detail {

async::Task<Result<void>> add_moe_stats(modules::Context& ctx, collectives::Communicator& comm,
                                        const modules::RouterAuxLoss& loss, StepStats& out);

}  // namespace coshard::trainer::detail
