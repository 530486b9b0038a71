// Token embeddings without positions, and their tied use as the output layer (llama_layers.hpp).
#include "coshard/modules/llama_layers.hpp"

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"
#include "layers/output_loss.hpp"
#include "layers/weight_products.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_grad;
using detail::check_param;
using detail::check_supported;
using detail::trains;

}  // namespace

TokenEmbedding::TokenEmbedding(std::int64_t vocab, std::int64_t dim, Init init) : TokenEmbedding(vocab, dim, init, 0, vocab) {}

TokenEmbedding::TokenEmbedding(std::int64_t rows, std::int64_t dim, Init init, std::int64_t first,
                               std::int64_t whole_vocab)
    : vocab_(rows), dim_(dim), first_(first), whole_(whole_vocab) {
  register_parameter("weight", Shape{rows, dim}, init);
}

async::Task<Result<Tensor>> TokenEmbedding::forward(Context& ctx, Tensor input) {
  if (input && input.dtype() != DataType::i32) co_return co_await project(ctx, std::move(input));
  if (!input || input.shape().rank() != 2 || !(input.device() == ctx.device()))
    co_return fail(ErrorCode::invalid_argument, "TokenEmbedding: input ", input ? input.describe() : "empty",
                   ", expected token ids i32[B, T] (or, as a tied output layer, [..., ", dim_, "] activations) on ",
                   ctx.device().to_string());
  const std::int64_t B = input.shape()[0], T = input.shape()[1];
  const DataType dt = weight().bound() ? weight().value().dtype() : DataType::f32;
  COSHARD_CO_TRY(check_param(weight(), dt, "TokenEmbedding"));
  COSHARD_CO_TRY(check_supported(ctx.kernels(), dt, ctx.device(), "TokenEmbedding"));
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(Shape{B, T, dim_}, dt));
  COSHARD_CO_TRY(ctx.kernels().embedding_forward(ctx.stream(), dt, input.data_as<std::int32_t>(),
                                                 weight().value().data(), nullptr, out.data(), B, T, dim_, whole_,
                                                 first_, vocab_));
  saved_.push_back(std::move(input));
  co_return out;
}

async::Task<Result<Tensor>> TokenEmbedding::project(Context& ctx, Tensor hidden) {
  COSHARD_CO_TRY(check_activation(ctx, hidden, dim_, "TokenEmbedding (tied output layer)"));
  const DataType dt = hidden.dtype();
  COSHARD_CO_TRY(check_param(weight(), dt, "TokenEmbedding (tied output layer)"));
  // The output layer of a FusedCrossEntropyLoss with targets set: the loss, chunk by chunk.
  if (output_loss_ && output_loss_->armed())
    co_return output_loss_->forward(ctx, std::move(hidden), weight(), nullptr, dim_, vocab_,
                                    "TokenEmbedding (tied output layer)");
  if (output_loss_) output_loss_->forget();  // (this use's backward is the plain one)
  COSHARD_CO_TRY_ASSIGN(Tensor logits, detail::times_weight_transposed(ctx, hidden, weight(), dim_, vocab_));
  saved_.push_back(std::move(hidden));
  co_return logits;
}

async::Task<Result<Tensor>> TokenEmbedding::backward(Context& ctx, Tensor grad_output) {
  // The fused output use is the last forward's, so its backward comes first (nothing on saved_).
  if (output_loss_ && output_loss_->holds_forward())
    co_return output_loss_->backward(ctx, grad_output, weight(), nullptr, dim_, vocab_,
                                     "TokenEmbedding (tied output layer)");
  if (saved_.empty()) co_return fail(ErrorCode::invalid_argument, "TokenEmbedding: backward without a forward");
  const Tensor input = std::move(saved_.back());
  saved_.pop_back();
  if (input.dtype() != DataType::i32) co_return co_await project_backward(ctx, input, grad_output);
  const std::int64_t B = input.shape()[0], T = input.shape()[1];
  const DataType dt = weight().value().dtype();
  COSHARD_CO_TRY(check_grad(grad_output, Shape{B, T, dim_}, dt, "TokenEmbedding"));
  if (trains(weight()))
    COSHARD_CO_TRY(ctx.kernels().embedding_backward(ctx.stream(), dt, input.data_as<std::int32_t>(), grad_output.data(),
                                                    weight().grad().data(), nullptr, B, T, dim_, first_, vocab_));
  co_return Tensor{};
}

async::Task<Result<Tensor>> TokenEmbedding::project_backward(Context& ctx, const Tensor& hidden,
                                                             const Tensor& grad_output) {
  const DataType dt = hidden.dtype();
  COSHARD_CO_TRY(check_grad(grad_output, hidden.shape().with_back(vocab_), dt, "TokenEmbedding (tied output layer)"));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, detail::weight_product_backward(ctx, hidden, grad_output, weight(), dim_, vocab_));
  co_return dx;
}

async::Task<Result<Tensor>> TiedHead::forward(Context& ctx, Tensor input) {
  if (input && input.dtype() == DataType::i32)
    co_return fail(ErrorCode::invalid_argument, "TiedHead: input ", input.describe(),
                   ", expected floating activations [..., ", table_->dim(), "]");
  co_return co_await ctx.forward(*table_, std::move(input));
}

async::Task<Result<Tensor>> TiedHead::backward(Context& ctx, Tensor grad_output) {
  co_return co_await ctx.backward(*table_, std::move(grad_output));
}

void TokenEmbedding::clear_saved_here() noexcept {
  saved_.clear();
  if (output_loss_) output_loss_->clear_saved();
}

}  // namespace coshard::modules
