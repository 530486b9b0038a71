// Element types of tensors and collectives, their sizes and names, and the bf16/f16 <-> f32
// conversions (round to nearest even, NaN preserved). Here, at the bottom, so that tensors
// (modules) and communication (collectives) share one type without depending on each other.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace coshard::async {

enum class DataType : std::uint8_t { f32, f64, f16, bf16, i32, u8 };

constexpr std::size_t size_of(DataType t) noexcept {
  switch (t) {
    case DataType::f64: return 8;
    case DataType::f32:
    case DataType::i32: return 4;
    case DataType::f16:
    case DataType::bf16: return 2;
    case DataType::u8: return 1;
  }
  return 0;
}

std::string_view to_string(DataType t) noexcept;

constexpr float bf16_to_float(std::uint16_t h) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

constexpr std::uint16_t float_to_bf16(float f) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const std::uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  // nearest, ties to even
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

constexpr float f16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);  // signed zero
    // Subnormal: normalise.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    return std::bit_cast<float>(sign | static_cast<std::uint32_t>(127 - 15 - e) << 23 | (mant & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(sign | (exp + 127 - 15) << 23 | mant << 13);
}

constexpr std::uint16_t float_to_f16(float f) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);  // NaN
  if (abs >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): shift the 24-bit significand into place, round to even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126 - exp;  // 14 + (112 - exp) ... total shift to the f16 subnormal grid
    const std::uint32_t half = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t mid = 1u << (shift - 1);
    const std::uint32_t rounded = half + ((rem > mid || (rem == mid && (half & 1u))) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | rounded);
  }
  // Normal: rebias the exponent, round the 13 dropped bits to even (a carry may bump the exponent).
  const std::uint32_t rebased = abs - (static_cast<std::uint32_t>(127 - 15) << 23);
  const std::uint32_t rounded = rebased + 0xFFFu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

}  // namespace coshard::async
