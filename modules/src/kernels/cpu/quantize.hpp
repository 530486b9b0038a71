// The CPU's block quantization, int8 and int4 (kernel_args.hpp: the formats), in f32 arithmetic as
// CUDA's (quantize.cu) so both give the same bits: a value read as f32, scale = max|x| / qmax in
// f32, the quotient rounded to nearest even, the value back as q * scale rounded once to the dtype.
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

// A format's packed values: int8 a byte each; int4 two a byte, the first in the low nibble.
template <BlockBits Bits>
struct PackedValues {
  static void put(std::byte* values, std::int64_t i, int q) {
    if constexpr (Bits == BlockBits::int8) {
      values[i] = static_cast<std::byte>(static_cast<std::int8_t>(q));
    } else {  // (the bytes were zeroed: each nibble ORed in)
      const auto nibble = static_cast<unsigned>(q) & 0xFu;
      values[i / 2] |= static_cast<std::byte>(i % 2 == 0 ? nibble : nibble << 4);
    }
  }
  static int get(const std::byte* values, std::int64_t i) {
    if constexpr (Bits == BlockBits::int8) {
      return static_cast<std::int8_t>(values[i]);
    } else {  // (the nibble's sign extended: shifted to the top of a signed byte and back)
      const auto byte = static_cast<unsigned>(values[i / 2]);
      const auto top = static_cast<std::int8_t>(static_cast<std::uint8_t>(i % 2 == 0 ? byte << 4 : byte & 0xF0u));
      return top >> 4;
    }
  }
};

// One segment's n values of x (dt) into its packed bytes.
template <BlockBits Bits>
void quantize_segment(DataType dt, const void* x, std::int64_t first, std::byte* bytes, std::int64_t n,
                      std::int64_t block) {
  constexpr float qmax = quant_max(Bits);
  auto* scales = reinterpret_cast<float*>(bytes + quant_scales_offset(n, Bits));
  const std::int64_t blocks = quant_block_count(n, block);
  // The padding travels with the segment: zeroed, so the bytes sent are a function of the input
  // (int4's value bytes zeroed whole: its nibbles are ORed in).
  const std::int64_t written = Bits == BlockBits::int8 ? n : 0;
  std::memset(bytes + written, 0, static_cast<std::size_t>(quant_scales_offset(n, Bits) - written));
  std::memset(scales + blocks, 0, static_cast<std::size_t>(quant_packed_bytes(n, block, Bits) - quant_scales_offset(n, Bits)) -
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
      const float scale = finite ? amax / qmax : std::numeric_limits<float>::quiet_NaN();
      scales[b] = scale;
      for (std::int64_t i = begin; i < end; ++i)
        PackedValues<Bits>::put(bytes, i, scale > 0 ? static_cast<int>(std::clamp(std::nearbyint(value(i) / scale), -qmax, qmax)) : 0);
    }
  });
}

template <BlockBits Bits>
void dequantize_sum_segments(const void* packed, std::int64_t pieces, std::int64_t stride, DataType dt, void* out,
                             const QuantSegment* segments, std::int64_t count, std::int64_t block, float factor) {
  for (std::int64_t k = 0; k < count; ++k) {
    const QuantSegment& g = segments[k];
    for (std::int64_t i = 0; i < g.count; ++i) {
      float sum = 0;
      for (std::int64_t p = 0; p < pieces; ++p) {
        const auto* base = static_cast<const std::byte*>(packed) + p * stride + g.packed;
        const auto* scales = reinterpret_cast<const float*>(base + quant_scales_offset(g.count, Bits));
        sum += static_cast<float>(PackedValues<Bits>::get(base, i)) * scales[i / block];
      }
      // (one piece and a factor of 1: q * scale itself, as 0 + x and x * 1 are x for every x it can be)
      store(dt, out, g.value + i, sum * factor);
    }
  }
}

inline void quantize_blocks(BlockBits bits, DataType dt, const void* x, void* packed, const QuantSegment* segments,
                            std::int64_t count, std::int64_t block) {
  for (std::int64_t k = 0; k < count; ++k) {
    const QuantSegment& g = segments[k];
    auto* bytes = static_cast<std::byte*>(packed) + g.packed;
    if (bits == BlockBits::int8)
      quantize_segment<BlockBits::int8>(dt, x, g.value, bytes, g.count, block);
    else
      quantize_segment<BlockBits::int4>(dt, x, g.value, bytes, g.count, block);
  }
}

// The pieces' values summed in f32 in piece order, times `factor` (dequantizing: one piece, 1).
inline void dequantize_sum_blocks(BlockBits bits, const void* packed, std::int64_t pieces, std::int64_t stride,
                                  DataType dt, void* out, const QuantSegment* segments, std::int64_t count,
                                  std::int64_t block, float factor) {
  if (bits == BlockBits::int8)
    dequantize_sum_segments<BlockBits::int8>(packed, pieces, stride, dt, out, segments, count, block, factor);
  else
    dequantize_sum_segments<BlockBits::int4>(packed, pieces, stride, dt, out, segments, count, block, factor);
}

}  // namespace coshard::modules::detail::cpu
