// Gradient reduction (gradient_reduction.hpp): per unit during backward (all-reduce at stage 0,
// reduce-scatter at stages 2-3), or coalesced after the last micro-batch (stage 1). What is left
// after the last micro-batch (scaling, the compute stream's wait) is the loop's (loop.cpp).
#include "gradient_reduction.hpp"
#include "kernels/kernels.hpp"
#include "stream_order.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;
using collectives::Coalesced;
using collectives::ReduceOp;

namespace {

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
  Result<void> allocate(const GradientWiring& w, FetchUnit& u) override {
    return u.info.frozen || u.info.optimizer_offloaded ? Result<void>{} : u.allocate_grad_shard(w.io, w.io.ctx.stream());
  }

  Result<void> begin_step(const GradientWiring& w, FetchUnit& u) override {
    if (u.grad_full) {  // left by an abandoned step
      u.grad_full_block.reset();
      u.grad_full = {};
    }
    if (!u.info.optimizer_offloaded || u.info.frozen) return {};
    if (u.grad_shard) {  // left by an abandoned step
      u.grad_shard_block.reset();
      u.grad_shard = {};
    }
    return w.out.shards_leave_in_backward() ? Result<void>{} : u.allocate_grad_shard(w.io, w.io.ctx.stream());
  }

  Result<void> begin_backward(const GradientWiring& w, FetchUnit& u) override {
    if (!u.info.frozen && !u.grad_full) {  // (another use of this micro-batch adds into the same)
      COSHARD_TRY_ASSIGN(u.grad_full_block, w.io.ctx.allocator().allocate(u.info.padded_bytes, w.io.ctx.stream()));
      u.grad_full = Tensor(u.grad_full_block.data(), Shape{u.info.padded}, w.io.dtype, w.io.ctx.device());
      COSHARD_TRY(w.io.ctx.stream().fill(u.grad_full.data(), 0, u.info.padded_bytes));
    }
    return u.bind(w.residence.values(u));
  }

  Result<void> after_backward(const GradientWiring& w, FetchUnit& u) override {
    if (u.info.frozen) return {};
    ++u.backwards_this_step;
    // Another use of this micro-batch is still to come backward: its gradient goes into the same
    // buffer (kept; the parameters are rebound at that use), and the unit is reduced once after it.
    if (--u.uses_pending > 0) return {};
    auto& cs = w.io.world.stream();
    COSHARD_TRY(order(w.io.ctx.stream(), cs));  // after the unit's backward
    async::Event started;
    if (w.timeline.spans_on()) {
      COSHARD_TRY_ASSIGN(started, cs.record_timed());
    }
    Tensor mine = u.grad_full.slice(u.block_offset, Shape{u.info.shard});
    COSHARD_TRY(u.scale_expert_gradient(w.io));
    auto reduced_launch = reduce(w, u, mine);
    // (what the reduction carried: int8 blocks where quantized)
    w.stats.reduce_scattered_bytes += u.grad_blocks.carried_bytes(u.info);
    if (!reduced_launch)
      return fail(std::move(reduced_launch).error().with_context("reducing the gradients of unit " + u.info.name));
    // Into the fp32 shard (bf16/f16 compute reduces in its own dtype, accumulates in fp32).
    async::Block scratch;
    // Offloaded, one micro-batch: made for this reduction (the first writes all of it, below).
    if (!u.grad_shard) COSHARD_TRY(u.allocate_grad_shard(w.io, cs, false));
    if (u.grads_this_step == 0) {
      COSHARD_TRY(u.widen_block(w.io, mine, u.grad_shard));
    } else if (w.io.dtype == DataType::f32) {
      COSHARD_TRY(w.io.ctx.kernels().add(cs, DataType::f32, u.grad_shard.data(), mine.data(), u.grad_shard.data(), u.info.shard));
    } else {
      COSHARD_TRY_ASSIGN(scratch, w.io.ctx.allocator().allocate(u.grad_shard.bytes(), cs));
      Tensor widened(scratch.data(), Shape{u.info.shard}, DataType::f32, w.io.ctx.device());
      COSHARD_TRY(u.widen_block(w.io, mine, widened));
      COSHARD_TRY(w.io.ctx.kernels().add(cs, DataType::f32, u.grad_shard.data(), widened.data(), u.grad_shard.data(), u.info.shard));
    }
    ++u.grads_this_step;
    COSHARD_TRY_ASSIGN(auto reduced, w.timeline.span_mark(cs));
    // Offloaded, its shard leaving during backward: the optimizer placement's (copied out, stepped,
    // or handed to a pass of the swapper).
    if (w.out.shards_leave_in_backward() && u.info.optimizer_offloaded) COSHARD_TRY(w.out.shard_reduced(u));
    if (scratch) scratch.reset_after(reduced);
    w.timeline.span(false, span_name(), u.info.name, std::move(started), reduced);
    u.grad_full_block.record_use(reduced);
    u.grad_full_block.reset();
    u.grad_full = {};
    return u.bind(w.residence.values(u));
  }

