// The optimizer step on this rank's shards: on the device, on the host stream with the state in
// pinned memory, or streamed in from NVMe sub-group by sub-group; the norm and overflow flag are
// summed over ranks first, and the updated shards go back to the device.
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

async::Task<Result<void>> Engine::State::step_swapped_unit(std::size_t k, std::span<std::byte> bytes, float lr, async::Stream& to) {
  Unit& u = *units[k];
  const UnitShard shard = swapped_shard(k, bytes);
  const Tensor& master = shard.master;
  // bf16/f16: cast down in the same pass, into the pinned shard itself (parameters offloaded to
  // cpu: nothing left to copy) or into the staging buffer on its way to the device.
  Tensor narrowed;
  if (narrow() && !params_on_nvme()) narrowed = params_offloaded() ? u.shard : staging_for(u);
  COSHARD_CO_TRY(optimizer->apply_group(*host_ctx, first_group + k, lr, master, shard.state1, shard.state2, narrowed));
  COSHARD_CO_TRY_ASSIGN(auto stepped, host_stream->record());
  if (params_on_nvme() || (narrowed && narrowed.data() == u.shard.data())) co_return co_await stepped;
  COSHARD_CO_TRY(co_await after(to, stepped));
  COSHARD_CO_TRY(to.copy(u.shard.data(), narrowed ? narrowed.data() : master.data(), u.shard.bytes()));
  if (!params_offloaded()) stats.swap_bytes += u.shard.bytes();
  COSHARD_CO_TRY_ASSIGN(auto copied, to.record());
  co_return co_await copied;
}

async::Task<Result<void>> Engine::State::step_optimizer(float lr) {
  auto& compute = ctx->stream();
  auto& cs = comm->stream();
  // The optimizer: local shards only; the norm and overflow flag are summed over ranks first.
  if (!offloaded()) {
    COSHARD_CO_TRY(optimizer->compute_grad_stats(*ctx));
    COSHARD_CO_TRY(order(compute, cs));
    const Tensor grad_stats = optimizer->grad_stats();
    COSHARD_CO_TRY(comm->all_reduce(grad_stats.data(), grad_stats.data(), 2, DataType::f32, ReduceOp::sum));
    COSHARD_CO_TRY(compute_waits_for_comm(kGradStats));
    COSHARD_CO_TRY(optimizer->apply(*ctx, lr));
  } else {
    // Offloaded: gradient shards out to pinned memory, the step on the CPU stream (the same
    // kernels and order as on a CPU device), the updated shards back.
    auto& host = *host_stream;
    for (auto& u : units) {
      if (u->grads_out) continue;  // out during backward (the compute stream has waited for it)
      COSHARD_CO_TRY(compute.copy(u->host_grad.data(), u->grad_shard.data(), u->grad_shard.bytes()));
      stats.swap_bytes += u->grad_shard.bytes();
    }
    COSHARD_CO_TRY_ASSIGN(auto grads_out, compute.record());
    COSHARD_CO_TRY(host.wait(grads_out));
    if (stepping_in_backward) {  // the units not stepped yet add their share
      for (auto& u : units) {
        if (u->stepped_early) continue;
        COSHARD_CO_TRY(optimizer->add_grad_stats(*host_ctx, first_group + u->index));
        if (swapped()) COSHARD_CO_TRY(hand_to_swap_step(*u));  // stepped by the swapper's pass
      }
      grads_ready.reset();  // every unit is handed over
    } else {
      COSHARD_CO_TRY(optimizer->compute_grad_stats(*host_ctx));
    }
    COSHARD_CO_TRY_ASSIGN(auto stats_ready, host.record());
    COSHARD_CO_TRY(co_await after(compute, stats_ready));
    const Tensor host_stats = optimizer->grad_stats();
    COSHARD_CO_TRY(compute.copy(device_grad_stats.data(), host_stats.data(), host_stats.bytes()));
    COSHARD_CO_TRY(order(compute, cs));
    COSHARD_CO_TRY(comm->all_reduce(device_grad_stats.data(), device_grad_stats.data(), 2, DataType::f32,
                                      ReduceOp::sum));
    COSHARD_CO_TRY(compute_waits_for_comm(kGradStats));
    COSHARD_CO_TRY(compute.copy(grad_stats_back.data(), device_grad_stats.data(), host_stats.bytes()));
    COSHARD_CO_TRY_ASSIGN(auto stats_back, compute.record());
    COSHARD_CO_TRY(host.wait(stats_back));
    COSHARD_CO_TRY(host.copy(host_stats.data(), grad_stats_back.data(), host_stats.bytes()));
    if (!swapped()) {
      if (stepping_in_backward) {
        for (auto& u : units)
          if (!u->stepped_early) COSHARD_CO_TRY(optimizer->apply_one(*host_ctx, first_group + u->index, lr));
        COSHARD_CO_TRY(optimizer->finish_step(*host_ctx));
      } else {
        COSHARD_CO_TRY(optimizer->apply(*host_ctx, lr));
      }
      COSHARD_CO_TRY_ASSIGN(auto stepped, host.record());
      COSHARD_CO_TRY(co_await after(compute, stepped));
      for (auto& u : units) {
        // (bf16/f16: the optimizer wrote the pinned copy in the compute dtype)
        const Tensor& stepped_shard = narrow() ? u->host_param : u->host_master;
        if (u->shard.data() == stepped_shard.data()) continue;  // parameters offloaded: it is the shard
        COSHARD_CO_TRY(compute.copy(u->shard.data(), stepped_shard.data(), u->shard.bytes()));
        stats.swap_bytes += u->shard.bytes();
      }
    } else if (stepping_in_backward) {
      // The swapper's pass has every unit now; its last copies to the device are on the
      // communication stream, which the compute stream waits for below.
      auto handle = std::move(swap_step);
      COSHARD_CO_TRY(co_await handle);
      backward_order = handed_order;
      COSHARD_CO_TRY(optimizer->finish_step(*host_ctx));
      COSHARD_CO_TRY_ASSIGN(auto finished, host.record());
      COSHARD_CO_TRY(co_await after(compute, finished));
      COSHARD_CO_TRY(order(cs, compute));
    } else {
      // Each unit's master and state come in from NVMe (read ahead), are stepped on the host,
      // the new shard goes to the device, and the sub-group goes back (written behind).
      const auto read_before = swapper->stats().bytes_read, written_before = swapper->stats().bytes_written;
      auto step_unit = [&](std::size_t k, std::span<std::byte> bytes) -> async::Task<Result<void>> {
        return step_swapped_unit(k, bytes, lr, compute);
      };
      COSHARD_CO_TRY(co_await swapper->for_each(subgroups, step_unit, true));
      COSHARD_CO_TRY(optimizer->finish_step(*host_ctx));
      COSHARD_CO_TRY_ASSIGN(auto finished, host.record());
      COSHARD_CO_TRY(co_await after(compute, finished));
      stats.swap_bytes += (swapper->stats().bytes_read - read_before) + (swapper->stats().bytes_written - written_before);
    }
  }
  co_return Result<void>{};
}

}  // namespace coshard::zero
