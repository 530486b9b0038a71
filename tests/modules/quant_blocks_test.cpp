// The CPU's block int8 and int4 kernels (ZeRO++'s quantized gathers and reduction, #63): the bits
// of the formats' reference (tests/support/quant_blocks.hpp, which the emulated CUDA kernels also
// match) for f32, bf16 and f16 inputs, over random and adversarial blocks, in segments of several lengths quantized
// and dequantized in one call each; every value within the format's bound, a block holding inf or
// NaN all NaN and its neighbours untouched; the padding zeroed; bad sizes refused by name.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "coshard/async/dtype.hpp"
#include "coshard/async/stream.hpp"
#include "kernels/kernel_args.hpp"
#include "kernels/kernels.hpp"
#include "support/quant_blocks.hpp"

namespace coshard::modules::detail {
namespace {

using testing::QuantBlocks;

// Values held in dt (f32, bf16, f16): the stored bytes, and the values they hold as f32.
struct Held {
  std::vector<std::byte> bytes;
  std::vector<float> values;
};
Held hold(DataType dt, const std::vector<float>& x) {
  Held h;
  for (float v : x) {
    if (dt == DataType::f32) {
      h.values.push_back(v);
      const auto bits = std::bit_cast<std::uint32_t>(v);
      for (int k = 0; k < 4; ++k) h.bytes.push_back(static_cast<std::byte>(bits >> (8 * k)));
      continue;
    }
    const std::uint16_t bits = dt == DataType::bf16 ? async::float_to_bf16(v) : async::float_to_f16(v);
    h.values.push_back(dt == DataType::bf16 ? async::bf16_to_float(bits) : async::f16_to_float(bits));
    h.bytes.push_back(static_cast<std::byte>(bits & 0xff));
    h.bytes.push_back(static_cast<std::byte>(bits >> 8));
  }
  return h;
}
float stored_as(DataType dt, float v) {
  if (dt == DataType::bf16) return async::bf16_to_float(async::float_to_bf16(v));
  if (dt == DataType::f16) return async::f16_to_float(async::float_to_f16(v));
  return v;
}
float read(DataType dt, const std::vector<std::byte>& bytes, std::size_t i) {
  if (dt == DataType::f32) {
    float v;
    std::memcpy(&v, bytes.data() + 4 * i, 4);
    return v;
  }
  std::uint16_t bits;
  std::memcpy(&bits, bytes.data() + 2 * i, 2);
  return dt == DataType::bf16 ? async::bf16_to_float(bits) : async::f16_to_float(bits);
}
bool same(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

class QuantBlocksCpu : public ::testing::TestWithParam<std::tuple<DataType, BlockBits>> {};

TEST_P(QuantBlocksCpu, TheFormatsBitsWithinItsBound) {
  const auto [dt, format] = GetParam();
  const int bits = static_cast<int>(format);
  const Kernels& k = cpu_kernels();
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "quant"});
  ASSERT_TRUE(stream) << stream.error().message();
  for (const auto& c : testing::quant_block_cases(bits)) {
    SCOPED_TRACE(c.name);
    const auto n = static_cast<std::int64_t>(c.values.size());
    std::vector<float> all = c.values;
    for (float v : c.values) all.push_back(-v);
    const Held x = hold(dt, all);
    std::int64_t packed_bytes = 0, blocks = 0;
    const auto plan = testing::quant_segments(testing::quant_case_counts(n), c.block, packed_bytes, blocks, bits);
    std::vector<QuantSegment> segments;
    for (const auto& g : plan) segments.push_back({g.value, g.count, g.packed, g.first_block});
    std::vector<std::byte> packed(static_cast<std::size_t>(packed_bytes), std::byte{0x5a});  // (padding must come back zeroed)
    std::vector<std::byte> out(x.bytes.size());
    ASSERT_TRUE(k.quantize_blocks(*stream, format, dt, x.bytes.data(), packed.data(), segments.data(),
                                  static_cast<std::int64_t>(segments.size()), blocks, c.block));
    ASSERT_TRUE(k.dequantize_blocks(*stream, format, packed.data(), dt, out.data(), segments.data(),
                                    static_cast<std::int64_t>(segments.size()), blocks, c.block));
    ASSERT_TRUE(stream->synchronize());

    for (const auto& g : plan) {
      SCOPED_TRACE("segment at " + std::to_string(g.value) + " of " + std::to_string(g.count));
      const std::vector<float> values(x.values.begin() + g.value, x.values.begin() + g.value + g.count);
      const QuantBlocks want = testing::quant_blocks_reference(values, c.block, bits);
      const std::byte* base = packed.data() + g.packed;
      for (std::int64_t i = 0; i < g.count; ++i) ASSERT_EQ(testing::packed_q(base, i, bits), want.q[i]) << "value " << i;
      if (bits == 4 && g.count % 2 == 1)  // (an odd segment's last byte: its high nibble zero)
        ASSERT_EQ(static_cast<int>(base[g.count / 2]) >> 4, 0) << "the last byte's free nibble";
      const std::int64_t scales_at = quant_scales_offset(g.count, format);
      ASSERT_EQ(scales_at, testing::quant_scales_at(g.count, bits));
      for (std::int64_t i = quant_values_bytes(g.count, format); i < scales_at; ++i)
        ASSERT_EQ(base[i], std::byte{0}) << "padding " << i;
      for (std::size_t b = 0; b < want.scales.size(); ++b) {
        float scale;
        std::memcpy(&scale, base + scales_at + 4 * b, 4);
        ASSERT_TRUE(same(scale, want.scales[b])) << "scale " << b << ": " << scale << " against " << want.scales[b];
      }
      for (auto i = scales_at + 4 * static_cast<std::int64_t>(want.scales.size());
           i < quant_packed_bytes(g.count, c.block, format); ++i)
        ASSERT_EQ(base[i], std::byte{0}) << "padding " << i;
      const auto back = testing::quant_blocks_values(want, c.block);
      std::vector<float> amax(want.scales.size(), 0.0f);
      for (std::int64_t i = 0; i < g.count; ++i) {
        float& m = amax[static_cast<std::size_t>(i / c.block)];
        m = std::max(m, std::fabs(values[static_cast<std::size_t>(i)]));
      }
      for (std::int64_t i = 0; i < g.count; ++i) {
        const float got = read(dt, out, static_cast<std::size_t>(g.value + i));
        ASSERT_TRUE(same(got, stored_as(dt, back[i]))) << "value " << i << ": " << got << " against " << back[i];
        const float scale = want.scales[static_cast<std::size_t>(i / c.block)];
        if (std::isnan(scale)) {
          EXPECT_TRUE(std::isnan(got)) << "value " << i << " of a block holding inf or NaN came back " << got;
        } else {
          // The format's bound, then the dtype's rounding of the value that came back (half a step:
          // relative, or below its smallest normal its fixed smallest step, 2^-133 for bf16, 2^-24
          // for f16).
          const double dtype_step =
              dt == DataType::f32 ? 0
                                  : std::max(std::fabs(back[i]) * (dt == DataType::bf16 ? 0x1p-8 : 0x1p-11),
                                             dt == DataType::bf16 ? 0x1p-134 : 0x1p-25);
          EXPECT_LE(std::fabs(static_cast<double>(got) - values[static_cast<std::size_t>(i)]),
                    testing::quant_blocks_bound(amax[static_cast<std::size_t>(i / c.block)], bits) + dtype_step)
              << "value " << i << " = " << values[static_cast<std::size_t>(i)] << " came back " << got;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantBlocksCpu,
                         ::testing::Combine(::testing::Values(DataType::f32, DataType::bf16, DataType::f16),
                                            ::testing::Values(BlockBits::int8, BlockBits::int4)),
                         [](const auto& info) {
                           return std::string(async::to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) == BlockBits::int8 ? "_int8" : "_int4");
                         });

TEST(QuantBlocksCpuSizes, BadSizesAreRefusedByName) {
  const Kernels& k = cpu_kernels();
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "quant"});
  ASSERT_TRUE(stream);
  float x[4] = {};
  std::byte packed[64];
  const QuantSegment one{0, 4, 0, 0};
  auto zero_block = k.quantize_blocks(*stream, BlockBits::int8, DataType::f32, x, packed, &one, 1, 1, 0);
  ASSERT_FALSE(zero_block);
  EXPECT_NE(zero_block.error().message().find("int8 blocks of 0 values: expected 1 or more"), std::string::npos)
      << zero_block.error().message();
  auto negative = k.dequantize_blocks(*stream, BlockBits::int8, packed, DataType::f32, x, &one, -1, 1, 4);
  ASSERT_FALSE(negative);
  EXPECT_NE(negative.error().message().find("-1 segments"), std::string::npos) << negative.error().message();
  EXPECT_FALSE(k.quantize_blocks(*stream, BlockBits::int8, DataType::i32, x, packed, &one, 1, 1, 4));
  auto odd = k.quantize_blocks(*stream, BlockBits::int4, DataType::f32, x, packed, &one, 1, 1, 3);
  ASSERT_FALSE(odd);
  EXPECT_NE(odd.error().message().find("int4 blocks of 3 values: expected an even count"), std::string::npos)
      << odd.error().message();
  auto bits = k.quantize_blocks(*stream, static_cast<BlockBits>(5), DataType::f32, x, packed, &one, 1, 1, 4);
  ASSERT_FALSE(bits);
  EXPECT_NE(bits.error().message().find("5 bits: expected 8 or 4"), std::string::npos) << bits.error().message();
}

}  // namespace
}  // namespace coshard::modules::detail

