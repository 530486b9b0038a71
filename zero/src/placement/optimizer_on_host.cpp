// The optimizer's state in pinned host memory (ZeRO-Offload): each step copies the reduced
// gradient shards out, the host stream steps every group with the CPU kernels (the same kernels
// and order as on a CPU device), and the updated shards go back to the device: fp32 masters as
// they are, bf16/f16 as the pinned copy in the compute dtype the optimizer writes (half the
// bytes). With the parameters offloaded too, the pinned master (or copy) is the shard: nothing
// goes back. Also the first half of every offloaded step (HostOptimizer), shared with NVMe.
#include "placement/offload_sizes.hpp"
#include "placement/optimizer_placement.hpp"
#include "placement/step_in_backward.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;
using collectives::ReduceOp;

// The CPU stream and context the optimizer steps on, and the pinned pool of the plan (reserved
// now: a budget too small fails here, naming what it holds).
Result<void> HostOptimizer::setup(const OptimizerWiring& w, std::span<const FetchUnitInfo> units) {
  const EngineOptions& o = w.o;
  const std::vector<std::size_t> sizes = detail::offload_pinned_sizes(units, o, w.optimizer.state_tensors());
  std::size_t needed = 0, largest_shard = 0;
  for (const auto& u : units) largest_shard = std::max(largest_shard, static_cast<std::size_t>(u.shard) * w.element_size());
  for (std::size_t b : sizes) needed += offload::page_rounded(b);
  offload::PinnedPoolOptions pool_options;
  pool_options.host_memory_budget = o.host_memory_budget == 0 ? needed : o.host_memory_budget;
  COSHARD_TRY_ASSIGN(w.host.pinned, offload::PinnedPool::create(pool_options));
  if (auto fits = w.host.pinned->reserve(sizes); !fits)
    return fail(std::move(fits).error().with_context(
        std::string(w.swapped() ? "offload_optimizer=nvme (gradient shards and swap buffers" : "offload_optimizer=cpu (fp32 master and gradient shards") +
        (w.params_on_nvme() ? ", parameter read buffers)" : o.offload_params == OffloadTarget::cpu && w.swapped() ? ", pinned parameter shards)" : ")")));
  async::StreamOptions host_options;
  host_options.name = "optimizer" + std::to_string(w.rank);
  COSHARD_TRY_ASSIGN(auto host_stream, async::Stream::create(async::Device::cpu(), host_options));
  w.host.stream = std::make_unique<async::Stream>(std::move(host_stream));
  COSHARD_TRY_ASSIGN(w.host.allocator, async::CachingAllocator::create(async::Device::cpu()));
  COSHARD_TRY_ASSIGN(auto host_ctx, Context::create(*w.host.stream, *w.host.allocator));
  w.host.ctx = std::make_unique<Context>(std::move(host_ctx));
  if (w.swapped() && w.narrow() && detail::shards_staged(units, o)) {
    COSHARD_TRY_ASSIGN(w.host.staging, w.host.pinned->acquire(largest_shard));
  }
  return {};
}

void HostOptimizer::estimate_pinned(MemoryEstimate& m, std::span<const FetchUnitInfo> units, const EngineOptions& o,
                                    std::size_t states) {
  std::size_t pinned = 0;
  for (const std::size_t b : detail::offload_pinned_sizes(units, o, states)) pinned += offload::page_rounded(b);
  // (host_memory_budget caps the pool; only what the plan reserves is allocated.)
  const bool narrow = o.dtype != DataType::f32;
  const bool through_pass = o.offload_optimizer == OffloadTarget::nvme && (o.step_in_backward || o.swap_gradients);
  m.add(MemoryPlace::pinned_host, through_pass ? std::string("swap buffers (the gradients through them: ") +
                                                     (o.step_in_backward ? "step_in_backward)" : "swap_gradients)")
                                  : o.offload_optimizer == OffloadTarget::nvme ? "gradient shards and swap buffers"
                                  : narrow ? "gradient shards and " + std::string(collectives::to_string(o.dtype)) + " parameter copies"
                                           : "fp32 masters and gradient shards",
        pinned);
}

