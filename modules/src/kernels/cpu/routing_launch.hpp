// The launches of the CPU's kernels of mixture-of-experts routing (moe_routing.hpp) and quantized
// blocks (quantize.hpp), for CpuKernels (cpu_kernels.cpp): the Kernels entries of the same names
// (kernels.hpp), their dtype and sizes checked. Private.
#pragma once

#include <cstdint>

#include "coshard/async/stream.hpp"
#include "kernels/kernel_args.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail::cpu_launch {

struct Launch {
  static Result<void> moe_route(async::Stream& s, DataType dt, const void* logits, std::int64_t tokens,
                                std::int64_t experts, std::int64_t k, bool renormalize, float* probs,
                                std::int32_t* chosen, float* weights);
  static Result<void> moe_route_backward(async::Stream& s, const float* probs, const std::int32_t* chosen,
                                         const float* weights, const float* dweights, const float* dprob_extra,
                                         std::int64_t tokens, std::int64_t experts, std::int64_t k, bool renormalize,
                                         DataType dt, void* dlogits);
  static Result<void> moe_dispatch_plan(async::Stream& s, const std::int32_t* chosen, std::int64_t slots,
                                        std::int64_t experts, std::int32_t* counts, std::int32_t* order,
                                        std::int32_t* inverse);
  static Result<void> moe_gather_rows(async::Stream& s, DataType dt, const void* x, const std::int32_t* order,
                                      std::int64_t rows, std::int64_t k, std::int64_t width, void* out);
  static Result<void> moe_combine_rows(async::Stream& s, DataType dt, const void* rows, const std::int32_t* inverse,
                                       const float* weights, std::int64_t tokens, std::int64_t k, std::int64_t width,
                                       void* out);
  static Result<void> moe_combine_backward(async::Stream& s, DataType dt, const void* dy, const void* rows,
                                           const std::int32_t* inverse, const float* weights, std::int64_t tokens,
                                           std::int64_t k, std::int64_t width, void* d_rows, float* dweights);
  static Result<void> quantize_blocks(async::Stream& s, BlockBits bits, DataType dt, const void* x, void* packed,
                                      const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                      std::int64_t block);
  static Result<void> dequantize_blocks(async::Stream& s, BlockBits bits, const void* packed, DataType dt, void* out,
                                        const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                        std::int64_t block);
  static Result<void> dequantize_sum_blocks(async::Stream& s, BlockBits bits, const void* packed, std::int64_t pieces,
                                            std::int64_t stride, DataType dt, void* out, const QuantSegment* segments,
                                            std::int64_t segment_count, std::int64_t blocks, std::int64_t block,
                                            float factor);
};

}  // namespace coshard::modules::detail::cpu_launch
