// Gradient reduction (gradient_reduction.hpp): per unit during backward (all-reduce at stage 0,
// reduce-scatter at stages 2-3), or coalesced after the last micro-batch (stage 1); and the end
// of backward every stage shares (finish_gradients).
#include "engine_state.hpp"
#include "gradient_reduction.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

namespace {

// u's fp32 gradient shard (the optimizer reads it whatever the compute dtype), for use on
// `stream`; zeroed there unless the caller writes all of it first.
Result<void> allocate_shard(Engine::State& s, Unit& u, async::Stream& stream, bool zeroed = true) {
  const auto bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);
  COSHARD_TRY_ASSIGN(u.grad_shard_block, s.ctx->allocator().allocate(bytes, stream));
  u.grad_shard = Tensor(u.grad_shard_block.data(), Shape{u.info.shard}, DataType::f32, s.ctx->device());
  return zeroed ? stream.fill(u.grad_shard.data(), 0, bytes) : Result<void>{};
}
Result<void> allocate_shard(Engine::State& s, Unit& u) { return allocate_shard(s, u, s.ctx->stream()); }

// The reduced block `mine` (compute dtype) into an fp32 tensor, on the communication stream.
Result<void> shard_from(Engine::State& s, const Unit& u, const Tensor& mine, const Tensor& out) {
  auto& cs = s.comm->stream();
  if (s.o.dtype == DataType::f32) return cs.copy(out.data(), mine.data(), mine.bytes());
  return s.ctx->kernels().cast(cs, s.o.dtype, mine.data(), DataType::f32, out.data(), u.info.shard);
}

// Stages 0 and 2-3: each unit's whole gradient lives from its backward to its reduction, which
// runs on the communication stream as soon as the unit's last use of the micro-batch is done;
// the reduced block is added into the fp32 shard. The collective is the subclass's.
//
// With the optimizer offloaded the fp32 shard is not kept between steps (but for the units a device
// budget steps on the device): with one micro-batch it
// is made at the unit's reduction and given back once it is out in pinned memory (so the device
// holds a few, not the model's), with several it is made at the start of the step and given back
// when the step copies the shards out (HostOptimizer::exchange_grad_stats).
class PerUnit : public GradientReduction {
 public:
  Result<void> allocate(Engine::State& s, Unit& u) override {
    return u.info.frozen || u.info.optimizer_offloaded ? Result<void>{} : allocate_shard(s, u);
  }

  Result<void> begin_step(Engine::State& s, Unit& u) override {
    if (u.grad_full) {  // left by an abandoned step
      u.grad_full_block.reset();
      u.grad_full = {};
    }
    if (!u.info.optimizer_offloaded || u.info.frozen) return {};
    if (u.grad_shard) {  // left by an abandoned step
      u.grad_shard_block.reset();
      u.grad_shard = {};
    }
    return s.grads_out_in_backward ? Result<void>{} : allocate_shard(s, u);
  }

  Result<void> begin_backward(Engine::State& s, Unit& u) override {
    if (!u.info.frozen && !u.grad_full) {  // (another use of this micro-batch adds into the same)
      COSHARD_TRY_ASSIGN(u.grad_full_block, s.ctx->allocator().allocate(u.info.padded_bytes, s.ctx->stream()));
      u.grad_full = Tensor(u.grad_full_block.data(), Shape{u.info.padded}, s.o.dtype, s.ctx->device());
      COSHARD_TRY(s.ctx->stream().fill(u.grad_full.data(), 0, u.info.padded_bytes));
    }
    return s.bind_values(u, s.values_of(u));
  }