// The loss scale seeding backward and the statistics summed across ranks live on the device; the
// sums come back through pinned memory.
Result<void> HostOptimizer::after_units(const OptimizerWiring& w) {
  COSHARD_TRY_ASSIGN(w.host.device_loss_scale, w.ctx().zeros(Shape{1}, DataType::f32));
  COSHARD_TRY_ASSIGN(w.host.device_grad_stats, w.ctx().zeros(Shape{2}, DataType::f32));
  COSHARD_TRY_ASSIGN(w.host.grad_stats_back, w.host.pinned->acquire(2 * sizeof(float)));
  COSHARD_TRY_ASSIGN(w.host.step_state_out, w.host.pinned->acquire(detail::kStepStateBytes));
  return {};
}

// Backward is seeded with the loss scale the host optimizer holds (it may have changed at the last
// step, or with a checkpoint load); the device part of the optimizer takes its step state. Through
// pinned memory (a device's copy from pageable memory waits for its stream), after a checkpoint's
// load wrote the state on the compute stream.
async::Task<Result<void>> HostOptimizer::begin_step(const OptimizerWiring& w) {
  if (w.mode.stepping_in_backward) COSHARD_CO_TRY(w.optimizer.begin_grad_stats(*w.host.ctx));
  auto& compute = w.ctx().stream();
  auto& host = *w.host.stream;
  const Tensor host_state = w.optimizer.step_state();
  COSHARD_CO_TRY(order(compute, host));
  COSHARD_CO_TRY(host.copy(w.host.step_state_out.data(), host_state.data(), host_state.bytes()));
  COSHARD_CO_TRY_ASSIGN(auto host_done, host.record());
  COSHARD_CO_TRY(co_await after(compute, host_done));
  const Tensor scale = w.optimizer.loss_scale();
  const auto scale_at = static_cast<std::size_t>(static_cast<const std::byte*>(scale.data()) -
                                                 static_cast<const std::byte*>(host_state.data()));
  COSHARD_CO_TRY(compute.copy(w.host.device_loss_scale.data(), w.host.step_state_out.data() + scale_at, scale.bytes()));
  if (w.host.device_optimizer)
    COSHARD_CO_TRY(compute.copy(w.host.device_optimizer->step_state().data(), w.host.step_state_out.data(), host_state.bytes()));
  co_return Result<void>{};
}

Result<void> HostOptimizer::add_host_grad(const OptimizerWiring& w, FetchUnit& u) {
  COSHARD_TRY_ASSIGN(u.host_grad_block, w.host.pinned->acquire(static_cast<std::size_t>(u.info.shard) * sizeof(float)));
  u.host_grad = Tensor(u.host_grad_block.data(), Shape{u.info.shard}, DataType::f32, async::Device::cpu());
  return {};
}

async::Task<Result<void>> HostOptimizer::exchange_grad_stats(const OptimizerWiring& w) {
  COSHARD_CO_TRY(co_await local_grad_stats(w));
  co_return co_await sum_grad_stats(w);
}

