// The products of an activation with a weight W [out, in] (PyTorch's layout), shared by Linear and
// the tied output use of TokenEmbedding (private to the layers).
#pragma once

#include "coshard/modules/module.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

// y [..., out] = x [..., in] W^T (+ bias [out] on every row, when given).
inline Result<Tensor> times_weight_transposed(Context& ctx, const Tensor& x, const Parameter& w, std::int64_t in,
                                              std::int64_t out, const Parameter* bias = nullptr) {
  const std::int64_t rows = x.shape().rows();
  COSHARD_TRY_ASSIGN(Tensor y, ctx.empty(x.shape().with_back(out), x.dtype()));
  GemmArgs g{.trans_b = true, .m = rows, .n = out, .k = in, .a = x.data(), .lda = in, .b = w.value().data(),
             .ldb = in, .c = y.data(), .ldc = out};
  if (bias) COSHARD_TRY(ctx.kernels().gemm_bias(ctx.stream(), x.dtype(), g, bias->value().data()));
  else COSHARD_TRY(ctx.kernels().gemm(ctx.stream(), x.dtype(), g));
  return y;
}

// Backward of the above: returns dx = dy W, and adds dy^T x into W's gradient when it trains.
inline Result<Tensor> weight_product_backward(Context& ctx, const Tensor& x, const Tensor& dy, const Parameter& w,
                                              std::int64_t in, std::int64_t out) {
  const DataType dt = x.dtype();
  const std::int64_t rows = x.shape().rows();
  auto& k = ctx.kernels();
  COSHARD_TRY_ASSIGN(Tensor dx, ctx.empty(x.shape(), dt));
  GemmArgs gx{.m = rows, .n = in, .k = out, .a = dy.data(), .lda = out, .b = w.value().data(), .ldb = in,
              .c = dx.data(), .ldc = in};
  COSHARD_TRY(k.gemm(ctx.stream(), dt, gx));
  if (w.grad()) {
    GemmArgs gw{.trans_a = true, .m = out, .n = in, .k = rows, .a = dy.data(), .lda = out, .b = x.data(), .ldb = in,
                .c = w.grad().data(), .ldc = in, .beta = 1.0f};
    COSHARD_TRY(k.gemm(ctx.stream(), dt, gw));
  }
  return dx;
}

}  // namespace coshard::modules::detail
