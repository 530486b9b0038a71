// A vectorisable exp for floats (private), for the element-wise kernels and the half types'
// cross-entropy.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace coshard::modules::detail {

// exp for floats, branch-free so that loops over it vectorise (std::exp/std::tanh are library
// calls the compiler cannot vectorise without -ffast-math). Range reduction x = n ln2 + r with
// the round-to-nearest done by the 1.5 * 2^23 trick, a degree-6 Taylor polynomial on
// |r| <= ln2 / 2 (relative error ~2e-7), and 2^n built in the exponent bits. x is clamped to
// [-80, 80], where the result stays a normal float (a NaN gives a NaN).
inline float exp_approx(float x) {
  x = x < -80.0f ? -80.0f : x;  // (selects, which vectorise; a NaN stays one)
  x = x > 80.0f ? 80.0f : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  // (a NaN's n converted to an integer would be undefined: any exponent does, p is a NaN already)
  const float whole = n == n ? n : 0.0f;
  const auto bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(whole) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

}  // namespace coshard::modules::detail