async::Task<Result<void>> HostOptimizer::local_grad_stats(const OptimizerWiring& w) {
  auto& compute = w.ctx().stream();
  auto& host = *w.host.stream;
  if (w.grads_through_pass()) {
    // The shards stay on the device for the swapper's pass, which adds each piece's statistics.
    if (!w.mode.stepping_in_backward) co_return w.optimizer.begin_grad_stats(*w.host.ctx);
    for (auto& u : w.units)
      if (!u->stepped_early && !u->info.frozen) COSHARD_CO_TRY(hand_over_late(w, *u));
    w.pass.all_handed_over();  // every unit is handed over
    co_return Result<void>{};
  }
  for (auto& u : w.units) {
    // (out during backward: the compute stream has waited for it; stepped on the device: stays)
    if (u->grads_out || u->info.frozen || !u->info.optimizer_offloaded) continue;
    COSHARD_CO_TRY(compute.copy(u->host_grad.data(), u->grad_shard.data(), u->grad_shard.bytes()));
    w.stats.swap_bytes += u->grad_shard.bytes();
  }
  COSHARD_CO_TRY_ASSIGN(auto grads_out, compute.record());
  COSHARD_CO_TRY(host.wait(grads_out));
  // Reduced per unit, the device's gradient shards are not kept between steps (gradients.cpp):
  // back once copied. (Stage 1 keeps its whole gradients, and the shards in them, for good.)
  for (auto& u : w.units) {
    if (!u->grad_shard || !w.reduction.complete_per_unit() || !u->info.optimizer_offloaded) continue;
    u->grad_shard_block.reset_after(grads_out);
    u->grad_shard = {};
  }
  if (w.mode.stepping_in_backward) {  // the units not stepped yet add their share
    for (auto& u : w.units) {
      if (u->stepped_early || u->info.frozen || !u->info.optimizer_offloaded) continue;
      COSHARD_CO_TRY(w.optimizer.add_grad_stats(*w.host.ctx, w.settings.first_group + u->index));
      COSHARD_CO_TRY(hand_over_late(w, *u));
    }
    w.pass.all_handed_over();  // every unit is handed over
  } else {
    COSHARD_CO_TRY(w.optimizer.compute_grad_stats(*w.host.ctx));
  }
  co_return Result<void>{};
}

async::Task<Result<void>> HostOptimizer::sum_grad_stats(const OptimizerWiring& w) {
  auto& compute = w.ctx().stream();
  auto& host = *w.host.stream;
  // (through pinned memory both ways: a device's copy from pageable memory waits for its stream)
  const Tensor host_stats = w.optimizer.grad_stats();
  COSHARD_CO_TRY(host.copy(w.host.grad_stats_back.data(), host_stats.data(), host_stats.bytes()));
  COSHARD_CO_TRY_ASSIGN(auto stats_ready, host.record());
  // The units stepped on the device: their statistics on the compute stream, the device part's.
  if (w.host.device_optimizer) COSHARD_CO_TRY(w.host.device_optimizer->compute_grad_stats(w.ctx()));
  COSHARD_CO_TRY(co_await after(compute, stats_ready));
  COSHARD_CO_TRY(compute.copy(w.host.device_grad_stats.data(), w.host.grad_stats_back.data(), host_stats.bytes()));
  if (w.host.device_optimizer) {  // (the overflow flags add up as the sums do: > 0 is an overflow)
    const Tensor device_stats = w.host.device_optimizer->grad_stats();
    COSHARD_CO_TRY(w.ctx().kernels().add(compute, DataType::f32, w.host.device_grad_stats.data(), device_stats.data(),
                                        w.host.device_grad_stats.data(), 2));
  }
  COSHARD_CO_TRY(w.sum_grad_stats(w.host.device_grad_stats.data(), true));
  if (w.host.device_optimizer) {  // the device part steps with the sums too
    const Tensor device_stats = w.host.device_optimizer->grad_stats();
    COSHARD_CO_TRY(compute.copy(device_stats.data(), w.host.device_grad_stats.data(), device_stats.bytes()));
  }
  COSHARD_CO_TRY(compute.copy(w.host.grad_stats_back.data(), w.host.device_grad_stats.data(), host_stats.bytes()));
  COSHARD_CO_TRY(order(compute, host));
  co_return host.copy(host_stats.data(), w.host.grad_stats_back.data(), host_stats.bytes());
}

