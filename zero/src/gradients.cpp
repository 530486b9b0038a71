// Gradient reduction: stages 2-3 reduce-scatter each unit's gradient (averaged, in the compute
// dtype) into its fp32 shard as soon as its backward is done, and stage 0 all-reduces it into its
// fp32 copy the same way (a unit is the bucket, overlapped with the backward of the units before
// it); stage 1 reduces every unit in one coalesced launch after the last micro-batch.
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

Result<void> Engine::State::allocate_gradients(Unit& u) {
  auto& stream = ctx->stream();
  auto& alloc = ctx->allocator();
  const Shape shard_shape{u.info.shard};
  // Gradient shards are fp32 whatever the compute dtype (the optimizer reads them as they are).
  const auto grad_shard_bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);
  if (u.info.frozen) return {};  // no gradient at all
  if (o.zero_stage == 1) {
    COSHARD_TRY_ASSIGN(u.grad_full_block, alloc.allocate(u.info.padded_bytes, stream));
    u.grad_full = Tensor(u.grad_full_block.data(), Shape{u.info.padded}, o.dtype, ctx->device());
    COSHARD_TRY(stream.fill(u.grad_full.data(), 0, u.info.padded_bytes));
    if (o.dtype == DataType::f32) {
      u.grad_shard = u.grad_full.slice(block_offset(u), shard_shape);  // reduced in place: no copy
      return {};
    }
  }
  COSHARD_TRY_ASSIGN(u.grad_shard_block, alloc.allocate(grad_shard_bytes, stream));
  u.grad_shard = Tensor(u.grad_shard_block.data(), shard_shape, DataType::f32, ctx->device());
  return stream.fill(u.grad_shard.data(), 0, grad_shard_bytes);
}

Result<void> Engine::State::begin_backward(Unit& u) {
  if (o.zero_stage == 1) return {};
  if (u.info.frozen) return bind_values(u, values_of(u));  // values only: nothing to reduce
  if (u.grad_full) return bind_values(u, values_of(u));  // another use of this micro-batch: add to it
  COSHARD_TRY_ASSIGN(u.grad_full_block, ctx->allocator().allocate(u.info.padded_bytes, ctx->stream()));
  u.grad_full = Tensor(u.grad_full_block.data(), Shape{u.info.padded}, o.dtype, ctx->device());
  COSHARD_TRY(ctx->stream().fill(u.grad_full.data(), 0, u.info.padded_bytes));
  return bind_values(u, values_of(u));
}

Result<void> Engine::State::shard_from(const Unit& u, const Tensor& mine, const Tensor& out) {
  auto& cs = comm->stream();
  if (o.dtype == DataType::f32) return cs.copy(out.data(), mine.data(), mine.bytes());
  return ctx->kernels().cast(cs, o.dtype, mine.data(), DataType::f32, out.data(), u.info.shard);
}