  Result<void> after_backward(Engine::State& s, Unit& u) override {
    if (u.info.frozen) return {};
    ++u.backwards_this_step;
    // Another use of this micro-batch is still to come backward: its gradient goes into the same
    // buffer (kept; the parameters are rebound at that use), and the unit is reduced once after it.
    if (--u.uses_pending > 0) return {};
    auto& cs = s.comm->stream();
    COSHARD_TRY_ASSIGN(auto produced, s.ctx->stream().record());
    COSHARD_TRY(cs.wait(produced));
    async::Event started;
    if (s.timeline.spans_on()) {
      COSHARD_TRY_ASSIGN(started, cs.record_timed());
    }
    Tensor mine = u.grad_full.slice(s.block_offset(u), Shape{u.info.shard});
    auto reduced_launch = reduce(s, u, mine);
    s.stats.reduce_scattered_bytes += u.info.padded_bytes;
    if (!reduced_launch)
      return fail(std::move(reduced_launch).error().with_context("reducing the gradients of unit " + u.info.name));
    // Into the fp32 shard (bf16/f16 compute reduces in its own dtype, accumulates in fp32).
    async::Block scratch;
    // Offloaded, one micro-batch: made for this reduction (the first writes all of it, below).
    if (!u.grad_shard) COSHARD_TRY(allocate_shard(s, u, cs, false));
    if (u.grads_this_step == 0) {
      COSHARD_TRY(shard_from(s, u, mine, u.grad_shard));
    } else if (s.o.dtype == DataType::f32) {
      COSHARD_TRY(s.ctx->kernels().add(cs, DataType::f32, u.grad_shard.data(), mine.data(), u.grad_shard.data(), u.info.shard));
    } else {
      COSHARD_TRY_ASSIGN(scratch, s.ctx->allocator().allocate(u.grad_shard.bytes(), cs));
      Tensor widened(scratch.data(), Shape{u.info.shard}, DataType::f32, s.ctx->device());
      COSHARD_TRY(shard_from(s, u, mine, widened));
      COSHARD_TRY(s.ctx->kernels().add(cs, DataType::f32, u.grad_shard.data(), widened.data(), u.grad_shard.data(), u.info.shard));
    }
    ++u.grads_this_step;
    COSHARD_TRY_ASSIGN(auto reduced, s.timeline.span_mark(cs));
    if (s.grads_out_in_backward && u.info.optimizer_offloaded) {
      // (a unit with two backward passes is copied again: the last copy wins; through a pass of the
      // swapper, the shard stays on the device until the pass steps it or swaps it out)
      const bool copied_out = !s.grads_wait_for_a_pass();
      if (copied_out) {
        COSHARD_TRY(cs.copy(u.host_grad.data(), u.grad_shard.data(), u.grad_shard.bytes()));
        s.stats.swap_bytes += u.grad_shard.bytes();
      }
      u.grads_out = true;
      const bool last = u.backwards_this_step == u.forward_uses;
      if (s.stepping_in_backward && last) COSHARD_TRY(s.step_on_host(u));
      if (s.grads_to_nvme() && last) COSHARD_TRY(s.hand_to_swap_step(u));  // to the pass writing it out
      if (copied_out && u.backwards_this_step == u.forward_uses) {  // its last of the step: back once the copy has passed
        COSHARD_TRY_ASSIGN(auto out, cs.record());
        u.grad_shard_block.reset_after(out);
        u.grad_shard = {};
      }
    }
    if (scratch) scratch.reset_after(reduced);
    s.timeline.span(false, span_name(), u.info.name, std::move(started), reduced);
    u.grad_full_block.record_use(reduced);
    u.grad_full_block.reset();
    u.grad_full = {};
    return s.bind_values(u, s.values_of(u));
  }

  async::Task<Result<void>> finish(Engine::State& s) override {
    auto& cs = s.comm->stream();
    for (auto& u : s.units) {  // units without a backward this step (unused parameters)
      if (u->grads_this_step != 0 || u->info.frozen) continue;
      if (!u->grad_shard) {  // offloaded, one micro-batch: made zero, then copied out with the rest
        COSHARD_CO_TRY(allocate_shard(s, *u, cs));
      } else {
        COSHARD_CO_TRY(cs.fill(u->grad_shard.data(), 0, u->grad_shard.bytes()));
      }
    }
    co_return Result<void>{};
  }

  bool complete_per_unit() const noexcept override { return true; }
  bool reduces_every_unit() const noexcept override { return false; }

