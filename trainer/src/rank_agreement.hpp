// What every rank of one run must agree on, checked when the trainer is built, before any
// collective of training: ranks started with different settings (another --seed, --lr or data,
// another model shape) trained in silence, or crashed in the engine's first collective. Each rank
// hashes every field, one all-gather exchanges the hashes, and every rank reaches the same
// verdict, naming the fields that differ, its own values and the ranks that differ from rank 0.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/module.hpp"
#include "coshard/trainer/config.hpp"

namespace coshard::trainer::detail {

// (name, value as text) of everything that must agree: the model's parameters (names, shapes,
// trainable), the step's numerics (stage, dtype, optimizer and its settings, schedule, clipping,
// loss scaling, accumulation, groups, freezing, checkpointing, attention), what decides the
// collective sequence (fetch and prefetch settings, offload kinds), the run identity and seed,
// and config.ranks_agree_on. Paths and budgets that may differ per machine are left out.
std::vector<std::pair<std::string, std::string>> agreement_fields(const TrainerConfig& config, modules::Module& model);

async::Task<Result<void>> check_ranks_agree(modules::Context& ctx, collectives::Communicator& comm,
                                            const std::vector<std::pair<std::string, std::string>>& fields);

}  // namespace coshard::trainer::detail
