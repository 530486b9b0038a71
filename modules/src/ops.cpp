#include "coshard/modules/ops.hpp"

#include <algorithm>
#include <string>

#include "kernels/kernels.hpp"

namespace coshard::modules::ops {

namespace {

// `t` is usable by an operation on ctx: defined, on its device, of a dtype its kernels serve.
Result<void> check_operand(const Context& ctx, const Tensor& t, std::string_view op, std::string_view role) {
  if (!t) return fail(ErrorCode::invalid_argument, "ops::", op, ": ", role, " is empty");
  if (!(t.device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, "ops::", op, ": ", role, " is ", t.describe(), ", expected a tensor on ",
                ctx.device().to_string(), " (the context's device)");
  if (ctx.kernels().supports(t.dtype())) return {};  // (the op's name is built only for the error)
  return detail::check_supported(ctx.kernels(), t.dtype(), ctx.device(), std::string("ops::").append(op));
}

Result<void> check_same(const Context& ctx, const Tensor& a, const Tensor& b, std::string_view op,
                        std::string_view role_a, std::string_view role_b) {
  COSHARD_TRY(check_operand(ctx, a, op, role_a));
  COSHARD_TRY(check_operand(ctx, b, op, role_b));
  if (!(a.shape() == b.shape()) || a.dtype() != b.dtype())
    return fail(ErrorCode::invalid_argument, "ops::", op, ": ", role_b, " is ", b.describe(), ", expected ",
                async::to_string(a.dtype()), a.shape().to_string(), " (the shape and dtype of ", role_a, ")");
  return {};
}

// A vector of x's last dimension and dtype.
Result<void> check_row_vector(const Context& ctx, const Tensor& x, const Tensor& v, std::string_view op,
                              std::string_view role) {
  COSHARD_TRY(check_operand(ctx, x, op, "x"));
  COSHARD_TRY(check_operand(ctx, v, op, role));
  if (v.numel() != x.shape().back() || v.shape().rank() != 1 || v.dtype() != x.dtype())
    return fail(ErrorCode::invalid_argument, "ops::", op, ": ", role, " is ", v.describe(), ", expected ",
                async::to_string(x.dtype()), "[", x.shape().back(), "] (the last dimension of x, ", x.describe(), ")");
  return {};
}

struct Product {
  std::int64_t m, n, k;
};

// The shapes of op(a) [M, K] and op(b) [K, N], checked.
Result<Product> product_of(const Context& ctx, const Tensor& a, const Tensor& b, const MatmulOptions& o,
                           std::string_view op) {
  COSHARD_TRY(check_operand(ctx, a, op, "a"));
  COSHARD_TRY(check_operand(ctx, b, op, "b"));
  if (a.dtype() != b.dtype())
    return fail(ErrorCode::invalid_argument, "ops::", op, ": b is ", b.describe(), ", expected ",
                async::to_string(a.dtype()), " (the dtype of a, ", a.describe(), ")");
  if (a.shape().rank() < 2 || b.shape().rank() < 2)
    return fail(ErrorCode::invalid_argument, "ops::", op, ": ", a.shape().rank() < 2 ? "a" : "b", " is ",
                (a.shape().rank() < 2 ? a : b).describe(), ", expected at least two dimensions (a matrix of rows)");
  const std::int64_t a_rows = a.shape().rows(), a_cols = a.shape().back();
  const std::int64_t b_rows = b.shape().rows(), b_cols = b.shape().back();
  const Product p{o.trans_a ? a_cols : a_rows, o.trans_b ? b_rows : b_cols, o.trans_a ? a_rows : a_cols};
  const std::int64_t b_inner = o.trans_b ? b_cols : b_rows;
  if (b_inner != p.k)
    return fail(ErrorCode::invalid_argument, "ops::", op, ": ", o.trans_a ? "a^T" : "a", " (", a.describe(), ") has ",
                p.k, " columns but ", o.trans_b ? "b^T" : "b", " (", b.describe(), ") has ", b_inner, " rows");
  return p;
}

Shape product_shape(const Tensor& a, const Product& p, const MatmulOptions& o) {
  return o.trans_a ? Shape{p.m, p.n} : a.shape().with_back(p.n);
}

Result<void> enqueue_matmul(Context& ctx, const Tensor& a, const Tensor& b, const Tensor& out, const Product& p,
                            const MatmulOptions& o) {
  const std::int64_t a_cols = a.shape().back(), b_cols = b.shape().back();
  detail::GemmArgs g{.trans_a = o.trans_a, .trans_b = o.trans_b, .m = p.m, .n = p.n, .k = p.k,
                     .a = a.data(), .lda = a_cols, .b = b.data(), .ldb = b_cols, .c = out.data(), .ldc = p.n,
                     .alpha = o.alpha, .beta = o.beta};
  return ctx.kernels().gemm(ctx.stream(), a.dtype(), g);
}

// Element by element on two tensors of one shape: into a new tensor, or into the first.
using BinaryKernel = Result<void> (detail::Kernels::*)(async::Stream&, DataType, const void*, const void*, void*,
                                                       std::int64_t) const;

Result<Tensor> binary(Context& ctx, const Tensor& a, const Tensor& b, BinaryKernel kernel, std::string_view op) {
  COSHARD_TRY(check_same(ctx, a, b, op, "a", "b"));
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(a.shape(), a.dtype()));
  COSHARD_TRY((ctx.kernels().*kernel)(ctx.stream(), a.dtype(), a.data(), b.data(), out.data(), a.numel()));
  return out;
}

Result<void> binary_into(Context& ctx, const Tensor& out, const Tensor& a, BinaryKernel kernel, std::string_view op) {
  COSHARD_TRY(check_same(ctx, out, a, op, "out", "a"));
  return (ctx.kernels().*kernel)(ctx.stream(), out.dtype(), out.data(), a.data(), out.data(), out.numel());
}

}  // namespace

Result<Tensor> matmul(Context& ctx, const Tensor& a, const Tensor& b, const MatmulOptions& options) {
  COSHARD_TRY_ASSIGN(const Product p, product_of(ctx, a, b, options, "matmul"));
  MatmulOptions o = options;
  o.beta = 0.0f;  // a new tensor: nothing to accumulate into
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(product_shape(a, p, o), a.dtype()));
  COSHARD_TRY(enqueue_matmul(ctx, a, b, out, p, o));
  return out;
}

