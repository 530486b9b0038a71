// Operations for modules and losses of your own, on the context's device: the same kernels the
// built-in layers use, on a CPU stream or a CUDA stream alike, so a module written with them runs
// wherever the model runs (and under the ZeRO engine, whose parameters are ordinary tensors
// while a module runs).
//
//   async::Task<Result<Tensor>> MyGate::forward(Context& ctx, Tensor x) {
//     COSHARD_CO_TRY_ASSIGN(Tensor h, ops::matmul(ctx, x, weight().value(), {.trans_b = true}));
//     COSHARD_CO_TRY(ops::add_bias(ctx, h, bias()->value()));
//     co_return ops::mul(ctx, h, x);
//   }
//
// Rules:
// - Every operation checks its operands first (defined, on the context's device, one dtype the
//   device's kernels serve, shapes that fit) and names the one that does not; nothing is enqueued
//   then.
// - Each enqueues on ctx.stream() and returns at once: results are tensors of the context's
//   allocator, valid in stream order (read them with ctx.read). Nothing waits on the host.
// - Tensors are dense and row-major; "rows" are all dimensions but the last.
// - Element types: f32, bf16 and f16 everywhere; f64 on the CPU (gradient checks). bf16/f16
//   compute in f32 (matrix products accumulate in f32 from the half-precision operands) and round
//   each output once.
// - `_into` and in-place forms write into a tensor given; `out += ...` forms accumulate, the way
//   parameter gradients do.
#pragma once

#include "coshard/modules/module.hpp"
#include "coshard/modules/tensor.hpp"

namespace coshard::modules::ops {

struct MatmulOptions {
  bool trans_a = false;  // use a^T
  bool trans_b = false;  // use b^T (a Linear's weight [out, in] is used transposed)
  float alpha = 1.0f;
  float beta = 0.0f;     // matmul_into: out = alpha * op(a) op(b) + beta * out (1: accumulate)
};

// op(a) [M, K] times op(b) [K, N], each operand taken as the matrix [rows, last dimension] (so
// x [B, T, C] times a weight is every row through it, as a Linear does, and dh^T x sums over every
// row). The result is [M, N]; without trans_a it keeps a's leading dimensions: a.shape with N last.
Result<Tensor> matmul(Context& ctx, const Tensor& a, const Tensor& b, const MatmulOptions& options = {});
Result<void> matmul_into(Context& ctx, const Tensor& a, const Tensor& b, const Tensor& out,
                         const MatmulOptions& options = {});

// Element by element, on tensors of one shape.
Result<Tensor> add(Context& ctx, const Tensor& a, const Tensor& b);
Result<Tensor> mul(Context& ctx, const Tensor& a, const Tensor& b);
Result<void> add_into(Context& ctx, const Tensor& out, const Tensor& a);  // out += a
Result<void> mul_into(Context& ctx, const Tensor& out, const Tensor& a);  // out *= a
Result<void> scale_in_place(Context& ctx, const Tensor& x, float factor);  // x *= factor
Result<Tensor> copy(Context& ctx, const Tensor& x);
Result<Tensor> cast(Context& ctx, const Tensor& x, DataType to);

// GELU (tanh approximation, GPT-2's) and its backward: dx = dout * gelu'(x).
Result<Tensor> gelu(Context& ctx, const Tensor& x);
Result<Tensor> gelu_backward(Context& ctx, const Tensor& x, const Tensor& dout);

// Rows and columns: x [..., C] with a vector of C.
Result<void> add_bias(Context& ctx, const Tensor& x, const Tensor& bias);        // x[r, :] += bias
Result<void> sum_rows_into(Context& ctx, const Tensor& x, const Tensor& out);  // out[C] += sum over rows of x
// The sum of all elements, one element of x's dtype, summed in a fixed order (runs repeat).
Result<Tensor> sum(Context& ctx, const Tensor& x);

}  // namespace coshard::modules::ops
