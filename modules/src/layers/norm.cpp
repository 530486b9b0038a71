// The norms: LayerNorm (GPT) and RmsNorm (Llama), their kernels in kernels/cpu/norm.hpp and
// kernels/cuda/norm.cu.
#include "coshard/modules/layers.hpp"
#include "coshard/modules/llama_layers.hpp"

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_grad;
using detail::check_param;

}  // namespace

// ---- LayerNorm ----

LayerNorm::LayerNorm(std::int64_t dim, float eps) : dim_(dim), eps_(eps) {
  register_parameter("weight", Shape{dim}, Init::ones());
  register_parameter("bias", Shape{dim}, Init::zeros());
}

async::Task<Result<Tensor>> LayerNorm::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(check_activation(ctx, input, dim_, "LayerNorm"));
  const DataType dt = input.dtype();
  COSHARD_CO_TRY(check_param(*parameters()[0], dt, "LayerNorm"));
  COSHARD_CO_TRY(check_param(*parameters()[1], dt, "LayerNorm"));
  const std::int64_t rows = input.shape().rows();
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(input.shape(), dt));
  COSHARD_CO_TRY_ASSIGN(Tensor mean, ctx.empty(Shape{rows}, detail::stat_dtype(dt)));
  COSHARD_CO_TRY_ASSIGN(Tensor rstd, ctx.empty(Shape{rows}, detail::stat_dtype(dt)));
  COSHARD_CO_TRY(ctx.kernels().layernorm_forward(ctx.stream(), dt, input.data(), parameters()[0]->value().data(),
                                                 parameters()[1]->value().data(), out.data(), mean.data(),
                                                 rstd.data(), rows, dim_, eps_));
  saved_.push({std::move(input), std::move(mean), std::move(rstd)});
  co_return out;
}

async::Task<Result<Tensor>> LayerNorm::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(const Saved saved, saved_.pop("LayerNorm"));
  const Tensor& input = saved.input;
  COSHARD_CO_TRY(check_grad(input, grad_output, "LayerNorm"));
  const DataType dt = input.dtype();
  const std::int64_t rows = input.shape().rows();
  Parameter& w = *parameters()[0];
  Parameter& b = *parameters()[1];
  COSHARD_CO_TRY_ASSIGN(Tensor dw, detail::grad_or_scratch(ctx, w, dt));
  COSHARD_CO_TRY_ASSIGN(Tensor db, detail::grad_or_scratch(ctx, b, dt));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(input.shape(), dt));
  COSHARD_CO_TRY_ASSIGN(Tensor scratch, detail::norm_backward_scratch(ctx, dt, rows, dim_, true));
  COSHARD_CO_TRY(ctx.kernels().layernorm_backward(ctx.stream(), dt, grad_output.data(), input.data(),
                                                  w.value().data(), saved.mean.data(), saved.rstd.data(), dx.data(),
                                                  dw.data(), db.data(), scratch.data(), rows, dim_));
  co_return dx;
}

// ---- RmsNorm ----

RmsNorm::RmsNorm(std::int64_t dim, float eps) : dim_(dim), eps_(eps) {
  register_parameter("weight", Shape{dim}, Init::ones());
}

async::Task<Result<Tensor>> RmsNorm::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(check_activation(ctx, input, dim_, "RmsNorm"));
  const DataType dt = input.dtype();
  COSHARD_CO_TRY(check_param(*parameters()[0], dt, "RmsNorm"));
  const std::int64_t rows = input.shape().rows();
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(input.shape(), dt));
  COSHARD_CO_TRY_ASSIGN(Tensor rstd, ctx.empty(Shape{rows}, detail::stat_dtype(dt)));
  COSHARD_CO_TRY(ctx.kernels().rmsnorm_forward(ctx.stream(), dt, input.data(), parameters()[0]->value().data(),
                                               out.data(), rstd.data(), rows, dim_, eps_));
  saved_.push({std::move(input), std::move(rstd)});
  co_return out;
}

async::Task<Result<Tensor>> RmsNorm::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(const Saved saved, saved_.pop("RmsNorm"));
  const Tensor& input = saved.input;
  COSHARD_CO_TRY(check_grad(input, grad_output, "RmsNorm"));
  const DataType dt = input.dtype();
  const std::int64_t rows = input.shape().rows();
  Parameter& w = *parameters()[0];
  COSHARD_CO_TRY_ASSIGN(Tensor dw, detail::grad_or_scratch(ctx, w, dt));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(input.shape(), dt));
  COSHARD_CO_TRY_ASSIGN(Tensor scratch, detail::norm_backward_scratch(ctx, dt, rows, dim_, false));
  COSHARD_CO_TRY(ctx.kernels().rmsnorm_backward(ctx.stream(), dt, grad_output.data(), input.data(), w.value().data(),
                                                saved.rstd.data(), dx.data(), dw.data(), scratch.data(), rows, dim_));
  co_return dx;
}

}  // namespace coshard::modules