Result<void> matmul_into(Context& ctx, const Tensor& a, const Tensor& b, const Tensor& out,
                         const MatmulOptions& options) {
  COSHARD_TRY_ASSIGN(const Product p, product_of(ctx, a, b, options, "matmul_into"));
  COSHARD_TRY(check_operand(ctx, out, "matmul_into", "out"));
  if (out.dtype() != a.dtype() || out.numel() != p.m * p.n || out.shape().back() != p.n)
    return fail(ErrorCode::invalid_argument, "ops::matmul_into: out is ", out.describe(), ", expected ",
                async::to_string(a.dtype()), product_shape(a, p, options).to_string(), " (", p.m, " rows of ", p.n, ")");
  return enqueue_matmul(ctx, a, b, out, p, options);
}

Result<Tensor> add(Context& ctx, const Tensor& a, const Tensor& b) { return binary(ctx, a, b, &detail::Kernels::add, "add"); }
Result<Tensor> mul(Context& ctx, const Tensor& a, const Tensor& b) { return binary(ctx, a, b, &detail::Kernels::mul, "mul"); }

Result<void> add_into(Context& ctx, const Tensor& out, const Tensor& a) {
  return binary_into(ctx, out, a, &detail::Kernels::add, "add_into");
}
Result<void> mul_into(Context& ctx, const Tensor& out, const Tensor& a) {
  return binary_into(ctx, out, a, &detail::Kernels::mul, "mul_into");
}

Result<void> scale_in_place(Context& ctx, const Tensor& x, float factor) {
  COSHARD_TRY(check_operand(ctx, x, "scale_in_place", "x"));
  return ctx.kernels().scale(ctx.stream(), x.dtype(), x.data(), factor, x.numel());
}

