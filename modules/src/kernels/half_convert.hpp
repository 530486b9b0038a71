// bf16/f16 arrays to and from f32, rounding to nearest even (as the CUDA conversions do): one
// tight loop per type, so that each vectorises. Shared by the CPU kernels and the engine.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "coshard/async/dtype.hpp"

namespace coshard::modules::detail {

// `from`/`to` is bf16 or f16 (anything else is taken as f16).
inline void widen_half(async::DataType from, const std::uint16_t* in, float* out, std::size_t n) noexcept {
  if (from == async::DataType::bf16)
    for (std::size_t i = 0; i < n; ++i) out[i] = async::bf16_to_float(in[i]);
  else
    for (std::size_t i = 0; i < n; ++i) out[i] = async::f16_to_float(in[i]);
}
inline void narrow_half(async::DataType to, const float* in, std::uint16_t* out, std::size_t n) noexcept {
  if (to == async::DataType::bf16)
    for (std::size_t i = 0; i < n; ++i) out[i] = async::float_to_bf16(in[i]);
  else
    for (std::size_t i = 0; i < n; ++i) out[i] = async::float_to_f16(in[i]);
}

// fp32 values rounded to bf16/f16 in the same buffer: the first half of the bytes ends up holding
// the narrow values. Chunks go through local copies (memcpy), so no float is read through a
// uint16_t pointer or the other way round, and a chunk is written only over bytes already read.
inline void narrow_in_place(void* data, std::size_t n, async::DataType to) noexcept {
  constexpr std::size_t kChunk = 1024;
  std::array<float, kChunk> wide;
  std::array<std::uint16_t, kChunk> narrow;
  auto* bytes = static_cast<std::byte*>(data);
  for (std::size_t begin = 0; begin < n; begin += kChunk) {
    const std::size_t count = std::min(kChunk, n - begin);
    std::memcpy(wide.data(), bytes + begin * sizeof(float), count * sizeof(float));
    narrow_half(to, wide.data(), narrow.data(), count);
    // (ends at byte 2 * (begin + count), before this chunk's source ends at 4 * (begin + count))
    std::memcpy(bytes + begin * sizeof(std::uint16_t), narrow.data(), count * sizeof(std::uint16_t));
  }
}

}  // namespace coshard::modules::detail