  // A unit's whole gradient lives from its backward until its reduction is done (one being
  // produced, one being reduced); the reduced shards are fp32.
  void estimate(MemoryEstimate& m, const GradientSizes& g, DataType) const override {
    m.add(MemoryPlace::device, "gradients in flight (two largest units)", std::min(g.whole, 2 * g.largest_whole));
    if (g.shards_in_flight) {
      m.add(MemoryPlace::device, std::string(shard_label()) + ", two largest in flight", std::min(g.shards_f32, 2 * g.largest_shard_f32));
      m.add(MemoryPlace::device, std::string(shard_label()) + " of the units stepped on the device", g.resident_shards_f32);
    } else {
      m.add(MemoryPlace::device, shard_label(), g.shards_f32 + g.resident_shards_f32);
    }
  }

 protected:
  virtual const char* shard_label() const noexcept = 0;
  // The collective over u's whole gradient that leaves this rank's block `mine` averaged.
  virtual Result<async::Event> reduce(Engine::State& s, Unit& u, const Tensor& mine) = 0;
  virtual const char* span_name() const noexcept = 0;
};

class AllReducePerUnit final : public PerUnit {
  Result<async::Event> reduce(Engine::State& s, Unit& u, const Tensor&) override {
    return s.comm->all_reduce(u.grad_full.data(), u.grad_full.data(), static_cast<std::size_t>(u.info.padded), s.o.dtype,
                              ReduceOp::avg, u.reduce_purpose);
  }
  const char* span_name() const noexcept override { return "all_reduce"; }
  const char* shard_label() const noexcept override { return "gradients (f32, whole)"; }  // (every rank all of it)
};

// Within the unit's shard group; with several copies of each block (hybrid sharding), the
// reduced block is then averaged across them: the only collective that leaves the group.
class ReduceScatterPerUnit final : public PerUnit {
  Result<async::Event> reduce(Engine::State& s, Unit& u, const Tensor& mine) override {
    const auto n = static_cast<std::size_t>(u.info.shard);
    auto done = s.launch_in_group(
        u, Coalesced{}.reduce_scatter(u.grad_full.data(), mine.data(), n, s.o.dtype, ReduceOp::avg).purpose(u.reduce_purpose));
    if (!done || !u.group->replicate) return done;
    return s.launch_across_copies(
        u, Coalesced{}.all_reduce(mine.data(), mine.data(), n, s.o.dtype, ReduceOp::avg).purpose(u.reduce_purpose));
  }
  const char* span_name() const noexcept override { return "reduce_scatter"; }
  const char* shard_label() const noexcept override { return "gradient shards (f32)"; }
};

// Stage 1: each unit's whole gradient is kept (and bound) through the step; after the last
// micro-batch every unit is reduce-scattered in one launch. In f32 the shard is this rank's block
// of the whole buffer, reduced in place.
class CoalescedAfterBackward final : public GradientReduction {
 public:
  Result<void> allocate(Engine::State& s, Unit& u) override {
    if (u.info.frozen) return {};
    auto& stream = s.ctx->stream();
    COSHARD_TRY_ASSIGN(u.grad_full_block, s.ctx->allocator().allocate(u.info.padded_bytes, stream));
    u.grad_full = Tensor(u.grad_full_block.data(), Shape{u.info.padded}, s.o.dtype, s.ctx->device());
    COSHARD_TRY(stream.fill(u.grad_full.data(), 0, u.info.padded_bytes));
    if (s.o.dtype != DataType::f32) return allocate_shard(s, u);
    u.grad_shard = u.grad_full.slice(s.block_offset(u), Shape{u.info.shard});  // reduced in place: no copy
    return {};
  }

  Result<void> begin_step(Engine::State& s, Unit& u) override {
    if (u.info.frozen) return {};
    return s.ctx->stream().fill(u.grad_full.data(), 0, u.info.padded_bytes);
  }

  Result<void> begin_backward(Engine::State&, Unit&) override { return {}; }  // (bound when made)

