// The launches of the CUDA kernels of mixture-of-experts routing (moe_routing.cu) and quantized
// blocks (quantize.cu): their dtype and sizes checked, their status named.
#include "kernels/cuda/routing_launch.hpp"

#include "kernels/cuda/kernels.cuh"
#include "kernels/cuda/launch_check.hpp"

namespace coshard::modules::detail::cuda_launch {

namespace {
int code(DataType dt) noexcept {
  return static_cast<int>(dt);
}
}  // namespace

Result<void> Launch::moe_route(async::Stream& s, DataType dt, const void* logits, std::int64_t tokens,
                               std::int64_t experts, std::int64_t k, bool renormalize, float* probs,
                               std::int32_t* chosen, float* weights) {
  COSHARD_TRY(check_cuda_dtype(dt));
  COSHARD_TRY(check_moe_routing(tokens, experts, k));
  return check_launch(
      cuda::moe_route(s.native_handle(), code(dt), logits, tokens, experts, k, renormalize, probs, chosen, weights),
      "moe_route", s);
}

Result<void> Launch::moe_route_backward(async::Stream& s, const float* probs, const std::int32_t* chosen,
                                        const float* weights, const float* dweights, const float* dprob_extra,
                                        std::int64_t tokens, std::int64_t experts, std::int64_t k, bool renormalize,
                                        DataType dt, void* dlogits) {
  COSHARD_TRY(check_cuda_dtype(dt));
  COSHARD_TRY(check_moe_routing(tokens, experts, k));
  return check_launch(cuda::moe_route_backward(s.native_handle(), probs, chosen, weights, dweights, dprob_extra, tokens,
                                               experts, k, renormalize, code(dt), dlogits),
                      "moe_route_backward", s);
}

Result<void> Launch::moe_dispatch_plan(async::Stream& s, const std::int32_t* chosen, std::int64_t slots,
                                       std::int64_t experts, std::int32_t* counts, std::int32_t* order,
                                       std::int32_t* inverse) {
  COSHARD_TRY(check_moe_routing(slots, experts, 1));
  return check_launch(cuda::moe_dispatch_plan(s.native_handle(), chosen, slots, experts, counts, order, inverse),
                      "moe_dispatch_plan", s);
}

Result<void> Launch::moe_gather_rows(async::Stream& s, DataType dt, const void* x, const std::int32_t* order,
                                     std::int64_t rows, std::int64_t k, std::int64_t width, void* out) {
  COSHARD_TRY(check_cuda_dtype(dt));
  COSHARD_TRY(check_moe_rows(rows, k, width));
  return check_launch(cuda::moe_gather_rows(s.native_handle(), code(dt), x, order, rows, k, width, out),
                      "moe_gather_rows", s);
}

Result<void> Launch::moe_combine_rows(async::Stream& s, DataType dt, const void* rows, const std::int32_t* inverse,
                                      const float* weights, std::int64_t tokens, std::int64_t k, std::int64_t width,
                                      void* out) {
  COSHARD_TRY(check_cuda_dtype(dt));
  COSHARD_TRY(check_moe_rows(tokens * k, k, width));
  return check_launch(
      cuda::moe_combine_rows(s.native_handle(), code(dt), rows, inverse, weights, tokens, k, width, out),
      "moe_combine_rows", s);
}

Result<void> Launch::moe_combine_backward(async::Stream& s, DataType dt, const void* dy, const void* rows,
                                          const std::int32_t* inverse, const float* weights, std::int64_t tokens,
                                          std::int64_t k, std::int64_t width, void* d_rows, float* dweights) {
  COSHARD_TRY(check_cuda_dtype(dt));
  COSHARD_TRY(check_moe_rows(tokens * k, k, width));
  return check_launch(cuda::moe_combine_backward(s.native_handle(), code(dt), dy, rows, inverse, weights, tokens, k,
                                                 width, d_rows, dweights),
                      "moe_combine_backward", s);
}

Result<void> Launch::quantize_blocks(async::Stream& s, BlockBits bits, DataType dt, const void* x, void* packed,
                                     const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                     std::int64_t block) {
  COSHARD_TRY(check_cuda_dtype(dt));
  COSHARD_TRY(check_quant_blocks(bits, segment_count, blocks, block));
  return check_launch(cuda::quantize_blocks(s.native_handle(), static_cast<int>(bits), code(dt), x, packed, segments,
                                            segment_count, blocks, block),
                      "quantize_blocks", s);
}
Result<void> Launch::dequantize_blocks(async::Stream& s, BlockBits bits, const void* packed, DataType dt, void* out,
                                       const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                       std::int64_t block) {
  COSHARD_TRY(check_cuda_dtype(dt));
  COSHARD_TRY(check_quant_blocks(bits, segment_count, blocks, block));
  return check_launch(cuda::dequantize_blocks(s.native_handle(), static_cast<int>(bits), packed, code(dt), out,
                                              segments, segment_count, blocks, block),
                      "dequantize_blocks", s);
}

Result<void> Launch::dequantize_sum_blocks(async::Stream& s, BlockBits bits, const void* packed, std::int64_t pieces,
                                           std::int64_t stride, DataType dt, void* out, const QuantSegment* segments,
                                           std::int64_t segment_count, std::int64_t blocks, std::int64_t block,
                                           float factor) {
  COSHARD_TRY(check_cuda_dtype(dt));
  COSHARD_TRY(check_quant_blocks(bits, segment_count, blocks, block));
  return check_launch(cuda::dequantize_sum_blocks(s.native_handle(), static_cast<int>(bits), packed, pieces, stride,
                                                  code(dt), out, segments, segment_count, blocks, block, factor),
                      "dequantize_sum_blocks", s);
}

}  // namespace coshard::modules::detail::cuda_launch
