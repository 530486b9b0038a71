// The host side of an offloaded optimizer (offload_optimizer cpu or nvme): the CPU stream and
// context the optimizer steps on, the pinned pool of its buffers, and the few device and pinned
// buffers a step exchanges with the device. The host placements make it in their setup
// (optimizer_on_host.cpp); the shard placements and checkpoints borrow its pool and stream.
// Empty without offload. Private: not installed.
#pragma once

#include <memory>

#include "coshard/async/stream.hpp"
#include "coshard/modules/module.hpp"
#include "coshard/modules/optimizer.hpp"
#include "coshard/offload/pinned_pool.hpp"
#include "kernels/kernels.hpp"
#include "stream_order.hpp"

namespace coshard::zero::detail {

struct HostSide {
  std::unique_ptr<async::Stream> stream;
  std::unique_ptr<async::CachingAllocator> allocator;
  std::unique_ptr<modules::Context> ctx;
  std::shared_ptr<offload::PinnedPool> pinned;
  // offload_optimizer=cpu with a device_memory_budget (Twin-Flow): the units whose optimizer state
  // the budget keeps on the device (FetchUnitInfo::optimizer_offloaded false) step with this part
  // of the optimizer (Optimizer::empty_like), on the compute stream, their fp32 gradient shards
  // resident; the user's optimizer holds an empty frozen group in each one's place. Its step
  // state is the host's, copied in through `step_state_out` at each step's start; its gradient
  // statistics join the host's before the sum over ranks, and come back summed.
  std::unique_ptr<modules::Optimizer> device_optimizer;
  // The host's step state on its way to the device at each step's start (pinned: the loss scale
  // that seeds backward, and the device part's state).
  offload::PinnedBlock step_state_out;
  modules::Tensor device_loss_scale;  // f32[1]: the seed of backward
  modules::Tensor device_grad_stats;  // f32[2]: summed across ranks on the communication stream
  // f32[2] in pinned memory: the stats go to the device and the sums come back through it. A copy
  // between the device and pageable memory waits for its stream: a hidden host wait.
  offload::PinnedBlock grad_stats_back;
  // bf16/f16 with the optimizer on nvme (shards_staged): the host step writes the parameters from
  // the fp32 masters through this buffer, one unit at a time (the swapper's passes hand out one
  // sub-group at a time and await its use); with the parameters on nvme it holds a unit's rounded
  // master while a checkpoint visits it.
  offload::PinnedBlock staging;

  bool offloaded() const noexcept { return stream != nullptr; }
  // The staging buffer as `count` elements of `dtype` (a shard, or a piece of one).
  modules::Tensor staging_for(std::int64_t count, modules::DataType dtype) const {
    return modules::Tensor(staging.data(), modules::Shape{count}, dtype, async::Device::cpu());
  }
  // `n` elements of `src` converted into `dst` on the host stream, awaited.
  async::Task<Result<void>> cast(modules::DataType from, const void* src, modules::DataType to, void* dst,
                                 std::int64_t n) const {
    COSHARD_CO_TRY(ctx->kernels().cast(*stream, from, src, to, dst, n));
    COSHARD_CO_TRY_ASSIGN(auto cast, stream->record());
    co_return co_await cast;
  }
  // `compute` after everything the host stream has so far (the optimizer's casts into its masters
  // at build, a step's host work): before shards or masters are written outside a step. Nothing
  // to wait for without offload.
  async::Task<Result<void>> compute_after(async::Stream& compute) const {
    if (!stream) co_return Result<void>{};
    COSHARD_CO_TRY_ASSIGN(auto done, stream->record());
    co_return co_await after(compute, done);
  }
};

}  // namespace coshard::zero::detail
