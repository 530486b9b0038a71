// The losses (cross-entropy over logits, mean squared error) and forward_backward, a model and a
// loss run once each way.
#include "coshard/modules/layers.hpp"

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_seed;

}  // namespace

// ---- CrossEntropyLoss ----

async::Task<Result<Tensor>> CrossEntropyLoss::forward(Context& ctx, Tensor logits) {
  COSHARD_CO_TRY(check_activation(ctx, logits, 0, "CrossEntropyLoss"));
  const std::int64_t N = logits.shape().rows(), V = logits.shape().back();
  if (!targets_ || targets_.dtype() != DataType::i32 || targets_.numel() != N ||
      !(targets_.device() == ctx.device()))
    co_return fail(ErrorCode::invalid_argument, "CrossEntropyLoss: targets ",
                   targets_ ? targets_.describe() : "not set", ", expected i32 with ", N, " elements (one per row of ",
                   logits.describe(), ") on ", ctx.device().to_string());
  const DataType dt = logits.dtype();
  COSHARD_CO_TRY_ASSIGN(Tensor loss, ctx.empty(Shape{1}, detail::stat_dtype(dt)));
  COSHARD_CO_TRY_ASSIGN(Tensor scratch, ctx.empty(Shape{N}, detail::stat_dtype(dt)));
  COSHARD_CO_TRY(ctx.kernels().cross_entropy_forward(ctx.stream(), dt, logits.data(),
                                                     targets_.data_as<std::int32_t>(), loss.data(), scratch.data(),
                                                     N, V));
  logits_ = std::move(logits);
  co_return loss;
}

async::Task<Result<Tensor>> CrossEntropyLoss::backward(Context& ctx, Tensor seed) {
  if (!logits_) co_return fail(ErrorCode::invalid_argument, "CrossEntropyLoss: backward without a forward");
  const DataType dt = logits_.dtype();
  COSHARD_CO_TRY(check_seed(ctx, seed, dt, "CrossEntropyLoss"));
  const std::int64_t N = logits_.shape().rows(), V = logits_.shape().back();
  COSHARD_CO_TRY_ASSIGN(Tensor dlogits, ctx.empty(logits_.shape(), dt));
  COSHARD_CO_TRY(ctx.kernels().cross_entropy_backward(ctx.stream(), dt, logits_.data(),
                                                      targets_.data_as<std::int32_t>(), seed.data(), dlogits.data(),
                                                      N, V));
  logits_ = {};
  co_return dlogits;
}

async::Task<Result<Tensor>> MeanSquaredErrorLoss::forward(Context& ctx, Tensor pred) {
  COSHARD_CO_TRY(check_activation(ctx, pred, 0, "MeanSquaredErrorLoss"));
  if (!targets_ || !(targets_.shape() == pred.shape()) || targets_.dtype() != pred.dtype() ||
      !(targets_.device() == ctx.device()))
    co_return fail(ErrorCode::invalid_argument, "MeanSquaredErrorLoss: targets ",
                   targets_ ? targets_.describe() : "not set", ", expected the prediction's shape and dtype (",
                   pred.describe(), ") on ", ctx.device().to_string());
  const DataType dt = pred.dtype();
  const std::int64_t n = pred.numel();
  COSHARD_CO_TRY_ASSIGN(Tensor loss, ctx.empty(Shape{1}, detail::stat_dtype(dt)));
  COSHARD_CO_TRY_ASSIGN(Tensor scratch, ctx.empty(Shape{n}, detail::stat_dtype(dt)));
  COSHARD_CO_TRY(ctx.kernels().mse_forward(ctx.stream(), dt, pred.data(), targets_.data(), loss.data(), scratch.data(), n));
  pred_ = std::move(pred);
  co_return loss;
}

async::Task<Result<Tensor>> MeanSquaredErrorLoss::backward(Context& ctx, Tensor seed) {
  if (!pred_) co_return fail(ErrorCode::invalid_argument, "MeanSquaredErrorLoss: backward without a forward");
  const DataType dt = pred_.dtype();
  COSHARD_CO_TRY(check_seed(ctx, seed, dt, "MeanSquaredErrorLoss"));
  COSHARD_CO_TRY_ASSIGN(Tensor dpred, ctx.empty(pred_.shape(), dt));
  COSHARD_CO_TRY(ctx.kernels().mse_backward(ctx.stream(), dt, pred_.data(), targets_.data(), seed.data(), dpred.data(),
                                            pred_.numel()));
  pred_ = {};
  co_return dpred;
}

async::Task<Result<Tensor>> forward_backward(Context& ctx, Module& model, Loss& loss, Tensor inputs, Tensor targets,
                                             Tensor seed) {
  loss.set_targets(std::move(targets));  // before the model's forward: a fused output layer takes them there
  COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(model, std::move(inputs)));
  COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, std::move(logits)));
  COSHARD_CO_TRY_ASSIGN(Tensor dlogits, co_await ctx.backward(loss, std::move(seed)));
  COSHARD_CO_TRY(co_await ctx.backward(model, std::move(dlogits)));
  co_return value;
}

}  // namespace coshard::modules
