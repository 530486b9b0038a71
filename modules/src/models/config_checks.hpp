// The checks model configurations share (private to the model builders).
#pragma once

#include <cstdint>
#include <string_view>

#include "coshard/async/result.hpp"

namespace coshard::modules::detail {

// "GptConfig.dim=0: expected > 0".
inline Result<void> check_positive(std::string_view config, std::string_view field, std::int64_t value) {
  if (value <= 0) return fail(ErrorCode::invalid_argument, config, ".", field, "=", value, ": expected > 0");
  return {};
}

}  // namespace coshard::modules::detail
