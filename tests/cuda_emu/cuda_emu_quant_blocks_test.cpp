// The CUDA block int8 and int4 kernels of quantized gathers and reduction (quantize.cu, #63) on the
// CPU through the emulation: the bits of the formats' reference (tests/support/quant_blocks.hpp),
// which the CPU's kernels also match, so a world of GPUs and the CPU's tests agree on every
// dequantized weight and reduced gradient. Random and adversarial blocks, f32, bf16 and f16,
// segments of several lengths in one launch each way (each block finding its own segment), the
// padding zeroed.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_emu.hpp"
#include "emu_support.hpp"
#include "kernels.cuh"
#include "support/quant_blocks.hpp"

namespace {

namespace cu = coshard::modules::cuda;
namespace detail = coshard::modules::detail;
using namespace coshard::cuda_emu_test;

bool same(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

class EmulatedQuantBlocks : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(EmulatedQuantBlocks, TheFormatsBits) {
  const auto [dt, bits] = GetParam();
  for (const auto& c : coshard::testing::quant_block_cases(bits)) {
    SCOPED_TRACE(c.name);
    const auto n = static_cast<std::int64_t>(c.values.size());
    std::vector<double> all;
    for (float v : c.values) all.push_back(v);
    for (float v : c.values) all.push_back(-v);
    Stored x(dt, all);
    std::int64_t packed_bytes = 0, blocks = 0;
    const auto plan =
        coshard::testing::quant_segments(coshard::testing::quant_case_counts(n), c.block, packed_bytes, blocks, bits);
    std::vector<detail::QuantSegment> segments;
    for (const auto& g : plan) segments.push_back({g.value, g.count, g.packed, g.first_block});
    const auto count = static_cast<std::int64_t>(segments.size());
    std::vector<std::byte> packed(static_cast<std::size_t>(packed_bytes), std::byte{0x5a});
    ASSERT_EQ(cu::quantize_blocks(nullptr, bits, dt, x.data(), packed.data(), segments.data(), count, blocks, c.block), 0);
    Stored out(dt, std::vector<double>(all.size(), 0.0));
    ASSERT_EQ(cu::dequantize_blocks(nullptr, bits, packed.data(), dt, out.data(), segments.data(), count, blocks, c.block), 0);
    const auto got = out.values();
    const auto held = x.values();
    for (const auto& g : plan) {
      SCOPED_TRACE("segment at " + std::to_string(g.value) + " of " + std::to_string(g.count));
      const std::vector<float> values(held.begin() + g.value, held.begin() + g.value + g.count);
      const auto want = coshard::testing::quant_blocks_reference(values, c.block, bits);
      const std::byte* base = packed.data() + g.packed;
      for (std::int64_t i = 0; i < g.count; ++i)
        ASSERT_EQ(coshard::testing::packed_q(base, i, bits), want.q[i]) << "value " << i;
      if (bits == 4 && g.count % 2 == 1)  // (an odd segment's last byte: its high nibble zero)
        ASSERT_EQ(static_cast<int>(base[g.count / 2]) >> 4, 0) << "the last byte's free nibble";
      const std::int64_t scales_at = coshard::testing::quant_scales_at(g.count, bits);
      for (std::int64_t i = coshard::testing::quant_values_bytes(g.count, bits);
           i < coshard::testing::quant_packed(g.count, c.block, bits); ++i) {
        if (i >= scales_at && i < scales_at + 4 * static_cast<std::int64_t>(want.scales.size())) continue;
        ASSERT_EQ(base[i], std::byte{0}) << "padding byte " << i;
      }
      for (std::size_t b = 0; b < want.scales.size(); ++b) {
        float scale;
        std::memcpy(&scale, base + scales_at + 4 * b, 4);
        ASSERT_TRUE(same(scale, want.scales[b])) << "scale " << b << ": " << scale << " against " << want.scales[b];
      }
      const auto back = coshard::testing::quant_blocks_values(want, c.block);
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
TEST_P(EmulatedQuantBlocks, TheSumOfPiecesIsTheReferences) {
  const auto [dt, bits] = GetParam();
  for (const auto& c : coshard::testing::quant_block_cases(bits)) {
    // (the sum's own cases: the format's corners are the test above's; each emulated thread block
    // starts 256 threads, so every case costs)
    if (c.name != "random_last_block_short" && c.name != "one_outlier" && c.name != "zeros" && c.name != "nan") continue;
    SCOPED_TRACE(c.name);
    const auto n = static_cast<std::int64_t>(c.values.size());
    std::int64_t stride = 0, blocks = 0;
    const std::vector<std::int64_t> counts = n < 3 ? std::vector<std::int64_t>{n}
                                                   : std::vector<std::int64_t>{n / 3, n - n / 3};
    const auto plan = coshard::testing::quant_segments(counts, c.block, stride, blocks, bits);
    std::vector<detail::QuantSegment> segments;
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
      ASSERT_EQ(cu::quantize_blocks(nullptr, bits, dt, x.data(), packed.data() + p * stride, segments.data(), count, blocks,
                                    c.block),
                0);
    }
    Stored out(dt, std::vector<double>(c.values.size(), 0.0));
    ASSERT_EQ(cu::dequantize_sum_blocks(nullptr, bits, packed.data(), kPieces, stride, dt, out.data(), segments.data(),
                                        count, blocks, c.block, 1.0f / kPieces),
              0);
    const auto got = out.values();
    for (const auto& g : plan) {
      std::vector<float> sum(static_cast<std::size_t>(g.count), 0.0f);
      for (int p = 0; p < kPieces; ++p) {
        const std::vector<float> values(held[static_cast<std::size_t>(p)].begin() + g.value,
                                        held[static_cast<std::size_t>(p)].begin() + g.value + g.count);
        const auto back =
            coshard::testing::quant_blocks_values(coshard::testing::quant_blocks_reference(values, c.block, bits), c.block);
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

INSTANTIATE_TEST_SUITE_P(Formats, EmulatedQuantBlocks,
                         // (int4's kernels differ from int8's in the packing alone: two dtypes cover its reads)
                         ::testing::Values(std::tuple{kF32, 8}, std::tuple{kBF16, 8}, std::tuple{kF16, 8},
                                           std::tuple{kF32, 4}, std::tuple{kBF16, 4}),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_int" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