namespace {

class OptimizerOnHost final : public HostOptimizer {
 public:
  // Masters apart from the parameters (bf16/f16) and the state in ordinary host memory; the
  // pinned pool beside them.
  void estimate(MemoryEstimate& m, const OptimizerSizes& z, std::span<const FetchUnitInfo> units, const EngineOptions& o,
                std::size_t states) const override {
    const bool narrow = o.dtype != DataType::f32;
    const std::size_t offloaded = z.trained_f32 - z.kept_f32;
    m.add(MemoryPlace::pageable_host, optimizer_state_label(o.dtype, states) + " (offload cpu)",
          (narrow ? offloaded : 0) + states * offloaded);
    m.add(MemoryPlace::device, optimizer_state_label(o.dtype, states) + " of the units stepped on the device",
          (narrow ? z.kept_f32 : 0) + states * z.kept_f32);
    estimate_pinned(m, units, o, states);
  }

  // With units a device budget keeps on the device: the optimizer's device part.
  Result<void> setup(const OptimizerWiring& w, std::span<const FetchUnitInfo> units) override {
    COSHARD_TRY(HostOptimizer::setup(w, units));
    if (std::none_of(units.begin(), units.end(), [](const FetchUnitInfo& u) { return !u.frozen && !u.optimizer_offloaded; }))
      return {};
    COSHARD_TRY_ASSIGN(w.host.device_optimizer, w.optimizer.empty_like());
    return {};
  }

  Result<void> add_unit(const OptimizerWiring& w, FetchUnit& u) override {
    const Shape shard_shape{u.info.shard};
    const auto shard_bytes = static_cast<std::size_t>(u.info.shard) * w.element_size();
    if (!u.info.frozen && !u.info.optimizer_offloaded) {
      // Stepped on the device: its group in the device part, over the shard and its resident
      // gradient shard; an empty frozen group keeps its place in the user's optimizer.
      u.device_group = w.host.device_optimizer->groups().size();
      COSHARD_TRY(w.host.device_optimizer->add_group(w.ctx(), u.shard, u.grad_shard, w.settings.segments_of(u),
                                                  Optimizer::AllFrozen::hold_state));
      return w.optimizer.add_frozen_group(*w.host.ctx, u.info.shard);
    }
    if (u.info.frozen) {
      // Nothing to step: no gradient, master or state; with the parameters offloaded, the pinned
      // shard alone (in the compute dtype).
      if (u.info.shard_offloaded) {
        COSHARD_TRY_ASSIGN(u.host_param_block, w.host.pinned->acquire(shard_bytes));
        u.host_param = Tensor(u.host_param_block.data(), shard_shape, w.o.dtype, async::Device::cpu());
        u.shard = u.host_param;
      }
      return w.optimizer.add_frozen_group(*w.host.ctx, u.info.shard);
    }
    COSHARD_TRY(add_host_grad(w, u));
    if (w.narrow()) {
      // bf16/f16: the group's parameters are a pinned copy in the compute dtype (the shard itself
      // when the parameters are offloaded); the optimizer makes the fp32 master.
      COSHARD_TRY_ASSIGN(u.host_param_block, w.host.pinned->acquire(shard_bytes));
      u.host_param = Tensor(u.host_param_block.data(), shard_shape, w.o.dtype, async::Device::cpu());
      if (u.info.shard_offloaded) u.shard = u.host_param;
      return w.optimizer.add_group(*w.host.ctx, u.host_param, u.host_grad, w.settings.segments_of(u), Optimizer::AllFrozen::hold_state);
    }
    COSHARD_TRY_ASSIGN(u.host_master_block, w.host.pinned->acquire(shard_bytes));
    u.host_master = Tensor(u.host_master_block.data(), shard_shape, DataType::f32, async::Device::cpu());
    if (u.info.shard_offloaded) u.shard = u.host_master;  // f32: the master is the parameter
    return w.optimizer.add_group(*w.host.ctx, u.host_master, u.host_grad, w.settings.segments_of(u), Optimizer::AllFrozen::hold_state);
  }

