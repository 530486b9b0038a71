// Qwen3's per-head query and key norms (HeadNorms, llama_layers.hpp): the fused projection's head
// rows put in order (queries, keys, values) with the routing's row kernels, the query and key
// blocks each through an RmsNorm child, then back in place; backward the same way.
#include "coshard/modules/llama_layers.hpp"

#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {

HeadNorms::HeadNorms(std::int64_t n_heads, std::int64_t n_kv_heads, std::int64_t head_dim, float eps)
    : n_heads_(n_heads), n_kv_heads_(n_kv_heads), head_dim_(head_dim) {
  q_ = &register_child("q", std::make_unique<RmsNorm>(head_dim, eps));
  k_ = &register_child("k", std::make_unique<RmsNorm>(head_dim, eps));
}

Result<HeadNorms::Places> HeadNorms::places(Context& ctx, std::int64_t rows) {
  const std::int64_t heads = n_heads_ + 2 * n_kv_heads_, total = rows * heads;
  if (total >= std::int64_t{1} << 31)
    return fail(ErrorCode::invalid_argument, "HeadNorms: ", rows, " rows of ", heads, " heads (expected fewer than 2^31 heads)");
  std::vector<std::int32_t> order(static_cast<std::size_t>(total)), inverse(order.size());
  std::int64_t place = 0;
  const std::pair<std::int64_t, std::int64_t> blocks[] = {
      {0, n_heads_}, {n_heads_, n_kv_heads_}, {n_heads_ + n_kv_heads_, n_kv_heads_}};
  for (const auto& [first, count] : blocks)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t h = first; h < first + count; ++h, ++place) {
        const std::int64_t source = r * heads + h;
        order[static_cast<std::size_t>(place)] = static_cast<std::int32_t>(source);
        inverse[static_cast<std::size_t>(source)] = static_cast<std::int32_t>(place);
      }
  Places p;
  COSHARD_TRY_ASSIGN(p.order, ctx.upload(std::as_bytes(std::span<const std::int32_t>(order)), Shape{total}, DataType::i32));
  COSHARD_TRY_ASSIGN(p.inverse, ctx.upload(std::as_bytes(std::span<const std::int32_t>(inverse)), Shape{total}, DataType::i32));
  return p;
}

namespace {

// `source` [rows, width] rows into `out` by a permutation: out[i] = source[order[i]].
Result<Tensor> permute(Context& ctx, const Tensor& source, const Tensor& order, std::int64_t rows, std::int64_t width) {
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(Shape{rows, width}, source.dtype()));
  COSHARD_TRY(ctx.kernels().moe_gather_rows(ctx.stream(), source.dtype(), source.data(), order.data_as<std::int32_t>(), rows,
                                            1, width, out.data()));
  return out;
}

}  // namespace

async::Task<Result<Tensor>> HeadNorms::forward(Context& ctx, Tensor input) {
  const std::int64_t hd = head_dim_, width = (n_heads_ + 2 * n_kv_heads_) * hd;
  COSHARD_CO_TRY(detail::check_activation(ctx, input, width, "HeadNorms"));
  const std::int64_t rows = input.shape().rows(), q_rows = rows * n_heads_, k_rows = rows * n_kv_heads_;
  const std::int64_t total = rows * (n_heads_ + 2 * n_kv_heads_);
  COSHARD_CO_TRY_ASSIGN(Places p, places(ctx, rows));
  COSHARD_CO_TRY_ASSIGN(Tensor heads, permute(ctx, input, p.order, total, hd));
  // (the views named before co_await: GCC 12)
  const Tensor q_heads = heads.slice(0, Shape{q_rows, hd}), k_heads = heads.slice(q_rows * hd, Shape{k_rows, hd});
  COSHARD_CO_TRY_ASSIGN(Tensor q, co_await ctx.forward(*q_, q_heads));
  COSHARD_CO_TRY_ASSIGN(Tensor k, co_await ctx.forward(*k_, k_heads));
  // The normed heads and the values together, then back in place. (Not over the gathered heads:
  // the norms keep those for their backward.)
  COSHARD_CO_TRY_ASSIGN(Tensor normed, ctx.empty(Shape{total, hd}, input.dtype()));
  const std::int64_t qk = (q_rows + k_rows) * hd;
  COSHARD_CO_TRY(ctx.stream().copy(normed.data(), q.data(), q.bytes()));
  COSHARD_CO_TRY(ctx.stream().copy(normed.slice(q_rows * hd, Shape{k_rows, hd}).data(), k.data(), k.bytes()));
  COSHARD_CO_TRY(ctx.stream().copy(normed.slice(qk, Shape{total * hd - qk}).data(), heads.slice(qk, Shape{total * hd - qk}).data(),
                                   static_cast<std::size_t>(total * hd - qk) * size_of(input.dtype())));
  COSHARD_CO_TRY_ASSIGN(Tensor out, permute(ctx, normed, p.inverse, total, hd));
  Saved saved;
  saved.shape = input.shape();
  saved.places = std::move(p);
  saved_.push(std::move(saved));
  co_return out.view(input.shape());
}

async::Task<Result<Tensor>> HeadNorms::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(Saved saved, saved_.pop("HeadNorms"));
  const DataType dt = grad_output.dtype();
  COSHARD_CO_TRY(detail::check_grad(grad_output, saved.shape, dt, "HeadNorms"));
  const std::int64_t hd = head_dim_, rows = saved.shape.rows(), q_rows = rows * n_heads_, k_rows = rows * n_kv_heads_;
  const std::int64_t total = rows * (n_heads_ + 2 * n_kv_heads_);
  COSHARD_CO_TRY_ASSIGN(Tensor heads, permute(ctx, grad_output, saved.places.order, total, hd));
  // Keys first: backward undoes the forwards in reverse.
  const Tensor q_heads = heads.slice(0, Shape{q_rows, hd}), k_heads = heads.slice(q_rows * hd, Shape{k_rows, hd});
  COSHARD_CO_TRY_ASSIGN(Tensor dk, co_await ctx.backward(*k_, k_heads));
  COSHARD_CO_TRY_ASSIGN(Tensor dq, co_await ctx.backward(*q_, q_heads));
  COSHARD_CO_TRY(ctx.stream().copy(q_heads.data(), dq.data(), dq.bytes()));
  COSHARD_CO_TRY(ctx.stream().copy(k_heads.data(), dk.data(), dk.bytes()));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, permute(ctx, heads, saved.places.inverse, total, hd));
  co_return dx.view(saved.shape);
}

}  // namespace coshard::modules
