// The activations: GELU (GPT) and SwiGLU (Llama).
#include "coshard/modules/layers.hpp"
#include "coshard/modules/llama_layers.hpp"

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_grad;

}  // namespace

// ---- Gelu ----

async::Task<Result<Tensor>> Gelu::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(check_activation(ctx, input, 0, "Gelu"));
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(input.shape(), input.dtype()));
  COSHARD_CO_TRY(ctx.kernels().gelu_forward(ctx.stream(), input.dtype(), input.data(), out.data(), input.numel()));
  input_.push(std::move(input));
  co_return out;
}

async::Task<Result<Tensor>> Gelu::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(const Tensor input, input_.pop("Gelu"));
  COSHARD_CO_TRY(check_grad(input, grad_output, "Gelu"));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(input.shape(), input.dtype()));
  COSHARD_CO_TRY(ctx.kernels().gelu_backward(ctx.stream(), input.dtype(), input.data(), grad_output.data(),
                                             dx.data(), dx.numel()));
  co_return dx;
}

// ---- SwiGlu ----

async::Task<Result<Tensor>> SwiGlu::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(check_activation(ctx, input, 0, "SwiGlu"));
  const std::int64_t width = input.shape().back();
  if (width % 2 != 0) {
    co_return fail(ErrorCode::invalid_argument, "SwiGlu: input ", input.describe(),
                   ": its last dimension must be even (gate | up halves)");
  }
  const std::int64_t rows = input.shape().rows(), half = width / 2;
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(input.shape().with_back(half), input.dtype()));
  COSHARD_CO_TRY(ctx.kernels().swiglu_forward(ctx.stream(), input.dtype(), input.data(), out.data(), rows, half));
  input_.push(std::move(input));
  co_return out;
}

async::Task<Result<Tensor>> SwiGlu::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(const Tensor input, input_.pop("SwiGlu"));
  const std::int64_t rows = input.shape().rows(), half = input.shape().back() / 2;
  COSHARD_CO_TRY(check_grad(grad_output, input.shape().with_back(half), input.dtype(), "SwiGlu"));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(input.shape(), input.dtype()));
  COSHARD_CO_TRY(ctx.kernels().swiglu_backward(ctx.stream(), input.dtype(), input.data(), grad_output.data(),
                                               dx.data(), rows, half));
  co_return dx;
}

}  // namespace coshard::modules