  async::Task<Result<void>> finish(const GradientWiring& w) override {
    auto& cs = w.io.world.stream();
    for (auto& u : w.units) {  // units without a backward this step (unused parameters)
      if (u->grads_this_step != 0 || u->info.frozen) continue;
      if (!u->grad_shard) {  // offloaded, one micro-batch: made zero, then copied out with the rest
        COSHARD_CO_TRY(u->allocate_grad_shard(w.io, cs));
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
  virtual Result<async::Event> reduce(const GradientWiring& w, FetchUnit& u, const Tensor& mine) = 0;
  virtual const char* span_name() const noexcept = 0;
};

class AllReducePerUnit final : public PerUnit {
  Result<async::Event> reduce(const GradientWiring& w, FetchUnit& u, const Tensor&) override {
    return u.all_reduce_gradient(w.io);
  }
  const char* span_name() const noexcept override { return "all_reduce"; }
  const char* shard_label() const noexcept override { return "gradients (f32, whole)"; }  // (every rank all of it)
};

// Within the unit's shard group; with several copies of each block (hybrid sharding), the
// reduced block is then averaged across them: the only collective that leaves the group.
class ReduceScatterPerUnit final : public PerUnit {
  Result<async::Event> reduce(const GradientWiring& w, FetchUnit& u, const Tensor& mine) override {
    return u.reduce_scatter_gradient(w.io, mine);
  }
  const char* span_name() const noexcept override { return "reduce_scatter"; }
  const char* shard_label() const noexcept override { return "gradient shards (f32)"; }
};

// Stage 1: each unit's whole gradient is kept (and bound) through the step; after the last
// micro-batch every unit is reduce-scattered in one launch. In f32 the shard is this rank's block
// of the whole buffer, reduced in place.
class CoalescedAfterBackward final : public GradientReduction {
 public:
  Result<void> allocate(const GradientWiring& w, FetchUnit& u) override {
    if (u.info.frozen) return {};
    auto& stream = w.io.ctx.stream();
    COSHARD_TRY_ASSIGN(u.grad_full_block, w.io.ctx.allocator().allocate(u.info.padded_bytes, stream));
    u.grad_full = Tensor(u.grad_full_block.data(), Shape{u.info.padded}, w.io.dtype, w.io.ctx.device());
    COSHARD_TRY(stream.fill(u.grad_full.data(), 0, u.info.padded_bytes));
    if (w.io.dtype != DataType::f32) return u.allocate_grad_shard(w.io, stream);
    u.grad_shard = u.grad_full.slice(u.block_offset, Shape{u.info.shard});  // reduced in place: no copy
    return {};
  }

  Result<void> begin_step(const GradientWiring& w, FetchUnit& u) override {
    if (u.info.frozen) return {};
    return w.io.ctx.stream().fill(u.grad_full.data(), 0, u.info.padded_bytes);
  }

  Result<void> begin_backward(const GradientWiring&, FetchUnit&) override { return {}; }  // (bound when made)

  Result<void> after_backward(const GradientWiring&, FetchUnit& u) override {
    if (!u.info.frozen) ++u.grads_this_step;  // reduced after backward; counted as used here
    return {};
  }

  async::Task<Result<void>> finish(const GradientWiring& w) override {
    auto& cs = w.io.world.stream();
    COSHARD_CO_TRY_ASSIGN(auto started, w.timeline.mark(cs));
    for (auto& u : w.units)
      if (!u->info.frozen) COSHARD_CO_TRY(u->scale_expert_gradient(w.io));
    // Within each shard group, then (hybrid sharding) across the copies of each block.
    COSHARD_CO_TRY(launch_by_group(w.io.world, w.groups, w.units, false, [&](FetchUnit& u, Coalesced& group) {
      if (u.info.frozen) return;
      Tensor mine = u.grad_full.slice(u.block_offset, Shape{u.info.shard});
      group.reduce_scatter(u.grad_full.data(), mine.data(), static_cast<std::size_t>(u.info.shard), w.io.dtype, ReduceOp::avg)
          .purpose(u.reduce_purpose);
      w.stats.reduce_scattered_bytes += u.info.padded_bytes;
    }));
    COSHARD_CO_TRY(launch_by_group(w.io.world, w.groups, w.units, true, [&](FetchUnit& u, Coalesced& group) {
      if (u.info.frozen) return;
      Tensor mine = u.grad_full.slice(u.block_offset, Shape{u.info.shard});
      group.all_reduce(mine.data(), mine.data(), static_cast<std::size_t>(u.info.shard), w.io.dtype, ReduceOp::avg)
          .purpose(u.reduce_purpose);
    }));
    if (w.io.dtype != DataType::f32)  // bf16/f16: the reduced blocks into the fp32 shards
      for (auto& u : w.units)
        if (!u->info.frozen)
          COSHARD_CO_TRY(u->widen_block(w.io, u->grad_full.slice(u->block_offset, Shape{u->info.shard}), u->grad_shard));
    COSHARD_CO_TRY_ASSIGN(auto finished, w.timeline.mark(cs));
    w.timeline.span(false, "reduce_scatter", kAllUnits, std::move(started), std::move(finished));
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

}  // namespace coshard::zero
