#include "coshard/modules/llama_layers.hpp"

#include "coshard/modules/decoding.hpp"

#include <cmath>
#include <numbers>

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_grad;
using detail::check_param;

}  // namespace

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

// ---- RotaryEmbedding ----

RotaryEmbedding::RotaryEmbedding(std::int64_t n_heads, std::int64_t n_kv_heads, std::int64_t head_dim, double theta,
                                 RopeScaling scaling)
    : n_heads_(n_heads), n_kv_heads_(n_kv_heads), head_dim_(head_dim), theta_(theta), scaling_(scaling) {
  if (!check()) return;
  // transformers: inv_freq = 1 / theta^(arange(0, d, 2) / d), then Llama 3's scaling.
  const std::int64_t half = head_dim / 2;
  inv_freq_.resize(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    if (scaling.factor > 0) {
      const double old_len = static_cast<double>(scaling.original_max_positions);
      const double low_wavelen = old_len / scaling.low_freq_factor, high_wavelen = old_len / scaling.high_freq_factor;
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f /= scaling.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (old_len / wavelen - scaling.low_freq_factor) /
                              (scaling.high_freq_factor - scaling.low_freq_factor);
        f = (1 - smooth) * f / scaling.factor + smooth * f;
      }
    }
    inv_freq_[static_cast<std::size_t>(i)] = static_cast<float>(f);
  }
}

Result<void> RotaryEmbedding::check() const {
  if (n_heads_ < 1 || n_kv_heads_ < 1 || n_heads_ % n_kv_heads_ != 0) {
    return fail(ErrorCode::invalid_argument, "RotaryEmbedding: n_heads=", n_heads_, " n_kv_heads=", n_kv_heads_,
                ": expected n_kv_heads >= 1 dividing n_heads");
  }
  if (head_dim_ < 2 || head_dim_ % 2 != 0) {
    return fail(ErrorCode::invalid_argument, "RotaryEmbedding: head_dim=", head_dim_, ": expected an even number >= 2");
  }
  if (!(theta_ > 1) || !std::isfinite(theta_)) {
    return fail(ErrorCode::invalid_argument, "RotaryEmbedding: rope_theta=", theta_, ": expected a finite value above 1");
  }
  if (scaling_.factor < 0 || (scaling_.factor > 0 && (!(scaling_.high_freq_factor > scaling_.low_freq_factor) ||
                                                      !(scaling_.low_freq_factor > 0) ||
                                                      scaling_.original_max_positions < 1))) {
    return fail(ErrorCode::invalid_argument, "RotaryEmbedding: rope scaling factor=", scaling_.factor,
                " low_freq_factor=", scaling_.low_freq_factor, " high_freq_factor=", scaling_.high_freq_factor,
                " original_max_positions=", scaling_.original_max_positions,
                ": expected factor 0 (none), or factor > 0 with 0 < low_freq_factor < high_freq_factor and "
                "original_max_positions >= 1");
  }
  return {};
}

async::Task<Result<Tensor>> RotaryEmbedding::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(check());
  const std::int64_t heads = n_heads_ + 2 * n_kv_heads_;
  COSHARD_CO_TRY(check_activation(ctx, input, heads * head_dim_, "RotaryEmbedding"));
  if (input.shape().rank() != 3) {
    co_return fail(ErrorCode::invalid_argument, "RotaryEmbedding: input ", input.describe(),
                   ": expected [batch, sequence, (n_heads + 2 n_kv_heads) * head_dim]");
  }
  const DataType dt = input.dtype();
  COSHARD_CO_TRY_ASSIGN(Tensor freq, ctx.upload(std::as_bytes(std::span<const float>(inv_freq_)),
                                                Shape{static_cast<std::int64_t>(inv_freq_.size())}, DataType::f32));
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(input.shape(), dt));
  // Decoding: the rows continue a sequence at the decoding's position.
  const Decoding* decoding = ctx.decoding();
  COSHARD_CO_TRY(ctx.kernels().rope(ctx.stream(), dt, input.data(), out.data(), static_cast<const float*>(freq.data()),
                                    input.shape()[0], input.shape()[1], heads, n_heads_ + n_kv_heads_, head_dim_,
                                    false, decoding ? decoding->position() : 0));
  if (!decoding) saved_.push({input.shape(), std::move(freq)});  // (decoding has no backward)
  co_return out;
}

async::Task<Result<Tensor>> RotaryEmbedding::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(const Saved saved, saved_.pop("RotaryEmbedding"));
  const Shape& shape = saved.shape;
  COSHARD_CO_TRY(check_grad(grad_output, shape, grad_output ? grad_output.dtype() : DataType::f32, "RotaryEmbedding"));
  const std::int64_t heads = n_heads_ + 2 * n_kv_heads_;
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(shape, grad_output.dtype()));
  COSHARD_CO_TRY(ctx.kernels().rope(ctx.stream(), grad_output.dtype(), grad_output.data(), dx.data(),
                                    static_cast<const float*>(saved.freq.data()), shape[0], shape[1], heads,
                                    n_heads_ + n_kv_heads_, head_dim_, true, 0));
  co_return dx;
}

}  // namespace coshard::modules
