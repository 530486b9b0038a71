// A float tensor of a weight file as a whole parameter value in the engine's dtype: converted,
// every element checked finite (private to the readers of zero/src).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/modules/safetensors.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

// `source` names the file in errors.
Result<GatheredParameter> decode_parameter(std::string_view source, const std::string& name, modules::SafeDType file_dtype,
                                           const std::vector<std::int64_t>& dims, std::span<const std::byte> data,
                                           modules::DataType dtype);

// Fails naming how many of the values are not finite and the first one's parameter and element
// (`what` leads the message); `dtype` is the values' encoding.
Result<void> check_finite(const std::vector<GatheredParameter>& params, modules::DataType dtype, std::string_view what);

}  // namespace coshard::zero::detail