Result<Tensor> copy(Context& ctx, const Tensor& x) {
  COSHARD_TRY(check_operand(ctx, x, "copy", "x"));
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(x.shape(), x.dtype()));
  COSHARD_TRY(ctx.stream().copy(out.data(), x.data(), x.bytes()));
  return out;
}

Result<Tensor> cast(Context& ctx, const Tensor& x, DataType to) {
  COSHARD_TRY(check_operand(ctx, x, "cast", "x"));
  COSHARD_TRY(detail::check_supported(ctx.kernels(), to, ctx.device(), "ops::cast (to)"));
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(x.shape(), to));
  if (to == x.dtype()) {
    COSHARD_TRY(ctx.stream().copy(out.data(), x.data(), x.bytes()));
  } else {
    COSHARD_TRY(ctx.kernels().cast(ctx.stream(), x.dtype(), x.data(), to, out.data(), x.numel()));
  }
  return out;
}

Result<Tensor> gelu(Context& ctx, const Tensor& x) {
  COSHARD_TRY(check_operand(ctx, x, "gelu", "x"));
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(x.shape(), x.dtype()));
  COSHARD_TRY(ctx.kernels().gelu_forward(ctx.stream(), x.dtype(), x.data(), out.data(), x.numel()));
  return out;
}

Result<Tensor> gelu_backward(Context& ctx, const Tensor& x, const Tensor& dout) {
  COSHARD_TRY(check_same(ctx, x, dout, "gelu_backward", "x", "dout"));
  COSHARD_TRY_ASSIGN(Tensor dx, ctx.empty(x.shape(), x.dtype()));
  COSHARD_TRY(ctx.kernels().gelu_backward(ctx.stream(), x.dtype(), x.data(), dout.data(), dx.data(), x.numel()));
  return dx;
}

Result<void> add_bias(Context& ctx, const Tensor& x, const Tensor& bias) {
  COSHARD_TRY(check_row_vector(ctx, x, bias, "add_bias", "bias"));
  return ctx.kernels().bias_add(ctx.stream(), x.dtype(), x.data(), bias.data(), x.shape().rows(), x.shape().back());
}

Result<void> sum_rows_into(Context& ctx, const Tensor& x, const Tensor& out) {
  COSHARD_TRY(check_row_vector(ctx, x, out, "sum_rows_into", "out"));
  return ctx.kernels().bias_grad(ctx.stream(), x.dtype(), x.data(), out.data(), x.shape().rows(), x.shape().back());
}

Result<Tensor> sum(Context& ctx, const Tensor& x) {
  COSHARD_TRY(check_operand(ctx, x, "sum", "x"));
  const DataType dt = x.dtype();
  const DataType acc = detail::stat_dtype(dt);  // bf16/f16 are summed in f32, rounded once at the end
  Tensor wide = x;
  if (acc != dt) {
    COSHARD_TRY_ASSIGN(wide, cast(ctx, x, acc));
  }
  // Two passes in a fixed order: columns of a [n / cols, cols] view (cols the largest divisor of
  // n up to 1024, so the device sums them in parallel), then those partial sums.
  const std::int64_t n = x.numel();
  std::int64_t cols = std::min<std::int64_t>(n, 1024);
  while (cols > 1 && n % cols != 0) --cols;
  COSHARD_TRY_ASSIGN(Tensor partial, ctx.zeros(Shape{cols}, acc));
  COSHARD_TRY(ctx.kernels().bias_grad(ctx.stream(), acc, wide.data(), partial.data(), n / cols, cols));
  COSHARD_TRY_ASSIGN(Tensor total, ctx.zeros(Shape{1}, acc));
  COSHARD_TRY(ctx.kernels().bias_grad(ctx.stream(), acc, partial.data(), total.data(), cols, 1));
  if (acc == dt) return total;
  return cast(ctx, total, dt);
}

}  // namespace coshard::modules::ops
