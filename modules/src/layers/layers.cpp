#include "coshard/modules/layers.hpp"

#include "coshard/modules/decoding.hpp"

#include <cmath>

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"
#include "layers/weight_products.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_grad;
using detail::check_param;
using detail::check_seed;
using detail::check_supported;
using detail::GemmArgs;
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
                                                 vocab_));
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
                                                    grad_output.data(), dwte.data(), dwpe, B, T, dim_));
  }
  co_return Tensor{};
}

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

// ---- CausalSelfAttention ----

CausalSelfAttention::CausalSelfAttention(std::int64_t dim, std::int64_t heads)
    : dim_(dim), heads_{heads, heads, heads > 0 ? dim / heads : 0} {}

CausalSelfAttention::CausalSelfAttention(AttentionHeads heads) : dim_(0), heads_(heads) {}

bool attention_is_fused(async::Device device, DataType dtype, std::int64_t head_dim, AttentionKernels kernels) {
  if (device.is_cpu()) return false;
  const detail::Kernels* k = kernels == AttentionKernels::fused ? detail::cuda_kernels() : nullptr;
  return k != nullptr && k->supports(dtype) && k->attention_buffers(dtype, 1, 1, 1, 1, head_dim).backward_reads_output;
}

Result<void> CausalSelfAttention::check() const {
  if (dim_ > 0 && (heads_.n_heads <= 0 || dim_ % heads_.n_heads != 0))
    return fail(ErrorCode::invalid_argument, "CausalSelfAttention: dim ", dim_, " is not a multiple of heads ",
                heads_.n_heads);
  if (heads_.n_heads < 1 || heads_.n_kv_heads < 1 || heads_.n_heads % heads_.n_kv_heads != 0 || heads_.head_dim < 1)
    return fail(ErrorCode::invalid_argument, "CausalSelfAttention: n_heads=", heads_.n_heads,
                " n_kv_heads=", heads_.n_kv_heads, " head_dim=", heads_.head_dim,
                ": expected n_kv_heads >= 1 dividing n_heads, and head_dim >= 1");
  return {};
}

async::Task<Result<Tensor>> CausalSelfAttention::forward(Context& ctx, Tensor qkv) {
  COSHARD_CO_TRY(check());
  const auto [H, KVH, hd] = heads_;
  const std::int64_t width = (H + 2 * KVH) * hd;
  COSHARD_CO_TRY(check_activation(ctx, qkv, width, "CausalSelfAttention"));
  if (qkv.shape().rank() != 3)
    co_return fail(ErrorCode::invalid_argument, "CausalSelfAttention: qkv ", qkv.describe(), ", expected [B, T, ",
                   width, "]");
  const DataType dt = qkv.dtype();
  const std::int64_t B = qkv.shape()[0], T = qkv.shape()[1];
  if (Decoding* decoding = ctx.decoding()) co_return co_await decode(ctx, *decoding, std::move(qkv));
  const detail::AttentionBuffers buffers = ctx.kernels().attention_buffers(dt, B, T, H, KVH, hd);
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(Shape{B, T, H * hd}, dt));
  COSHARD_CO_TRY_ASSIGN(Tensor saved, ctx.empty(buffers.saved, buffers.saved_dtype));
  COSHARD_CO_TRY(ctx.kernels().attention_forward(ctx.stream(), dt, qkv.data(), out.data(), saved.data(), B, T, H, KVH,
                                                 hd));
  // The fused form recomputes from the output (which the projection after it keeps anyway).
  saved_.push({std::move(qkv), std::move(saved), buffers.backward_reads_output ? out : Tensor{}});
  co_return out;
}

// The new tokens' rows go into this layer's cache at the decoding's position; each attends over
// the cache up to itself. Nothing is saved (no backward).
async::Task<Result<Tensor>> CausalSelfAttention::decode(Context& ctx, Decoding& decoding, Tensor qkv) {
  const auto [H, KVH, hd] = heads_;
  const std::int64_t width = (H + 2 * KVH) * hd;
  const DataType dt = qkv.dtype();
  const std::int64_t B = qkv.shape()[0], T = qkv.shape()[1], p = decoding.position(), L = decoding.max_length();
  COSHARD_CO_TRY(decoding.check(B, T, "CausalSelfAttention"));
  COSHARD_CO_TRY_ASSIGN(Tensor cache, decoding.cache(ctx, *this, width, dt));
  const std::size_t row = static_cast<std::size_t>(width) * size_of(dt);
  for (std::int64_t b = 0; b < B; ++b)
    COSHARD_CO_TRY(ctx.stream().copy(static_cast<std::byte*>(cache.data()) + static_cast<std::size_t>(b * L + p) * row,
                                     static_cast<const std::byte*>(qkv.data()) + static_cast<std::size_t>(b * T) * row,
                                     static_cast<std::size_t>(T) * row));
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(Shape{B, T, H * hd}, dt));
  COSHARD_CO_TRY_ASSIGN(Tensor scratch, ctx.empty(Shape{B * T * H * (p + T)}, DataType::f32));
  COSHARD_CO_TRY(ctx.kernels().attention_decode(ctx.stream(), dt, cache.data(), out.data(),
                                                static_cast<float*>(scratch.data()), B, L, p, T, H, KVH, hd));
  co_return out;
}

async::Task<Result<Tensor>> CausalSelfAttention::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(const Saved saved, saved_.pop("CausalSelfAttention"));
  const Tensor& qkv = saved.qkv;
  const auto [H, KVH, hd] = heads_;
  const DataType dt = qkv.dtype();
  const std::int64_t B = qkv.shape()[0], T = qkv.shape()[1];
  COSHARD_CO_TRY(check_grad(grad_output, Shape{B, T, H * hd}, dt, "CausalSelfAttention"));
  const detail::AttentionBuffers buffers = ctx.kernels().attention_buffers(dt, B, T, H, KVH, hd);
  if (buffers.backward_reads_output && !saved.out)
    co_return fail(ErrorCode::invalid_argument, "CausalSelfAttention: backward without the forward's output");
  COSHARD_CO_TRY_ASSIGN(Tensor dqkv, ctx.empty(qkv.shape(), dt));
  COSHARD_CO_TRY_ASSIGN(Tensor scratch, ctx.empty(buffers.scratch, buffers.scratch_dtype));
  COSHARD_CO_TRY(ctx.kernels().attention_backward(ctx.stream(), dt, grad_output.data(), qkv.data(),
                                                  saved.out ? saved.out.data() : nullptr, saved.stats.data(),
                                                  dqkv.data(), scratch.data(), B, T, H, KVH, hd));
  co_return dqkv;
}

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
  COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(model, std::move(inputs)));
  loss.set_targets(std::move(targets));
  COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, std::move(logits)));
  COSHARD_CO_TRY_ASSIGN(Tensor dlogits, co_await ctx.backward(loss, std::move(seed)));
  COSHARD_CO_TRY(co_await ctx.backward(model, std::move(dlogits)));
  co_return value;
}

}  // namespace coshard::modules
