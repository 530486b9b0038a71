#include "coshard/async/dtype.hpp"

namespace coshard::async {

std::string_view to_string(DataType t) noexcept {
  switch (t) {
    case DataType::f32: return "f32";
    case DataType::f64: return "f64";
    case DataType::f16: return "f16";
    case DataType::bf16: return "bf16";
    case DataType::i32: return "i32";
    case DataType::u8: return "u8";
  }
  return "unknown-dtype";
}

}  // namespace coshard::async
