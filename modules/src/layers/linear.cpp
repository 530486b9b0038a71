// The linear layer: y = x W^T + b, its products through weight_products.hpp.
#include "coshard/modules/layers.hpp"

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"
#include "layers/weight_products.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_grad;
using detail::check_param;
using detail::trains;

}  // namespace

// ---- Linear ----

Linear::Linear(std::int64_t in_features, std::int64_t out_features, bool bias, Init weight_init)
    : in_(in_features), out_(out_features) {
  register_parameter("weight", Shape{out_features, in_features}, weight_init);
  if (bias) register_parameter("bias", Shape{out_features}, Init::zeros());
}

async::Task<Result<Tensor>> Linear::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(check_activation(ctx, input, in_, "Linear"));
  const DataType dt = input.dtype();
  COSHARD_CO_TRY(check_param(weight(), dt, "Linear"));
  if (bias()) COSHARD_CO_TRY(check_param(*bias(), dt, "Linear"));
  COSHARD_CO_TRY_ASSIGN(Tensor out, detail::times_weight_transposed(ctx, input, weight(), in_, out_, bias()));
  input_.push(std::move(input));
  co_return out;
}

async::Task<Result<Tensor>> Linear::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(const Tensor input, input_.pop("Linear"));
  const DataType dt = input.dtype();
  COSHARD_CO_TRY(check_grad(grad_output, input.shape().with_back(out_), dt, "Linear"));
  const std::int64_t rows = input.shape().rows();
  COSHARD_CO_TRY_ASSIGN(Tensor dx, detail::weight_product_backward(ctx, input, grad_output, weight(), in_, out_));
  if (bias() && trains(*bias()))
    COSHARD_CO_TRY(ctx.kernels().bias_grad(ctx.stream(), dt, grad_output.data(), bias()->grad().data(), rows, out_));
  co_return dx;
}

}  // namespace coshard::modules
