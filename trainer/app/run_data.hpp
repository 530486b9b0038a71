// coshard-train's data: the training data (--data, or the synthetic task) and the validation data
// (--val-data, or the synthetic task's held-out draws), opened and checked once before the ranks
// start.
#pragma once

#include <filesystem>
#include <memory>
#include <string_view>
#include <vector>

#include "coshard/trainer/data.hpp"
#include "command_line.hpp"

namespace coshard::train_app {

struct RunData {
  std::unique_ptr<trainer::TokenSource> train;
  std::unique_ptr<trainer::TokenSource> validation;  // none without validation
};

// The data `o` names; an error names the flag and the file.
Result<RunData> open_run_data(const Options& o);

// Whether `files` (those of `flag`) are text read as bytes (else token ids), as --data-format
// resolves for the first; each file's path checked first (a fifo would block the format probe).
Result<bool> data_read_as_bytes(const Options& o, const std::vector<std::filesystem::path>& files,
                                std::string_view flag);

}  // namespace coshard::train_app
