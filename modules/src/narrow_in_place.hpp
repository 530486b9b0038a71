// fp32 values rounded to bf16/f16 in the same buffer: the first half of the bytes ends up holding
// the narrow values. Chunks go through local copies (memcpy), so no float is read through a
// uint16_t pointer or the other way round, and a chunk is written only over bytes already read.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "coshard/collectives/dtype.hpp"

namespace coshard::modules::detail {

inline void narrow_in_place(void* data, std::size_t n, collectives::DataType to) noexcept {
  constexpr std::size_t kChunk = 1024;
  std::array<float, kChunk> wide;
  std::array<std::uint16_t, kChunk> narrow;
  auto* bytes = static_cast<std::byte*>(data);
  for (std::size_t begin = 0; begin < n; begin += kChunk) {
    const std::size_t count = std::min(kChunk, n - begin);
    std::memcpy(wide.data(), bytes + begin * sizeof(float), count * sizeof(float));
    if (to == collectives::DataType::bf16)
      for (std::size_t i = 0; i < count; ++i) narrow[i] = collectives::float_to_bf16(wide[i]);
    else
      for (std::size_t i = 0; i < count; ++i) narrow[i] = collectives::float_to_f16(wide[i]);
    // (ends at byte 2 * (begin + count), before this chunk's source ends at 4 * (begin + count))
    std::memcpy(bytes + begin * sizeof(std::uint16_t), narrow.data(), count * sizeof(std::uint16_t));
  }
}

}  // namespace coshard::modules::detail
