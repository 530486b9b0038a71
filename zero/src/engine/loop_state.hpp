// Where the training loop is (loop.cpp): between begin_step and finish_step, between
// begin_inference and end_inference, or neither (then the engine's modules may not run), and what
// the open step has counted so far. Private: not installed.
#pragma once

#include <cstdint>
#include <string_view>

#include "coshard/async/result.hpp"
#include "coshard/modules/tensor.hpp"

namespace coshard::zero::detail {

struct LoopState {
  enum class Open : std::uint8_t { none, step, inference };
  Open open = Open::none;
  int declared_micro_batches = 0;               // begin_step's
  int model_forwards = 0, model_backwards = 0;  // of the whole model, this step
  modules::Tensor loss_sum;                     // f32[1]: add_loss's sum
  int losses_added = 0;
  std::uint64_t launches_before = 0;  // collective launches before the step
  // `what` (a checkpoint, an export, a load) only between steps: an error names the open one.
  Result<void> outside(std::string_view what) const {
    if (open == Open::none) return {};
    return fail(ErrorCode::invalid_argument, "Engine::", what, ": ", open == Open::step ? "a step" : "an inference pass",
                " is open (", open == Open::step ? "finish_step or abandon_step" : "end_inference", " first)");
  }
};

}  // namespace coshard::zero::detail
