// Plain structs shared by the C++23 kernels interface and the CUDA kernels (nvcc compiles C++20
// at most, so this header includes nothing of coshard's).
#pragma once

#include <cstdint>

namespace coshard::modules::detail {

// The optimizer's step control, in device memory, read and written only by kernels so that the
// host never waits for it: global-norm clipping, overflow skip and dynamic loss scaling.
struct StepState {
  float grad_sumsq = 0;  // sum of squares of the (still loss-scaled) gradients this step
  float found_inf = 0;   // > 0: a gradient was inf/NaN; the step is skipped
  float loss_scale = 1;
  float last_grad_norm = 0;  // unscaled, before clipping
  std::int32_t step = 0;     // optimizer steps taken (skipped ones excluded)
  std::int32_t good_steps = 0;
  std::int32_t skipped_steps = 0;
  std::int32_t last_skipped = 0;  // 1 when the last step was skipped
};
static_assert(sizeof(StepState) == 32);

struct AdamArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float max_grad_norm = 0.0f;  // 0: no clipping
  // Steps these elements' parameters were left out of (no gradient): like PyTorch, which counts
  // each parameter's own steps, their bias correction counts step - steps_missed.
  std::int32_t steps_missed = 0;
};

// One tensor of a multi-tensor optimizer launch: its fp32 master weights and state, its gradient
// (dtype code `gdt`, as collectives::DataType), and where the updated weights go cast down (dtype
// code `pdt`; null: the master weights are the parameters).
struct OptimizerTensor {
  float* master = nullptr;
  const void* grad = nullptr;
  float* state1 = nullptr;
  float* state2 = nullptr;
  void* param_out = nullptr;
  std::int64_t n = 0;
  std::int32_t gdt = 0;
  std::int32_t pdt = 0;
};
static_assert(sizeof(OptimizerTensor) == 56);

struct SgdArgs {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  float max_grad_norm = 0.0f;
};

struct LossScaleArgs {
  bool dynamic = false;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  std::int32_t growth_interval = 2000;
  float min_scale = 1.0f;
  float max_scale = 16777216.0f;  // 2^24
};

// Blocks of int8 or int4 (ZeRO++'s quantized weight gathers and gradient reduction): runs of values
// ("segments": a parameter's slice of a rank's shard, so no block mixes two parameters'
// magnitudes), each in blocks of `block` elements (a segment's last block may be shorter), each
// block symmetric with one f32 scale, max|x| / qmax (127 for int8, 7 for int4), and its values
// round-to-nearest-even(x / scale) in [-qmax, qmax] (a block of zeros: scale 0, values 0; a block
// holding inf or NaN: scale NaN, so every value of it comes back NaN, never a quiet finite one). A
// value comes back as q * scale in f32, rounded once to the storage dtype. A segment of n values
// is packed as its values (int8: a byte each; int4: two a byte, the first in the low nibble, so
// int4's blocks hold an even count and no byte holds two blocks' values), then its scales, each
// part at a multiple of 16 bytes (quant_packed_bytes), its padding zeroed.
enum class BlockBits : std::uint8_t { int8 = 8, int4 = 4 };
inline constexpr float quant_max(BlockBits bits) { return bits == BlockBits::int8 ? 127.0f : 7.0f; }
inline std::int64_t quant_block_count(std::int64_t n, std::int64_t block) { return (n + block - 1) / block; }
inline std::int64_t quant_values_bytes(std::int64_t n, BlockBits bits) { return bits == BlockBits::int8 ? n : (n + 1) / 2; }
inline std::int64_t quant_scales_offset(std::int64_t n, BlockBits bits) { return (quant_values_bytes(n, bits) + 15) / 16 * 16; }
inline std::int64_t quant_packed_bytes(std::int64_t n, std::int64_t block, BlockBits bits) {
  return quant_scales_offset(n, bits) + (quant_block_count(n, block) * 4 + 15) / 16 * 16;
}
// (int8's, the weights' format)
inline std::int64_t int8_scales_offset(std::int64_t n) { return quant_scales_offset(n, BlockBits::int8); }
inline std::int64_t int8_packed_bytes(std::int64_t n, std::int64_t block) { return quant_packed_bytes(n, block, BlockBits::int8); }

// One segment: values [value, value + count) of the values' buffer, packed at byte `packed` of
// the packed buffer; its blocks are numbered from first_block (the blocks of the segments before
// it), so a kernel finds a block's segment by a search.
struct QuantSegment {
  std::int64_t value = 0;
  std::int64_t count = 0;
  std::int64_t packed = 0;
  std::int64_t first_block = 0;
};
static_assert(sizeof(QuantSegment) == 32);

}  // namespace coshard::modules::detail
