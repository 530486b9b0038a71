// What a Trainer holds per rank, before it is built: the engine's plan (memory_estimate.hpp)
// with what only the training loop knows: the device copy of a step's batch, the model's
// activations, the pinned staging of a checkpoint, the gathered model of an export.
//
//   trainer::MemoryInputs in{.rows_per_rank = 8, .seq = 1024,
//                            .activation_bytes = modules::gpt_activation_bytes(gpt, 8, 1024, dtype)};
//   auto estimate = trainer::estimate_memory(config, *model, world, in);
//   std::fputs(estimate->describe().c_str(), stdout);
#pragma once

#include <cstddef>
#include <cstdint>

#include "coshard/zero/memory_estimate.hpp"
#include "coshard/trainer/config.hpp"

namespace coshard::trainer {

struct MemoryInputs {
  std::int64_t rows_per_rank = 0;    // this rank's rows of a step (all its micro-batches)
  std::int64_t seq = 0;              // tokens a row
  std::size_t activation_bytes = 0;  // the model's, for one micro-batch (e.g. modules::gpt_activation_bytes)
  bool checkpoints = false;          // checkpoints are saved (their staging stays allocated after the first)
  bool export_model = false;         // the whole model is gathered on every rank at the end
};

// Per rank. Fails as TrainerConfig::validate or the engine's plan would.
Result<zero::MemoryEstimate> estimate_memory(const TrainerConfig& config, modules::Module& model, int world_size,
                                                const MemoryInputs& inputs);

}  // namespace coshard::trainer
