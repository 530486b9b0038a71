// coshard-train's data: the training data (--data, or the synthetic task) and the validation data
// (--val-data, or the synthetic task's held-out draws), opened and checked once before the ranks
// start.
#pragma once

#include <memory>

#include "coshard/trainer/data.hpp"
#include "command_line.hpp"

namespace coshard::train_app {

struct RunData {
  std::unique_ptr<trainer::TokenSource> train;
  std::unique_ptr<trainer::TokenSource> validation;  // none without validation
};

// The data `o` names; an error names the flag and the file.
Result<RunData> open_run_data(const Options& o);

}  // namespace coshard::train_app
