// The optimizer's state on the device, beside the shards: the norm and overflow flag are summed
// over ranks on the communication stream, then the optimizer steps every group on the compute
// stream (no host involved, nothing awaited).
#include "placement/optimizer_placement.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;
using collectives::ReduceOp;

namespace {

class OptimizerOnDevice final : public OptimizerPlacement {
 public:
  // Beside the shards: fp32 masters apart from them only in bf16/f16.
  void estimate(MemoryEstimate& m, const OptimizerSizes& z, std::span<const FetchUnitInfo>, const EngineOptions& o,
                std::size_t states) const override {
    const bool narrow = o.dtype != DataType::f32;
    m.add(MemoryPlace::device, optimizer_state_label(o.dtype, states), (narrow ? z.trained_f32 : 0) + states * z.trained_f32);
  }

  Result<void> add_unit(const OptimizerWiring& w, FetchUnit& u) override {
    if (u.info.frozen) return w.optimizer.add_frozen_group(w.ctx(), u.info.shard);  // no master, no state
    return w.optimizer.add_group(w.ctx(), u.shard, u.grad_shard, w.settings.segments_of(u), Optimizer::AllFrozen::hold_state);
  }

  async::Task<Result<void>> step(const OptimizerWiring& w, float lr) override {
    COSHARD_CO_TRY(w.optimizer.compute_grad_stats(w.ctx()));
    const Tensor grad_stats = w.optimizer.grad_stats();
    // Sharded (or with expert-parallel units): each rank's part of the norm, summed. Otherwise
    // every data rank holds the whole gradient (the tensor ranks still hold other parts).
    COSHARD_CO_TRY(w.sum_grad_stats(grad_stats.data(), w.norm_summed_over_ranks));
    co_return w.optimizer.apply(w.ctx(), lr);
  }

  async::Task<Result<void>> masters_from_shards(const OptimizerWiring& w) override {
    co_return w.optimizer.reset_masters(w.ctx());
  }

  async::Task<Result<void>> visit(const OptimizerWiring& w, const Engine::ShardVisitor& use, bool) override {
    co_return co_await visit_optimizer_groups(w, use);
  }

  Result<void> step_in_backward(const OptimizerWiring&, FetchUnit& u) override {
    return fail(ErrorCode::internal, "Engine: unit ", u.info.name,
                " stepped during backward with the optimizer on the device (needs it offloaded)");
  }
};

}  // namespace

// The optimizer's groups hold the master and state of each unit (device, or pinned memory).
async::Task<Result<void>> visit_optimizer_groups(const OptimizerWiring& w, const Engine::ShardVisitor& use) {
  for (const auto& u : w.units) {
    const auto group = w.settings.group_of(*u);
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