Result<void> Engine::State::reduce_gradients(Unit& u) {
  if (u.info.frozen) return {};
  if (o.zero_stage == 1) {  // reduced after backward (finish_gradients); counted as used here
    ++u.grads_this_step;
    return {};
  }
  ++u.backwards_this_step;
  // Another use of this micro-batch is still to come backward: its gradient goes into the same
  // buffer (kept; the parameters are rebound at that use), and the unit is reduced once after it.
  if (--u.uses_pending > 0) return {};
  auto& cs = comm->stream();
  COSHARD_TRY_ASSIGN(auto produced, ctx->stream().record());
  COSHARD_TRY(cs.wait(produced));
  async::Event started;
  if (spans_on()) {
    COSHARD_TRY_ASSIGN(started, cs.record_timed());
  }
  Tensor mine = u.grad_full.slice(block_offset(u), Shape{u.info.shard});
  auto rs = stage0() ? comm->all_reduce(u.grad_full.data(), u.grad_full.data(), static_cast<std::size_t>(u.info.padded),
                                        o.dtype, ReduceOp::avg, u.reduce_purpose)
                     : comm->reduce_scatter(u.grad_full.data(), mine.data(), static_cast<std::size_t>(u.info.shard),
                                            o.dtype, ReduceOp::avg, u.reduce_purpose);
  stats.reduce_scattered_bytes += u.info.padded_bytes;
  if (!rs) return fail(std::move(rs).error().with_context("reducing the gradients of unit " + u.info.name));
  // Into the fp32 shard (bf16/f16 compute reduces in its own dtype, accumulates in fp32).
  async::Block scratch;
  if (u.grads_this_step == 0) {
    COSHARD_TRY(shard_from(u, mine, u.grad_shard));
  } else if (o.dtype == DataType::f32) {
    COSHARD_TRY(ctx->kernels().add(cs, DataType::f32, u.grad_shard.data(), mine.data(), u.grad_shard.data(), u.info.shard));
  } else {
    COSHARD_TRY_ASSIGN(scratch, ctx->allocator().allocate(u.grad_shard.bytes(), cs));
    Tensor widened(scratch.data(), Shape{u.info.shard}, DataType::f32, ctx->device());
    COSHARD_TRY(shard_from(u, mine, widened));
    COSHARD_TRY(ctx->kernels().add(cs, DataType::f32, u.grad_shard.data(), widened.data(), u.grad_shard.data(), u.info.shard));
  }
  ++u.grads_this_step;
  COSHARD_TRY_ASSIGN(auto reduced, spans_on() ? cs.record_timed() : cs.record());
  if (grads_out_in_backward) {  // (a unit with two backward passes is copied again: the last copy wins)
    COSHARD_TRY(cs.copy(u.host_grad.data(), u.grad_shard.data(), u.grad_shard.bytes()));
    stats.swap_bytes += u.grad_shard.bytes();
    u.grads_out = true;
    if (stepping_in_backward && u.backwards_this_step == u.forward_uses) COSHARD_TRY(step_on_host(u));
  }
  if (scratch) scratch.reset_after(reduced);
  span(false, stage0() ? "all_reduce" : "reduce_scatter", u.info.name, std::move(started), reduced);
  u.grad_full_block.record_use(reduced);
  u.grad_full_block.reset();
  u.grad_full = {};
  return bind_values(u, values_of(u));
}

// After the last micro-batch: stage 1 reduces every unit now, in one launch (stages 2-3 did it per
// unit during backward); the shards are scaled by the micro-batch count, and the compute stream
// waits for them.
async::Task<Result<void>> Engine::State::finish_gradients(std::size_t micro_batches) {
  auto& compute = ctx->stream();
  auto& cs = comm->stream();
  const auto& k = ctx->kernels();
  COSHARD_CO_TRY(order(compute, cs));
  if (o.zero_stage == 1) {
    COSHARD_CO_TRY_ASSIGN(auto started, mark(cs));
    Coalesced group;
    for (auto& u : units) {
      if (u->info.frozen) continue;
      Tensor mine = u->grad_full.slice(block_offset(*u), Shape{u->info.shard});
      group.reduce_scatter(u->grad_full.data(), mine.data(), static_cast<std::size_t>(u->info.shard), o.dtype,
                           ReduceOp::avg)
          .purpose(u->reduce_purpose);
      stats.reduce_scattered_bytes += u->info.padded_bytes;
    }
    COSHARD_CO_TRY(comm->launch(group));
    if (o.dtype != DataType::f32)  // bf16/f16: the reduced blocks into the fp32 shards
      for (auto& u : units)
        if (!u->info.frozen) COSHARD_CO_TRY(shard_from(*u, u->grad_full.slice(block_offset(*u), Shape{u->info.shard}), u->grad_shard));
    COSHARD_CO_TRY_ASSIGN(auto finished, mark(cs));
    span(false, "reduce_scatter", kAllUnits, std::move(started), std::move(finished));
  } else {
    for (auto& u : units)  // units without a backward this step (unused parameters)
      if (u->grads_this_step == 0 && !u->info.frozen) COSHARD_CO_TRY(cs.fill(u->grad_shard.data(), 0, u->grad_shard.bytes()));
  }
  const auto K = static_cast<float>(micro_batches);
  if (micro_batches > 1)
    for (auto& u : units)
      if (!u->info.frozen) COSHARD_CO_TRY(k.scale(cs, DataType::f32, u->grad_shard.data(), 1.0f / K, u->info.shard));
  COSHARD_CO_TRY(compute_waits_for_comm(kGradients));
  co_return Result<void>{};
}

}  // namespace coshard::zero