  Result<void> after_backward(Engine::State&, Unit& u) override {
    if (!u.info.frozen) ++u.grads_this_step;  // reduced after backward; counted as used here
    return {};
  }

  async::Task<Result<void>> finish(Engine::State& s) override {
    auto& cs = s.comm->stream();
    COSHARD_CO_TRY_ASSIGN(auto started, s.timeline.mark(cs));
    // Within each shard group, then (hybrid sharding) across the copies of each block.
    COSHARD_CO_TRY(s.launch_by_group(false, [&](Unit& u, Coalesced& group) {
      if (u.info.frozen) return;
      Tensor mine = u.grad_full.slice(s.block_offset(u), Shape{u.info.shard});
      group.reduce_scatter(u.grad_full.data(), mine.data(), static_cast<std::size_t>(u.info.shard), s.o.dtype, ReduceOp::avg)
          .purpose(u.reduce_purpose);
      s.stats.reduce_scattered_bytes += u.info.padded_bytes;
    }));
    COSHARD_CO_TRY(s.launch_by_group(true, [&](Unit& u, Coalesced& group) {
      if (u.info.frozen) return;
      Tensor mine = u.grad_full.slice(s.block_offset(u), Shape{u.info.shard});
      group.all_reduce(mine.data(), mine.data(), static_cast<std::size_t>(u.info.shard), s.o.dtype, ReduceOp::avg)
          .purpose(u.reduce_purpose);
    }));
    if (s.o.dtype != DataType::f32)  // bf16/f16: the reduced blocks into the fp32 shards
      for (auto& u : s.units)
        if (!u->info.frozen)
          COSHARD_CO_TRY(shard_from(s, *u, u->grad_full.slice(s.block_offset(*u), Shape{u->info.shard}), u->grad_shard));
    COSHARD_CO_TRY_ASSIGN(auto finished, s.timeline.mark(cs));
    s.timeline.span(false, "reduce_scatter", kAllUnits, std::move(started), std::move(finished));
    co_return Result<void>{};
  }

  bool complete_per_unit() const noexcept override { return false; }
  bool reduces_every_unit() const noexcept override { return true; }

  // Whole and persistent through the step; fp32 shards apart only in bf16/f16.
  void estimate(MemoryEstimate& m, const GradientSizes& g, DataType dtype) const override {
    m.add(MemoryPlace::device, "gradients (" + std::string(collectives::to_string(dtype)) + ", whole)", g.whole);
    if (dtype != DataType::f32) m.add(MemoryPlace::device, "gradient shards (f32)", g.shards_f32 + g.resident_shards_f32);
  }
};

}  // namespace

std::unique_ptr<GradientReduction> make_all_reduce_per_unit() { return std::make_unique<AllReducePerUnit>(); }
std::unique_ptr<GradientReduction> make_reduce_scatter_per_unit() { return std::make_unique<ReduceScatterPerUnit>(); }
std::unique_ptr<GradientReduction> make_coalesced_after_backward() { return std::make_unique<CoalescedAfterBackward>(); }

std::unique_ptr<GradientReduction> make_gradient_reduction(int zero_stage) {
  if (zero_stage == 0) return make_all_reduce_per_unit();
  if (zero_stage == 1) return make_coalesced_after_backward();
  return make_reduce_scatter_per_unit();
}

// After the last micro-batch: what is left reduced, the shards scaled by the micro-batch count,
// and the compute stream waits for them.
async::Task<Result<void>> Engine::State::finish_gradients(std::size_t micro_batches) {
  auto& cs = comm->stream();
  COSHARD_CO_TRY(order(ctx->stream(), cs));
  COSHARD_CO_TRY(co_await reduction->finish(*this));
  const auto K = static_cast<float>(micro_batches);
  if (micro_batches > 1)
    for (auto& u : units)
      if (!u->info.frozen) COSHARD_CO_TRY(ctx->kernels().scale(cs, DataType::f32, u->grad_shard.data(), 1.0f / K, u->info.shard));
  COSHARD_CO_TRY(compute_waits_for_comm(kGradients));
  co_return Result<void>{};
}

}  // namespace coshard::zero
