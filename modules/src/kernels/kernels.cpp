// What every backend of Kernels shares: the default fused and multi-tensor entry points (the
// one-tensor kernels in order, so a backend without its own gives the same bits) and the dtype
// check the layers call.
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

Result<void> Kernels::gemm_bias(async::Stream& s, DataType dt, const GemmArgs& g, const void* bias) const {
  COSHARD_TRY(gemm(s, dt, g));
  return bias_add(s, dt, g.c, bias, g.m, g.n);
}

Result<void> Kernels::grad_stats_multi(async::Stream& s, std::span<const OptimizerTensor> tensors,
                                       StepState* state) const {
  for (const auto& t : tensors) COSHARD_TRY(grad_stats(s, static_cast<DataType>(t.gdt), t.grad, t.n, state));
  return {};
}

Result<void> Kernels::adamw_multi(async::Stream& s, std::span<const OptimizerTensor> tensors, const AdamArgs& args,
                                  const StepState* state) const {
  for (const auto& t : tensors)
    COSHARD_TRY(adamw(s, t.master, static_cast<DataType>(t.gdt), t.grad, t.state1, t.state2,
                      static_cast<DataType>(t.pdt), t.param_out, t.n, args, state));
  return {};
}

std::int64_t Kernels::norm_backward_scratch(DataType /*dt*/, std::int64_t /*N*/, std::int64_t /*C*/,
                                            bool /*with_bias*/) const {
  return 0;
}

AttentionBuffers Kernels::attention_buffers(DataType dt, std::int64_t B, std::int64_t T, std::int64_t H,
                                            std::int64_t /*KVH*/, std::int64_t /*hd*/) const {
  return {.saved = Shape{B, H, T, T}, .saved_dtype = dt, .scratch = Shape{B, H, T, T}, .scratch_dtype = dt};
}

Result<void> check_moe_routing(std::int64_t tokens, std::int64_t experts, std::int64_t k) {
  constexpr std::int64_t kI32 = std::int64_t{1} << 31;
  if (experts < 1 || experts >= kI32)
    return fail(ErrorCode::invalid_argument, "routing over ", experts, " experts: expected 1 to 2^31 - 1");
  if (k < 1 || k > experts)
    return fail(ErrorCode::invalid_argument, "routing to the top ", k, " of ", experts, " experts: expected 1 to ", experts);
  if (tokens < 0 || tokens >= kI32 / k)
    return fail(ErrorCode::invalid_argument, "routing ", tokens, " tokens to ", k,
                " experts each: expected 0 or more, fewer than 2^31 slots");
  return {};
}

Result<void> check_moe_rows(std::int64_t rows, std::int64_t k, std::int64_t width) {
  if (k < 1 || rows < 0 || rows >= (std::int64_t{1} << 31) || width < 0)
    return fail(ErrorCode::invalid_argument, "expert rows: ", rows, " rows of ", width, " for ", k,
                " experts a token: expected k >= 1, 0 to 2^31 - 1 rows, a width >= 0");
  return {};
}

Result<void> check_quant_blocks(BlockBits bits, std::int64_t segment_count, std::int64_t blocks, std::int64_t block) {
  const char* name = bits == BlockBits::int8 ? "int8" : "int4";
  if (bits != BlockBits::int8 && bits != BlockBits::int4)
    return fail(ErrorCode::invalid_argument, "quantized blocks of ", static_cast<int>(bits), " bits: expected 8 or 4");
  if (segment_count < 0 || blocks < 0)
    return fail(ErrorCode::invalid_argument, name, " blocks: ", segment_count, " segments of ", blocks,
                " blocks: expected 0 or more");
  if (block < 1) return fail(ErrorCode::invalid_argument, name, " blocks of ", block, " values: expected 1 or more");
  if (bits == BlockBits::int4 && block % 2 != 0)
    return fail(ErrorCode::invalid_argument, "int4 blocks of ", block,
                " values: expected an even count (two values a byte; no byte holds two blocks' values)");
  return {};
}

Result<void> check_supported(const Kernels& k, DataType dt, async::Device device, std::string_view what) {
  if (!k.supports(dt))
    return fail(ErrorCode::unsupported, what, ": dtype ", async::to_string(dt), " is not served by the ",
                device.is_cpu() ? "CPU kernels (f32, f64, bf16, f16)" : "CUDA kernels (f32, bf16, f16)");
  return {};
}


}  // namespace coshard::modules::detail
