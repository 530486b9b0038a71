// Reduction operators of collectives; the element types are async's (coshard/async/dtype.hpp),
// named here too.
#pragma once

#include <cstdint>
#include <string_view>

#include "coshard/async/dtype.hpp"

namespace coshard::collectives {

using async::bf16_to_float;
using async::DataType;
using async::f16_to_float;
using async::float_to_bf16;
using async::float_to_f16;
using async::size_of;
using async::to_string;

enum class ReduceOp : std::uint8_t { sum, avg, max, min };
std::string_view to_string(ReduceOp op) noexcept;

}  // namespace coshard::collectives
