// The optimizer's state on the device, beside the shards: the norm and overflow flag are summed
// over ranks on the communication stream, then the optimizer steps every group on the compute
// stream (no host involved, nothing awaited).
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

namespace {

class OptimizerOnDevice final : public OptimizerPlacement {
 public:
  // Beside the shards: fp32 masters apart from them only in bf16/f16.
  void estimate(MemoryEstimate& m, const OptimizerSizes& z, std::span<const FetchUnitInfo>, const EngineOptions& o,
                std::size_t states) const override {
    const bool narrow = o.dtype != DataType::f32;
    m.add(MemoryPlace::device, optimizer_state_label(o.dtype, states), (narrow ? z.trained_f32 : 0) + states * z.trained_f32);
  }

  Result<void> add_unit(Engine::State& s, FetchUnit& u) override {
    if (u.info.frozen) return s.optimizer->add_frozen_group(*s.ctx, u.info.shard);  // no master, no state
    return s.optimizer->add_group(*s.ctx, u.shard, u.grad_shard, s.segments_of(u), Optimizer::AllFrozen::hold_state);
  }

  async::Task<Result<void>> step(Engine::State& s, float lr) override {
    auto& compute = s.ctx->stream();
    COSHARD_CO_TRY(s.optimizer->compute_grad_stats(*s.ctx));
    COSHARD_CO_TRY(order(compute, s.comm->stream()));
    const Tensor grad_stats = s.optimizer->grad_stats();
    // Sharded: each rank's part of the norm, summed. Unsharded: every rank holds the whole gradient.
    if (s.residence->sharded())
      COSHARD_CO_TRY(s.comm->all_reduce(grad_stats.data(), grad_stats.data(), 2, DataType::f32, ReduceOp::sum,
                                          "the gradients' norm"));
    COSHARD_CO_TRY(s.compute_waits_for_comm(kGradStats));
    co_return s.optimizer->apply(*s.ctx, lr);
  }

  async::Task<Result<void>> masters_from_shards(Engine::State& s) override {
    co_return s.optimizer->reset_masters(*s.ctx);
  }

  async::Task<Result<void>> visit(Engine::State& s, const Engine::ShardVisitor& use, bool) override {
    co_return co_await visit_optimizer_groups(s, use);
  }

  Result<void> step_in_backward(Engine::State&, FetchUnit& u) override {
    return fail(ErrorCode::internal, "Engine: unit ", u.info.name,
                " stepped during backward with the optimizer on the device (needs it offloaded)");
  }
};

}  // namespace

// The optimizer's groups hold the master and state of each unit (device, or pinned memory).
async::Task<Result<void>> visit_optimizer_groups(Engine::State& s, const Engine::ShardVisitor& use) {
  for (const auto& u : s.units) {
    const auto group = s.group_of(*u);
    const auto& g = group.optimizer.groups()[group.index];
    const UnitShard shard{u->info, u->shard, g.master, g.state1, g.state2};
    COSHARD_CO_TRY(co_await use(shard));
  }
  co_return Result<void>{};
}

std::unique_ptr<OptimizerPlacement> make_optimizer_on_device() { return std::make_unique<OptimizerOnDevice>(); }

std::unique_ptr<OptimizerPlacement> make_optimizer_placement(OffloadTarget where) {
  switch (where) {
    case OffloadTarget::none: return make_optimizer_on_device();
    case OffloadTarget::cpu: return make_optimizer_on_host();
    case OffloadTarget::nvme: return make_optimizer_on_nvme();
  }
  return nullptr;
}

std::string fp32_masters_label(std::size_t states) {
  return "fp32 masters" +
         (states == 0 ? std::string() : " and " + std::to_string(states) + " state tensor" + (states == 1 ? "" : "s"));
}

std::string optimizer_state_label(DataType dtype, std::size_t states) {
  return dtype != DataType::f32 ? fp32_masters_label(states) : "optimizer state (" + std::to_string(states) + " tensors)";
}

}  // namespace coshard::zero
