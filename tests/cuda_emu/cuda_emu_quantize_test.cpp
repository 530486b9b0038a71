// The CUDA block int8 kernels of quantized gathers (quantize.cu, #63) on the CPU through the
// emulation: the bits of the format's reference (tests/support/int8_blocks.hpp), which the CPU's
// kernels also match, so a world of GPUs and the CPU's tests agree on every dequantized weight.
// Random and adversarial blocks, f32, bf16 and f16, two pieces side by side dequantized in one
// launch, the padding zeroed.
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
    std::vector<double> first, second;
    for (float v : c.values) {
      first.push_back(v);
      second.push_back(-v);
    }
    Stored x(dt, first), y(dt, second);
    const auto packed_bytes = static_cast<std::size_t>(detail::int8_packed_bytes(n, c.block));
    std::vector<std::byte> packed(2 * packed_bytes, std::byte{0x5a});
    ASSERT_EQ(cu::quantize_int8(nullptr, dt, x.data(), packed.data(), n, c.block), 0);
    ASSERT_EQ(cu::quantize_int8(nullptr, dt, y.data(), packed.data() + packed_bytes, n, c.block), 0);
    Stored out(dt, std::vector<double>(2 * c.values.size(), 0.0));
    ASSERT_EQ(cu::dequantize_int8(nullptr, packed.data(), 2, dt, out.data(), n, c.block), 0);
    const auto got = out.values();
    for (int piece = 0; piece < 2; ++piece) {
      const auto held = (piece == 0 ? x : y).values();
      const std::vector<float> values(held.begin(), held.end());
      const auto want = coshard::testing::int8_blocks_reference(values, c.block);
      const std::byte* base = packed.data() + piece * packed_bytes;
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(static_cast<std::int8_t>(base[i]), want.q[i]) << "piece " << piece << " value " << i;
      for (std::int64_t i = n; i < static_cast<std::int64_t>(packed_bytes); ++i) {
        if (i >= detail::int8_scales_offset(n) &&
            i < detail::int8_scales_offset(n) + 4 * static_cast<std::int64_t>(want.scales.size()))
          continue;
        ASSERT_EQ(base[i], std::byte{0}) << "padding byte " << i;
      }
      for (std::size_t b = 0; b < want.scales.size(); ++b) {
        float scale;
        std::memcpy(&scale, base + detail::int8_scales_offset(n) + 4 * b, 4);
        ASSERT_TRUE(same(scale, want.scales[b])) << "scale " << b << ": " << scale << " against " << want.scales[b];
      }
      const auto back = coshard::testing::int8_blocks_values(want, c.block);
      Stored rounded(dt, std::vector<double>(back.begin(), back.end()));
      const auto want_out = rounded.values();
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_TRUE(same(static_cast<float>(got[piece * n + i]), static_cast<float>(want_out[i])))
            << "value " << i << ": " << got[piece * n + i] << " against " << want_out[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmulatedInt8Blocks, ::testing::Values(kF32, kBF16, kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
