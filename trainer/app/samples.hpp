// coshard-train's samples (--sample-every, --prompt, --prompt-ids, --steps 0): the prompt, the
// generation on every rank, and the line rank 0 prints.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/trainer/trainer.hpp"
#include "command_line.hpp"

namespace coshard::train_app {

// The given prompt, or the first 4 tokens of the data's first batch.
std::vector<std::int32_t> sample_prompt(const Options& o, const trainer::TokenSource& data);
// Text read as bytes shows as text (printable ASCII, the rest escaped: \n, \xNN); ids as ids.
std::string render_tokens(std::span<const std::int32_t> ids, bool bytes);
// One sample after step `step` (every rank calls it); rank 0 prints it unless `quiet`.
async::Task<Result<void>> sample_after(trainer::Trainer& t, const Options& o, const trainer::TokenSource& data,
                                       std::int64_t step, bool quiet);

}  // namespace coshard::train_app
