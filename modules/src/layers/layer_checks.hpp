// What every layer checks of its inputs, parameters and gradients (private to the layers):
// each failure names the layer, the value and what was expected.
#pragma once

#include <cstdint>
#include <string_view>

#include "coshard/modules/module.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

// The input must be a floating tensor on the context's device, with `last` columns (0: any).
inline Result<void> check_activation(const Context& ctx, const Tensor& x, std::int64_t last, std::string_view who) {
  if (!x) return fail(ErrorCode::invalid_argument, who, ": input is empty");
  if (!(x.device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, who, ": input ", x.describe(), " is not on the context's device ",
                ctx.device().to_string());
  if (x.shape().rank() < 1) return fail(ErrorCode::invalid_argument, who, ": input ", x.describe(), " has rank 0");
  if (last > 0 && x.shape().back() != last)
    return fail(ErrorCode::invalid_argument, who, ": input ", x.describe(), ", expected last dimension ", last);
  return check_supported(ctx.kernels(), x.dtype(), ctx.device(), who);
}

inline Result<void> check_param(const Parameter& p, DataType dtype, std::string_view who) {
  if (!p.bound())
    return fail(ErrorCode::invalid_argument, who, ": parameter ", p.name(),
                " is not bound to memory (create a ParameterStore or an engine for the model first)");
  if (p.value().dtype() != dtype)
    return fail(ErrorCode::invalid_argument, who, ": parameter ", p.name(), " is ",
                async::to_string(p.value().dtype()), " but the input is ", async::to_string(dtype));
  return {};
}

// A parameter's gradient takes part only when bound (an unbound gradient is a frozen parameter).
inline bool trains(const Parameter& p) noexcept { return static_cast<bool>(p.grad()); }

// Where a kernel that always writes `p`'s gradient puts it: the bound gradient, or for a frozen
// parameter a zeroed scratch tensor nobody reads.
inline Result<Tensor> grad_or_scratch(Context& ctx, const Parameter& p, DataType dtype) {
  if (trains(p)) return p.grad();
  return ctx.zeros(p.shape(), dtype);
}

// The f32 scratch a norm's backward asks of the backend for `rows` rows of `dim` (an empty tensor
// where it asks none: the CPU's).
inline Result<Tensor> norm_backward_scratch(Context& ctx, DataType dtype, std::int64_t rows, std::int64_t dim,
                                            bool with_bias) {
  const std::int64_t n = ctx.kernels().norm_backward_scratch(dtype, rows, dim, with_bias);
  if (n <= 0) return Tensor{};
  return ctx.empty(Shape{n}, DataType::f32);
}

// The gradient given to backward must have the output's shape and dtype.
inline Result<void> check_grad(const Tensor& grad, Shape expected, DataType dtype, std::string_view who) {
  if (!grad || !(grad.shape() == expected) || grad.dtype() != dtype)
    return fail(ErrorCode::invalid_argument, who, ": grad_output ", grad ? grad.describe() : std::string("empty"),
                ", expected ", async::to_string(dtype), expected.to_string());
  return {};
}

// For layers whose output has the saved input's shape and dtype.
inline Result<void> check_grad(const Tensor& saved, const Tensor& grad, std::string_view who) {
  if (!saved) return fail(ErrorCode::invalid_argument, who, ": backward without a forward (nothing saved)");
  return check_grad(grad, saved.shape(), saved.dtype(), who);
}

// The seed of a loss's backward: one element of the loss's dtype, on the context's device.
inline Result<void> check_seed(const Context& ctx, const Tensor& seed, DataType dt, std::string_view who) {
  if (!seed || seed.numel() != 1 || seed.dtype() != detail::stat_dtype(dt) || !(seed.device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, who, ": seed ", seed ? seed.describe() : "empty", ", expected one ",
                async::to_string(detail::stat_dtype(dt)), " on ", ctx.device().to_string());
  return {};
}

}  // namespace coshard::modules::detail
