// Causal self-attention over packed q, k, v rows (grouped-query heads included), in training and
// in decoding with a key/value cache; its kernels in kernels/cpu/attention.hpp and
// kernels/cuda/attention.cu.
#include "coshard/modules/layers.hpp"
#include "coshard/modules/decoding.hpp"

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_grad;

}  // namespace

// ---- CausalSelfAttention ----

CausalSelfAttention::CausalSelfAttention(std::int64_t dim, std::int64_t heads)
    : dim_(dim), heads_{heads, heads, heads > 0 ? dim / heads : 0} {}

CausalSelfAttention::CausalSelfAttention(AttentionHeads heads) : dim_(0), heads_(heads) {}

Result<std::string> cudnn_attention_library() { return detail::cudnn_attention_library(); }

bool attention_is_fused(async::Device device, DataType dtype, std::int64_t head_dim, AttentionKernels kernels) {
  if (device.is_cpu()) return false;
  // cuDNN's attention keeps what the fused kernels keep; where the fused kernels do not take the
  // head size, this answers for the materialized form (an estimate on the safe side).
  const detail::Kernels* k = kernels == AttentionKernels::materialized ? nullptr : detail::cuda_kernels();
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

}  // namespace coshard::modules