  async::Task<Result<void>> step(const OptimizerWiring& w, float lr) override {
    auto& compute = w.ctx().stream();
    COSHARD_CO_TRY(co_await exchange_grad_stats(w));
    // The units kept on the device step there, while the host steps the rest.
    if (w.host.device_optimizer) COSHARD_CO_TRY(w.host.device_optimizer->apply(w.ctx(), lr));
    if (w.mode.stepping_in_backward) {
      for (auto& u : w.units)
        if (!u->stepped_early) COSHARD_CO_TRY(w.optimizer.apply_one(*w.host.ctx, w.settings.first_group + u->index, lr));
      COSHARD_CO_TRY(w.optimizer.finish_step(*w.host.ctx));
    } else {
      COSHARD_CO_TRY(w.optimizer.apply(*w.host.ctx, lr));
    }
    COSHARD_CO_TRY_ASSIGN(auto stepped, w.host.stream->record());
    COSHARD_CO_TRY(co_await after(compute, stepped));
    for (auto& u : w.units) {
      if (u->info.frozen || !u->info.optimizer_offloaded) continue;  // never stepped, or stepped on the device
      // (bf16/f16: the optimizer wrote the pinned copy in the compute dtype)
      const Tensor& stepped_shard = w.narrow() ? u->host_param : u->host_master;
      if (u->shard.data() == stepped_shard.data()) continue;  // parameters offloaded: it is the shard
      COSHARD_CO_TRY(compute.copy(u->shard.data(), stepped_shard.data(), u->shard.bytes()));
      w.stats.swap_bytes += u->shard.bytes();
    }
    co_return Result<void>{};
  }

  async::Task<Result<void>> masters_from_shards(const OptimizerWiring& w) override {
    // (with cpu parameter offload the shard is the master, or its pinned bf16/f16 copy, already)
    const Tensor FetchUnit::*host = w.narrow() ? &FetchUnit::host_param : &FetchUnit::host_master;
    for (auto& u : w.units)
      if (!u->info.frozen && u->info.optimizer_offloaded && u->shard.data() != ((*u).*host).data())
        COSHARD_CO_TRY(w.ctx().stream().copy(((*u).*host).data(), u->shard.data(), u->shard.bytes()));
    // (the device part's masters from its shards, on the compute stream)
    if (w.host.device_optimizer) COSHARD_CO_TRY(w.host.device_optimizer->reset_masters(w.ctx()));
    COSHARD_CO_TRY_ASSIGN(auto copied, w.ctx().stream().record());
    COSHARD_CO_TRY(co_await after(*w.host.stream, copied));
    if (w.narrow()) {  // the fp32 masters from the bf16/f16 copies, on the host
      const auto& groups = w.optimizer.groups();
      for (const auto& u : w.units) {
        if (u->info.frozen || !u->info.optimizer_offloaded) continue;
        const auto& g = groups[w.settings.first_group + u->index];
        COSHARD_CO_TRY(w.host.ctx->kernels().cast(*w.host.stream, w.o.dtype, u->host_param.data(), DataType::f32,
                                                  g.master.data(), u->info.shard));
      }
      // What the compute stream does next (a checkpoint's load writes the copies and the masters)
      // comes after these reads and writes.
      COSHARD_CO_TRY_ASSIGN(auto widened, w.host.stream->record());
      COSHARD_CO_TRY(co_await after(w.ctx().stream(), widened));
    }
    co_return Result<void>{};
  }

  async::Task<Result<void>> visit(const OptimizerWiring& w, const Engine::ShardVisitor& use, bool) override {
    co_return co_await visit_optimizer_groups(w, use);
  }

  Result<void> step_in_backward(const OptimizerWiring& w, FetchUnit& u) override {
    return w.optimizer.apply_one(*w.host.ctx, w.settings.first_group + u.index, w.mode.lr);
  }
};

}  // namespace

std::unique_ptr<OptimizerPlacement> make_optimizer_on_host() { return std::make_unique<OptimizerOnHost>(); }

}  // namespace coshard::zero
