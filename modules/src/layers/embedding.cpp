// Learned token and position embeddings (GPT); the Llama's token embedding without positions
// and its tied use as the output layer are in token_embedding.cpp.
#include "coshard/modules/layers.hpp"
#include "coshard/modules/decoding.hpp"

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace {

using detail::check_grad;
using detail::check_param;
using detail::check_supported;
using detail::trains;

}  // namespace

// ---- Embedding ----

Embedding::Embedding(std::int64_t vocab, std::int64_t max_positions, std::int64_t dim, Init init)
    : vocab_(vocab), max_positions_(max_positions), dim_(dim) {
  register_parameter("wte", Shape{vocab, dim}, init);
  register_parameter("wpe", Shape{max_positions, dim}, init);
}

async::Task<Result<Tensor>> Embedding::forward(Context& ctx, Tensor tokens) {
  if (!tokens || tokens.dtype() != DataType::i32 || tokens.shape().rank() != 2 || !(tokens.device() == ctx.device()))
    co_return fail(ErrorCode::invalid_argument, "Embedding: tokens ", tokens ? tokens.describe() : "empty",
                   ", expected i32[B, T] on ", ctx.device().to_string());
  const std::int64_t B = tokens.shape()[0], T = tokens.shape()[1];
  // Decoding: the tokens continue a sequence at position p (their positions' rows start there).
  Decoding* decoding = ctx.decoding();
  const std::int64_t p = decoding ? decoding->position() : 0;
  if (decoding) COSHARD_CO_TRY(decoding->check(B, T, "Embedding"));
  if (p + T > max_positions_)
    co_return fail(ErrorCode::invalid_argument, "Embedding: sequence length ", p + T, " exceeds max_positions ",
                   max_positions_);
  const DataType dt = token_weight().bound() ? token_weight().value().dtype() : DataType::f32;
  COSHARD_CO_TRY(check_param(token_weight(), dt, "Embedding"));
  COSHARD_CO_TRY(check_param(position_weight(), dt, "Embedding"));
  COSHARD_CO_TRY(check_supported(ctx.kernels(), dt, ctx.device(), "Embedding"));
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(Shape{B, T, dim_}, dt));
  const auto* positions = static_cast<const std::byte*>(position_weight().value().data()) +
                         static_cast<std::size_t>(p * dim_) * size_of(dt);
  COSHARD_CO_TRY(ctx.kernels().embedding_forward(ctx.stream(), dt, tokens.data_as<std::int32_t>(),
                                                 token_weight().value().data(), positions, out.data(), B, T, dim_,
                                                 vocab_, 0, vocab_));
  if (!decoding) tokens_.push(std::move(tokens));  // (decoding has no backward)
  co_return out;
}

async::Task<Result<Tensor>> Embedding::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(const Tensor tokens, tokens_.pop("Embedding"));
  const std::int64_t B = tokens.shape()[0], T = tokens.shape()[1];
  const DataType dt = token_weight().value().dtype();
  COSHARD_CO_TRY(check_grad(grad_output, Shape{B, T, dim_}, dt, "Embedding"));
  if (trains(token_weight()) || trains(position_weight())) {
    COSHARD_CO_TRY_ASSIGN(Tensor dwte, detail::grad_or_scratch(ctx, token_weight(), dt));
    void* dwpe = trains(position_weight()) ? position_weight().grad().data() : nullptr;  // null: none added
    COSHARD_CO_TRY(ctx.kernels().embedding_backward(ctx.stream(), dt, tokens.data_as<std::int32_t>(),
                                                    grad_output.data(), dwte.data(), dwpe, B, T, dim_, 0, vocab_));
  }
  co_return Tensor{};
}

}  // namespace coshard::modules
