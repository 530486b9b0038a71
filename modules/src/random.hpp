// The modules' portable randomness (private): splitmix64 and FNV-1a, the same on every platform
// (std::normal_distribution is not). Initial values (module.cpp) and LoRA's dropout masks
// (layers/lora.cpp) draw from it.
#pragma once

#include <cstdint>
#include <string_view>

namespace coshard::modules::detail {

// splitmix64: tiny, fast, one 64-bit state.
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform01() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
};

inline std::uint64_t fnv1a(std::string_view s) noexcept {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
  return h;
}

}  // namespace coshard::modules::detail
