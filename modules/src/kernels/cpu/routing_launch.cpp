// The CPU's routing and quantized-block launches (routing_launch.hpp): each checks its dtype and
// sizes, then runs its kernel on the stream.
#include "kernels/cpu/routing_launch.hpp"

#include "kernels/cpu/moe_routing.hpp"
#include "kernels/cpu/operands.hpp"
#include "kernels/cpu/quantize.hpp"

namespace coshard::modules::detail::cpu_launch {

Result<void> Launch::moe_route(async::Stream& s, DataType dt, const void* logits, std::int64_t tokens,
                               std::int64_t experts, std::int64_t k, bool renormalize, float* probs,
                               std::int32_t* chosen, float* weights) {
  COSHARD_TRY(check_cpu_dtype(dt));
  COSHARD_TRY(check_moe_routing(tokens, experts, k));
  return s.launch([=] { cpu::moe_route(dt, logits, tokens, experts, k, renormalize, probs, chosen, weights); });
}

Result<void> Launch::moe_route_backward(async::Stream& s, const float* probs, const std::int32_t* chosen,
                                        const float* weights, const float* dweights, const float* dprob_extra,
                                        std::int64_t tokens, std::int64_t experts, std::int64_t k, bool renormalize,
                                        DataType dt, void* dlogits) {
  COSHARD_TRY(check_cpu_dtype(dt));
  COSHARD_TRY(check_moe_routing(tokens, experts, k));
  return s.launch([=] {
    cpu::moe_route_backward(probs, chosen, weights, dweights, dprob_extra, tokens, experts, k, renormalize, dt,
                            dlogits);
  });
}

Result<void> Launch::moe_dispatch_plan(async::Stream& s, const std::int32_t* chosen, std::int64_t slots,
                                       std::int64_t experts, std::int32_t* counts, std::int32_t* order,
                                       std::int32_t* inverse) {
  COSHARD_TRY(check_moe_routing(slots, experts, 1));
  return s.launch([=] { cpu::moe_dispatch_plan(chosen, slots, experts, counts, order, inverse); });
}

Result<void> Launch::moe_gather_rows(async::Stream& s, DataType dt, const void* x, const std::int32_t* order,
                                     std::int64_t rows, std::int64_t k, std::int64_t width, void* out) {
  COSHARD_TRY(check_cpu_dtype(dt));
  COSHARD_TRY(check_moe_rows(rows, k, width));
  return s.launch([=] { cpu::moe_gather_rows(dt, x, order, rows, k, width, out); });
}

Result<void> Launch::moe_combine_rows(async::Stream& s, DataType dt, const void* rows, const std::int32_t* inverse,
                                      const float* weights, std::int64_t tokens, std::int64_t k, std::int64_t width,
                                      void* out) {
  COSHARD_TRY(check_cpu_dtype(dt));
  COSHARD_TRY(check_moe_rows(tokens * k, k, width));
  return s.launch([=] { cpu::moe_combine_rows(dt, rows, inverse, weights, tokens, k, width, out); });
}

Result<void> Launch::moe_combine_backward(async::Stream& s, DataType dt, const void* dy, const void* rows,
                                          const std::int32_t* inverse, const float* weights, std::int64_t tokens,
                                          std::int64_t k, std::int64_t width, void* d_rows, float* dweights) {
  COSHARD_TRY(check_cpu_dtype(dt));
  COSHARD_TRY(check_moe_rows(tokens * k, k, width));
  return s.launch(
      [=] { cpu::moe_combine_backward(dt, dy, rows, inverse, weights, tokens, k, width, d_rows, dweights); });
}

Result<void> Launch::quantize_blocks(async::Stream& s, BlockBits bits, DataType dt, const void* x, void* packed,
                                     const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                     std::int64_t block) {
  COSHARD_TRY(check_cpu_dtype(dt));
  COSHARD_TRY(check_quant_blocks(bits, segment_count, blocks, block));
  return s.launch([=] { cpu::quantize_blocks(bits, dt, x, packed, segments, segment_count, block); });
}

Result<void> Launch::dequantize_blocks(async::Stream& s, BlockBits bits, const void* packed, DataType dt, void* out,
                                       const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                       std::int64_t block) {
  COSHARD_TRY(check_cpu_dtype(dt));
  COSHARD_TRY(check_quant_blocks(bits, segment_count, blocks, block));
  return s.launch(
      [=] { cpu::dequantize_sum_blocks(bits, packed, 1, 0, dt, out, segments, segment_count, block, 1.0f); });
}

Result<void> Launch::dequantize_sum_blocks(async::Stream& s, BlockBits bits, const void* packed, std::int64_t pieces,
                                           std::int64_t stride, DataType dt, void* out, const QuantSegment* segments,
                                           std::int64_t segment_count, std::int64_t blocks, std::int64_t block,
                                           float factor) {
  COSHARD_TRY(check_cpu_dtype(dt));
  COSHARD_TRY(check_quant_blocks(bits, segment_count, blocks, block));
  return s.launch([=] {
    cpu::dequantize_sum_blocks(bits, packed, pieces, stride, dt, out, segments, segment_count, block, factor);
  });
}

}  // namespace coshard::modules::detail::cpu_launch
