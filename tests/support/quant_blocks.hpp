// The block int8 and int4 formats of ZeRO++'s quantized gathers and reduction
// (modules/src/kernels/kernel_args.hpp), written plainly from their definition for the kernels'
// tests, CPU and emulated CUDA alike: both must give these bits, so they give each other's. Also
// the cases the tests run: random values, and the adversarial blocks (all equal, one outlier,
// zeros, denormals, ties, inf and NaN). Nothing of coshard's, so the emulated-kernel test uses it
// too. `bits`: 8 or 4.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/reference_math.hpp"

namespace coshard::testing {

struct QuantBlocks {
  std::vector<std::int8_t> q;
  std::vector<float> scales;
};

inline float quant_max(int bits) { return bits == 8 ? 127.0f : 7.0f; }
// A segment of n values: its values' bytes (int4: two a byte, the first in the low nibble), where
// its scales start, its packed bytes.
inline std::int64_t quant_values_bytes(std::int64_t n, int bits) { return bits == 8 ? n : (n + 1) / 2; }
inline std::int64_t quant_scales_at(std::int64_t n, int bits) { return (quant_values_bytes(n, bits) + 15) / 16 * 16; }
inline std::int64_t quant_packed(std::int64_t n, std::int64_t block, int bits) {
  return quant_scales_at(n, bits) + ((n + block - 1) / block * 4 + 15) / 16 * 16;
}
// Value i of packed values.
inline int packed_q(const std::byte* values, std::int64_t i, int bits) {
  if (bits == 8) return static_cast<std::int8_t>(values[i]);
  const int nibble = (static_cast<int>(values[i / 2]) >> (i % 2 == 0 ? 0 : 4)) & 0xF;
  return nibble >= 8 ? nibble - 16 : nibble;
}

// x read as f32: each block's scale max|x| / qmax (127, or 7 for int4; NaN where it holds inf or
// NaN), its values round-to-nearest-even(x / scale) clamped to [-qmax, qmax], 0 where the scale is
// 0 or NaN.
inline QuantBlocks quant_blocks_reference(const std::vector<float>& x, std::int64_t block, int bits = 8) {
  const float qmax = quant_max(bits);
  const auto n = static_cast<std::int64_t>(x.size());
  QuantBlocks r{std::vector<std::int8_t>(x.size()), {}};
  for (std::int64_t begin = 0; begin < n; begin += block) {
    const std::int64_t end = std::min(n, begin + block);
    float amax = 0;
    bool finite = true;
    for (std::int64_t i = begin; i < end; ++i) {
      finite = finite && std::isfinite(x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    const float scale = finite ? amax / qmax : std::numeric_limits<float>::quiet_NaN();
    r.scales.push_back(scale);
    for (std::int64_t i = begin; i < end; ++i) {
      if (!(scale > 0)) continue;
      const float quotient = x[i] / scale;
      const float even = quotient - std::floor(quotient) == 0.5f ? 2 * std::round(quotient / 2) : std::round(quotient);
      r.q[i] = static_cast<std::int8_t>(std::clamp(even, -qmax, qmax));
    }
  }
  return r;
}

// The values as they come back, in f32 (before rounding to a storage dtype): q * scale.
inline std::vector<float> quant_blocks_values(const QuantBlocks& b, std::int64_t block) {
  std::vector<float> out(b.q.size());
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<float>(b.q[i]) * b.scales[i / static_cast<std::size_t>(block)];
  return out;
}

// The format's bound for a finite block: |x - q * scale| <= scale / 2 (the rounding of the
// quotient) and f32's roundings of it, or (a scale below f32's smallest normal / qmax, where the
// division loses digits) a few of f32's smallest steps.
inline double quant_blocks_bound(float amax, int bits = 8) {
  const double steps = 2.0 * quant_max(bits);
  return static_cast<double>(amax) / steps * (1 + 1e-6) + steps * std::numeric_limits<float>::denorm_min();
}

// Segments of these counts laid side by side (values and packed bytes), as kernel_args.hpp's
// QuantSegment: {value, count, packed, first_block}.
struct QuantSegmentPlan {
  std::int64_t value, count, packed, first_block;
};
inline std::vector<QuantSegmentPlan> quant_segments(const std::vector<std::int64_t>& counts, std::int64_t block,
                                                    std::int64_t& packed_bytes, std::int64_t& blocks, int bits = 8) {
  std::vector<QuantSegmentPlan> out;
  std::int64_t value = 0;
  packed_bytes = 0;
  blocks = 0;
  for (std::int64_t n : counts) {
    out.push_back({value, n, packed_bytes, blocks});
    value += n;
    const std::int64_t count = (n + block - 1) / block;
    packed_bytes += quant_packed(n, block, bits);
    blocks += count;
  }
  return out;
}
// A case's values, then the same negated, as segments: the first its whole, the second cut in
// three uneven runs where it is long enough (so a kernel must find each block's own segment).
inline std::vector<std::int64_t> quant_case_counts(std::int64_t n) {
  if (n < 3) return {n, n};
  return {n, n / 3, n / 2 - n / 3, n - n / 2};
}

struct QuantCase {
  std::string name;
  std::vector<float> values;
  std::int64_t block;
};

// (int4: its blocks of an even count, and its own ties: a block whose largest is 7 has scale 1)
inline std::vector<QuantCase> quant_block_cases(int bits = 8) {
  const float qmax = quant_max(bits);
  std::vector<QuantCase> cases;
  auto from = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  cases.push_back({"random_last_block_short", from(random_values(1000, 7, 0.05)), 64});
  cases.push_back({"random_one_block_per_thread_stride", from(random_values(4096, 8, 3.0)), 2048});
  cases.push_back({"all_equal", std::vector<float>(300, 0.37f), 128});
  cases.push_back({"all_equal_negative", std::vector<float>(64, -2.5e-3f), 64});
  std::vector<float> outlier = from(random_values(512, 9, 1e-3));
  outlier[77] = 1e4f;  // its block's other values fall to 0: the format's known cost
  cases.push_back({"one_outlier", outlier, 256});
  cases.push_back({"zeros", std::vector<float>(200, 0.0f), 64});
  std::vector<float> signed_zeros(64, -0.0f);
  cases.push_back({"negative_zeros", signed_zeros, 32});
  std::vector<float> denormals;
  for (int i = 0; i < 96; ++i) denormals.push_back(static_cast<float>(i - 48) * 3e-41f);
  cases.push_back({"denormals", denormals, 32});
  std::vector<float> tiny;  // around f32's smallest normal
  for (int i = 0; i < 64; ++i) tiny.push_back(std::numeric_limits<float>::min() * static_cast<float>(i % 7 - 3));
  cases.push_back({"smallest_normals", tiny, 64});
  std::vector<float> ties;  // max qmax: scale 1, so k + 0.5 is a tie (to even)
  for (int i = 0; i < 64; ++i) ties.push_back(static_cast<float>(i % 14 - 7) + 0.5f);
  ties[0] = qmax;
  cases.push_back({"ties_to_even", ties, 64});
  cases.push_back({"one_value", {0.123f}, 2048});
  cases.push_back({bits == 8 ? "blocks_of_one" : "blocks_of_two", from(random_values(33, 10, 5.0)), bits == 8 ? 1 : 2});
  cases.push_back({"large_values", from(random_values(256, 11, 3e38)), 64});
  std::vector<float> with_inf = from(random_values(192, 12, 1.0));
  with_inf[70] = std::numeric_limits<float>::infinity();  // the second block goes NaN, the others not
  cases.push_back({"inf", with_inf, 64});
  std::vector<float> with_nan = from(random_values(192, 13, 1.0));
  with_nan[130] = std::numeric_limits<float>::quiet_NaN();  // the third block
  cases.push_back({"nan", with_nan, 64});
  return cases;
}

}  // namespace coshard::testing
