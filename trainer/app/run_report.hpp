// coshard-train's report of a run: what rank 0 prints before the first step (the model, the data,
// the kernels, the ranks and their sharding).
#pragma once

#include <cstdint>

#include "coshard/collectives/communicator.hpp"
#include "coshard/trainer/data.hpp"
#include "coshard/trainer/trainer.hpp"
#include "command_line.hpp"

namespace coshard::train_app {

// The run's header, for a run resumed at `first` (0: from the start); flushed.
void print_run_header(const Options& o, trainer::Trainer& t, const collectives::Communicator& comm,
                      const trainer::TokenSource& data, const trainer::TokenSource* val, std::int64_t first);

}  // namespace coshard::train_app
