// Rotary position embeddings (Llama), with Llama 3's scaling of the frequencies.
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

}  // namespace

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
