// The Kernels entries of mixture-of-experts routing and quantized blocks, forwarded to a backend's
// launches (`Launch`: a struct of static functions of the same names, each checking its dtype and
// sizes: cpu/routing_launch.hpp, cuda/routing_launch.hpp), so each backend's class takes them by
// deriving from RoutingEntries<its Launch> instead of listing them. Private.
#pragma once

#include <cstdint>

#include "kernels/kernel_args.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

template <class Launch>
class RoutingEntries : public Kernels {
 public:
  Result<void> moe_route(async::Stream& s, DataType dt, const void* logits, std::int64_t tokens, std::int64_t experts,
                         std::int64_t k, bool renormalize, float* probs, std::int32_t* chosen,
                         float* weights) const override {
    return Launch::moe_route(s, dt, logits, tokens, experts, k, renormalize, probs, chosen, weights);
  }
  Result<void> moe_route_backward(async::Stream& s, const float* probs, const std::int32_t* chosen,
                                  const float* weights, const float* dweights, const float* dprob_extra,
                                  std::int64_t tokens, std::int64_t experts, std::int64_t k, bool renormalize,
                                  DataType dt, void* dlogits) const override {
    return Launch::moe_route_backward(s, probs, chosen, weights, dweights, dprob_extra, tokens, experts, k, renormalize,
                                      dt, dlogits);
  }
  Result<void> moe_dispatch_plan(async::Stream& s, const std::int32_t* chosen, std::int64_t slots, std::int64_t experts,
                                 std::int32_t* counts, std::int32_t* order, std::int32_t* inverse) const override {
    return Launch::moe_dispatch_plan(s, chosen, slots, experts, counts, order, inverse);
  }
  Result<void> moe_gather_rows(async::Stream& s, DataType dt, const void* x, const std::int32_t* order,
                               std::int64_t rows, std::int64_t k, std::int64_t width, void* out) const override {
    return Launch::moe_gather_rows(s, dt, x, order, rows, k, width, out);
  }
  Result<void> moe_combine_rows(async::Stream& s, DataType dt, const void* rows, const std::int32_t* inverse,
                                const float* weights, std::int64_t tokens, std::int64_t k, std::int64_t width,
                                void* out) const override {
    return Launch::moe_combine_rows(s, dt, rows, inverse, weights, tokens, k, width, out);
  }
  Result<void> moe_combine_backward(async::Stream& s, DataType dt, const void* dy, const void* rows,
                                    const std::int32_t* inverse, const float* weights, std::int64_t tokens,
                                    std::int64_t k, std::int64_t width, void* d_rows, float* dweights) const override {
    return Launch::moe_combine_backward(s, dt, dy, rows, inverse, weights, tokens, k, width, d_rows, dweights);
  }
  Result<void> quantize_blocks(async::Stream& s, BlockBits bits, DataType dt, const void* x, void* packed,
                               const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                               std::int64_t block) const override {
    return Launch::quantize_blocks(s, bits, dt, x, packed, segments, segment_count, blocks, block);
  }
  Result<void> dequantize_blocks(async::Stream& s, BlockBits bits, const void* packed, DataType dt, void* out,
                                 const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                 std::int64_t block) const override {
    return Launch::dequantize_blocks(s, bits, packed, dt, out, segments, segment_count, blocks, block);
  }
  Result<void> dequantize_sum_blocks(async::Stream& s, BlockBits bits, const void* packed, std::int64_t pieces,
                                     std::int64_t stride, DataType dt, void* out, const QuantSegment* segments,
                                     std::int64_t segment_count, std::int64_t blocks, std::int64_t block,
                                     float factor) const override {
    return Launch::dequantize_sum_blocks(s, bits, packed, pieces, stride, dt, out, segments, segment_count, blocks,
                                         block, factor);
  }
};

}  // namespace coshard::modules::detail
