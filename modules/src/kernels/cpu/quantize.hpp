// The CPU's block int8 quantization (kernel_args.hpp: the format), in f32 arithmetic as CUDA's
// (quantize.cu) so both give the same bits: a value read as f32, scale = max|x| / 127 in f32, the
// quotient rounded to nearest even, the value back as q * scale rounded once to the dtype.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cpu/operands.hpp"
#include "kernels/kernel_args.hpp"

namespace coshard::modules::detail::cpu {

// `fn` with a reader of dt's elements as f32 (f64 rounded to f32: the engine's dtypes are f32,
// bf16 and f16; f64 serves the gradient checks).
template <class Fn>
void with_f32_reader(DataType dt, const void* p, Fn&& fn) {
  switch (dt) {
    case DataType::f64: fn([d = static_cast<const double*>(p)](std::int64_t i) { return static_cast<float>(d[i]); }); break;
    case DataType::bf16:
      fn([h = static_cast<const std::uint16_t*>(p)](std::int64_t i) { return async::bf16_to_float(h[i]); });
      break;
    case DataType::f16:
      fn([h = static_cast<const std::uint16_t*>(p)](std::int64_t i) { return async::f16_to_float(h[i]); });
      break;
    default: fn([f = static_cast<const float*>(p)](std::int64_t i) { return f[i]; }); break;
  }
}

// One segment's n values of x (dt) into its packed bytes.
inline void quantize_int8_segment(DataType dt, const void* x, std::int64_t first, std::byte* bytes, std::int64_t n,
                                  std::int64_t block) {
  auto* q = reinterpret_cast<std::int8_t*>(bytes);
  auto* scales = reinterpret_cast<float*>(bytes + int8_scales_offset(n));
  const std::int64_t blocks = int8_block_count(n, block);
  // The padding travels with the segment: zeroed, so the bytes sent are a function of the input.
  std::memset(bytes + n, 0, static_cast<std::size_t>(int8_scales_offset(n) - n));
  std::memset(scales + blocks, 0, static_cast<std::size_t>(int8_packed_bytes(n, block) - int8_scales_offset(n)) -
                                      static_cast<std::size_t>(blocks) * sizeof(float));
  with_f32_reader(dt, x, [&](auto read) {
    auto value = [&](std::int64_t i) { return read(first + i); };
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t begin = b * block, end = std::min(n, begin + block);
      float amax = 0;
      bool finite = true;
      for (std::int64_t i = begin; i < end; ++i) {
        const float a = std::fabs(value(i));
        finite = finite && a <= std::numeric_limits<float>::max();
        amax = std::max(amax, a);
      }
      const float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
      scales[b] = scale;
      for (std::int64_t i = begin; i < end; ++i)
        q[i] = scale > 0 ? static_cast<std::int8_t>(std::clamp(std::nearbyint(value(i) / scale), -127.0f, 127.0f)) : 0;
    }
  });
}

inline void quantize_int8(DataType dt, const void* x, void* packed, const Int8Segment* segments, std::int64_t count,
                          std::int64_t block) {
  for (std::int64_t k = 0; k < count; ++k) {
    const Int8Segment& g = segments[k];
    quantize_int8_segment(dt, x, g.value, static_cast<std::byte*>(packed) + g.packed, g.count, block);
  }
}

inline void dequantize_int8(const void* packed, DataType dt, void* out, const Int8Segment* segments, std::int64_t count,
                            std::int64_t block) {
  for (std::int64_t k = 0; k < count; ++k) {
    const Int8Segment& g = segments[k];
    const auto* base = static_cast<const std::byte*>(packed) + g.packed;
    const auto* q = reinterpret_cast<const std::int8_t*>(base);
    const auto* scales = reinterpret_cast<const float*>(base + int8_scales_offset(g.count));
    for (std::int64_t i = 0; i < g.count; ++i)
      store(dt, out, g.value + i, static_cast<float>(q[i]) * scales[i / block]);
  }
}

inline void dequantize_sum_int8(const void* packed, std::int64_t pieces, std::int64_t stride, DataType dt, void* out,
                                const Int8Segment* segments, std::int64_t count, std::int64_t block, float factor) {
  for (std::int64_t k = 0; k < count; ++k) {
    const Int8Segment& g = segments[k];
    for (std::int64_t i = 0; i < g.count; ++i) {
      float sum = 0;
      for (std::int64_t p = 0; p < pieces; ++p) {
        const auto* base = static_cast<const std::byte*>(packed) + p * stride + g.packed;
        const auto q = reinterpret_cast<const std::int8_t*>(base)[i];
        sum += static_cast<float>(q) * reinterpret_cast<const float*>(base + int8_scales_offset(g.count))[i / block];
      }
      store(dt, out, g.value + i, sum * factor);
    }
  }
}

}  // namespace coshard::modules::detail::cpu