namespace coshard::modules::detail {
namespace {

// The quantized reduction's end: three ranks' pieces of one block (each quantized alone, in the
// block's segments), dequantized and summed in f32 in rank order, times 1/3, rounded once: the
// reference's bits.
TEST_P(QuantBlocksCpu, TheSumOfPiecesIsTheReferences) {
  const auto [dt, format] = GetParam();
  const int bits = static_cast<int>(format);
  const Kernels& k = cpu_kernels();
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "quant"});
  ASSERT_TRUE(stream) << stream.error().message();
  for (const auto& c : testing::quant_block_cases(bits)) {
    SCOPED_TRACE(c.name);
    const auto n = static_cast<std::int64_t>(c.values.size());
    std::int64_t stride = 0, blocks = 0;
    const std::vector<std::int64_t> counts = n < 3 ? std::vector<std::int64_t>{n}
                                                   : std::vector<std::int64_t>{n / 3, n - n / 3};
    const auto plan = testing::quant_segments(counts, c.block, stride, blocks, bits);
    std::vector<QuantSegment> segments;
    for (const auto& g : plan) segments.push_back({g.value, g.count, g.packed, g.first_block});
    const auto count = static_cast<std::int64_t>(segments.size());
    constexpr int kPieces = 3;
    std::vector<std::byte> packed(static_cast<std::size_t>(kPieces * stride));
    std::vector<std::vector<float>> held;
    for (int p = 0; p < kPieces; ++p) {
      std::vector<float> v;
      for (std::size_t i = 0; i < c.values.size(); ++i) v.push_back(c.values[(i + static_cast<std::size_t>(p) * 7) % c.values.size()] * (p == 1 ? -0.5f : 1.0f));
      const Held x = hold(dt, v);
      held.push_back(x.values);
      ASSERT_TRUE(k.quantize_blocks(*stream, format, dt, x.bytes.data(), packed.data() + p * stride, segments.data(), count,
                                    blocks, c.block));
      ASSERT_TRUE(stream->synchronize());
    }
    std::vector<std::byte> out(static_cast<std::size_t>(n) * size_of(dt));
    ASSERT_TRUE(k.dequantize_sum_blocks(*stream, format, packed.data(), kPieces, stride, dt, out.data(), segments.data(),
                                        count, blocks, c.block, 1.0f / kPieces));
    ASSERT_TRUE(stream->synchronize());
    for (const auto& g : plan) {
      std::vector<float> sum(static_cast<std::size_t>(g.count), 0.0f);
      for (int p = 0; p < kPieces; ++p) {
        const std::vector<float> values(held[static_cast<std::size_t>(p)].begin() + g.value,
                                        held[static_cast<std::size_t>(p)].begin() + g.value + g.count);
        const auto back = testing::quant_blocks_values(testing::quant_blocks_reference(values, c.block, bits), c.block);
        for (std::int64_t i = 0; i < g.count; ++i) sum[static_cast<std::size_t>(i)] += back[static_cast<std::size_t>(i)];
      }
      for (std::int64_t i = 0; i < g.count; ++i) {
        const float want = stored_as(dt, sum[static_cast<std::size_t>(i)] * (1.0f / kPieces));
        const float got = read(dt, out, static_cast<std::size_t>(g.value + i));
        ASSERT_TRUE(same(got, want)) << "value " << g.value + i << ": " << got << " against " << want;
      }
    }
  }
}

}  // namespace
}  // namespace coshard::modules::detail
