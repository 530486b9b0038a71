// The CUDA block int8 kernels of quantized gathers (quantize.cu, #63) on the CPU through the
// emulation: the bits of the format's reference (tests/support/int8_blocks.hpp), which the CPU's
// kernels also match, so a world of GPUs and the CPU's tests agree on every dequantized weight.
// Random and adversarial blocks, f32, bf16 and f16, segments of several lengths in one launch each
// way (each block finding its own segment), the padding zeroed.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "cuda_emu.hpp"
#include "emu_support.hpp"
#include "kernels.cuh"
#include "support/int8_blocks.hpp"

namespace {

namespace cu = coshard::modules::cuda;
namespace detail = coshard::modules::detail;
using namespace coshard::cuda_emu_test;

bool same(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

class EmulatedInt8Blocks : public ::testing::TestWithParam<int> {};

TEST_P(EmulatedInt8Blocks, TheFormatsBits) {
  const int dt = GetParam();
  for (const auto& c : coshard::testing::int8_block_cases()) {
    SCOPED_TRACE(c.name);
    const auto n = static_cast<std::int64_t>(c.values.size());
    std::vector<double> all;
    for (float v : c.values) all.push_back(v);
    for (float v : c.values) all.push_back(-v);
    Stored x(dt, all);
    std::int64_t packed_bytes = 0, blocks = 0;
    const auto plan = coshard::testing::int8_segments(coshard::testing::int8_case_counts(n), c.block, packed_bytes, blocks);
    std::vector<detail::Int8Segment> segments;
    for (const auto& g : plan) segments.push_back({g.value, g.count, g.packed, g.first_block});
    const auto count = static_cast<std::int64_t>(segments.size());
    std::vector<std::byte> packed(static_cast<std::size_t>(packed_bytes), std::byte{0x5a});
    ASSERT_EQ(cu::quantize_int8(nullptr, dt, x.data(), packed.data(), segments.data(), count, blocks, c.block), 0);
    Stored out(dt, std::vector<double>(all.size(), 0.0));
    ASSERT_EQ(cu::dequantize_int8(nullptr, packed.data(), dt, out.data(), segments.data(), count, blocks, c.block), 0);
    const auto got = out.values();
    const auto held = x.values();
    for (const auto& g : plan) {
      SCOPED_TRACE("segment at " + std::to_string(g.value) + " of " + std::to_string(g.count));
      const std::vector<float> values(held.begin() + g.value, held.begin() + g.value + g.count);
      const auto want = coshard::testing::int8_blocks_reference(values, c.block);
      const std::byte* base = packed.data() + g.packed;
      for (std::int64_t i = 0; i < g.count; ++i) ASSERT_EQ(static_cast<std::int8_t>(base[i]), want.q[i]) << "value " << i;
      const std::int64_t scales_at = detail::int8_scales_offset(g.count);
      for (std::int64_t i = g.count; i < detail::int8_packed_bytes(g.count, c.block); ++i) {
        if (i >= scales_at && i < scales_at + 4 * static_cast<std::int64_t>(want.scales.size())) continue;
        ASSERT_EQ(base[i], std::byte{0}) << "padding byte " << i;
      }
      for (std::size_t b = 0; b < want.scales.size(); ++b) {
        float scale;
        std::memcpy(&scale, base + scales_at + 4 * b, 4);
        ASSERT_TRUE(same(scale, want.scales[b])) << "scale " << b << ": " << scale << " against " << want.scales[b];
      }
      const auto back = coshard::testing::int8_blocks_values(want, c.block);
      Stored rounded(dt, std::vector<double>(back.begin(), back.end()));
      const auto want_out = rounded.values();
      for (std::int64_t i = 0; i < g.count; ++i)
        ASSERT_TRUE(same(static_cast<float>(got[g.value + i]), static_cast<float>(want_out[i])))
            << "value " << i << ": " << got[g.value + i] << " against " << want_out[i];
    }
  }
}

// The quantized reduction's end: three pieces of one block summed in f32 in piece order, times
// 1/3, rounded once: the reference's bits (which the CPU's kernel also gives).
TEST_P(EmulatedInt8Blocks, TheSumOfPiecesIsTheReferences) {
  const int dt = GetParam();
  for (const auto& c : coshard::testing::int8_block_cases()) {
    // (the sum's own cases: the format's corners are the test above's; each emulated thread block
    // starts 256 threads, so every case costs)
    if (c.name != "random_last_block_short" && c.name != "one_outlier" && c.name != "zeros" && c.name != "nan") continue;
    SCOPED_TRACE(c.name);
    const auto n = static_cast<std::int64_t>(c.values.size());
    std::int64_t stride = 0, blocks = 0;
    const std::vector<std::int64_t> counts = n < 3 ? std::vector<std::int64_t>{n}
                                                   : std::vector<std::int64_t>{n / 3, n - n / 3};
    const auto plan = coshard::testing::int8_segments(counts, c.block, stride, blocks);
    std::vector<detail::Int8Segment> segments;
    for (const auto& g : plan) segments.push_back({g.value, g.count, g.packed, g.first_block});
    const auto count = static_cast<std::int64_t>(segments.size());
    constexpr int kPieces = 3;
    std::vector<std::byte> packed(static_cast<std::size_t>(kPieces * stride));
    std::vector<std::vector<double>> held;
    for (int p = 0; p < kPieces; ++p) {
      std::vector<double> v;
      for (std::size_t i = 0; i < c.values.size(); ++i)
        v.push_back(c.values[(i + static_cast<std::size_t>(p) * 7) % c.values.size()] * (p == 1 ? -0.5f : 1.0f));
      Stored x(dt, v);
      held.push_back(x.values());
      ASSERT_EQ(cu::quantize_int8(nullptr, dt, x.data(), packed.data() + p * stride, segments.data(), count, blocks, c.block), 0);
    }
    Stored out(dt, std::vector<double>(c.values.size(), 0.0));
    ASSERT_EQ(cu::dequantize_sum_int8(nullptr, packed.data(), kPieces, stride, dt, out.data(), segments.data(), count,
                                      blocks, c.block, 1.0f / kPieces),
              0);
    const auto got = out.values();
    for (const auto& g : plan) {
      std::vector<float> sum(static_cast<std::size_t>(g.count), 0.0f);
      for (int p = 0; p < kPieces; ++p) {
        const std::vector<float> values(held[static_cast<std::size_t>(p)].begin() + g.value,
                                        held[static_cast<std::size_t>(p)].begin() + g.value + g.count);
        const auto back = coshard::testing::int8_blocks_values(coshard::testing::int8_blocks_reference(values, c.block), c.block);
        for (std::int64_t i = 0; i < g.count; ++i) sum[static_cast<std::size_t>(i)] += back[static_cast<std::size_t>(i)];
      }
      std::vector<double> scaled;
      for (float v : sum) scaled.push_back(v * (1.0f / kPieces));
      const auto want = Stored(dt, scaled).values();
      for (std::int64_t i = 0; i < g.count; ++i)
        ASSERT_TRUE(same(static_cast<float>(got[g.value + i]), static_cast<float>(want[i])))
            << "value " << g.value + i << ": " << got[g.value + i] << " against " << want[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmulatedInt8Blocks, ::testing::Values(kF32, kBF16, kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
