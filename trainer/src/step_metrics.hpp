// The step's metrics, listed once: each with its key in the metrics file (one JSON object per
// step, to_json_line) and its TensorBoard tag, read from StepStats. A metric that is absent
// (exposed_comm_ms without timing, val_loss on a step that does not evaluate) is null in the
// file where `null_when_absent`, left out otherwise, and never written to TensorBoard.
#pragma once

#include <optional>
#include <span>
#include <string_view>

#include <nlohmann/json.hpp>

#include "coshard/trainer/trainer.hpp"

namespace coshard::trainer {

struct StepMetric {
  std::string_view key;  // metrics file
  std::string_view tag;  // TensorBoard; empty: not written there
  bool null_when_absent = false;
  nlohmann::json (*value)(const StepStats&);  // null: absent
};

std::span<const StepMetric> step_metrics() noexcept;

}  // namespace coshard::trainer
