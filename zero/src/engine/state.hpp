// The engine's state: wiring. The fetch units, the strategies chosen once when the engine is made
// (where shards and optimizer state live, how gradients are reduced, where whole parameters
// reside), the components they act through, and the loop's and the step's clock. Each strategy
// gets a narrow wiring (a few references, made where it is used), never this struct; the files
// that include it are the engine's own jobs: create, the hooks, the loop and its passes, the shard
// surface, checkpoints and exports (engine.hpp has the rules of the whole). Private: not installed.
#pragma once

#include <unordered_map>
#include <unordered_set>

#include "checkpoint/files.hpp"
#include "coshard/async/log.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/zero/engine.hpp"
#include "engine/loop_state.hpp"
#include "fetch_unit.hpp"
#include "gradient_reduction.hpp"
#include "module_units.hpp"
#include "parameter_residence.hpp"
#include "parameter_settings.hpp"
#include "placement/host_side.hpp"
#include "placement/optimizer_placement.hpp"
#include "placement/shard_placement.hpp"
#include "placement/step_in_backward.hpp"
#include "placement/swap_files.hpp"
#include "plan/fetch_units.hpp"
#include "rank_exchange.hpp"
#include "schedule/gather_scheduler.hpp"
#include "schedule/step_clock.hpp"
#include "shard_groups.hpp"
#include "step_timeline.hpp"
#include "stream_order.hpp"

namespace coshard::zero {
namespace detail {
using namespace modules;
using collectives::ReduceOp;
}  // namespace detail

struct Engine::State : GradientShardsOut {
  using FetchUnit = detail::FetchUnit;
  using Gather = detail::Gather;
  using Open = detail::LoopState::Open;
  // The optimizer's groups made on the host context go first, with the host stream quiet, whether
  // the engine ends or its creation fails halfway: else ~Optimizer later returns blocks to an
  // allocator that is gone (the segfault of a failed setup).
  // Work queued on the compute stream may still write the host side's memory (a checkpoint's load
  // into the offloaded optimizer's state, when a refused resume ends the run at once: a write after
  // free under ASan): it passes first.
  ~State() {
    if (host.stream && ctx != nullptr) (void)ctx->stream().synchronize();
    if (host.stream) (void)host.stream->synchronize();
    if (optimizer) optimizer->drop_groups_from(first_group);
  }

  // ---- what the engine was made over, and its units (create.cpp) ----
  Context* ctx = nullptr;
  collectives::Communicator* comm = nullptr;
  Module* model = nullptr;
  Optimizer* optimizer = nullptr;
  EngineOptions o;
  int rank = 0, world = 1;
  std::size_t element_size = 4;
  std::vector<std::unique_ptr<FetchUnit>> units;
  std::size_t largest_unit_bytes = 0;
  std::size_t first_group = 0;  // the optimizer's group of unit i is first_group + i
  std::unordered_map<const Parameter*, std::string> names;
  std::vector<std::pair<const Parameter*, bool>> planned_trainable;  // as each parameter trained then
  detail::ModuleUnits module_units;  // modules to their units (module_units.hpp)
  // Engine::create's steps, in its order: the planned units taken over (with their modules'
  // places), the units other modules declared they read, the strategies chosen, and each unit's
  // storage from them.
  void adopt_units(detail::FetchPlan plan);
  Result<void> note_borrowed_units();
  void mark_routed_units();
  Result<void> choose_strategies(std::span<const FetchUnitInfo> infos);
  Result<void> give_units_storage();

  // ---- the strategies, chosen once, and what they act through ----
  std::unique_ptr<OptimizerPlacement> optimizer_placement;  // device, pinned host memory, NVMe
  std::unique_ptr<ShardPlacement> shard_placement;          // device, pinned host memory, NVMe
  std::unique_ptr<GradientReduction> reduction;             // by stage
  std::unique_ptr<ParameterResidence> residence;            // unsharded, gathered after steps, or on use
  std::unique_ptr<detail::ShardGroups> shard_groups;        // hybrid sharding's communicators
  // The gradient norm's sum of squares is summed over the ranks (each unit counted on its copy 0):
  // sharded, or with expert-parallel units (other ranks hold other experts, at stage 0 too).
  // Decided once at create (give_units_storage).
  bool norm_summed_over_ranks = false;
  std::unique_ptr<detail::GatherScheduler> gathers;         // stage 3: fetch, prefetch, release
  detail::HostSide host;  // an offloaded optimizer's stream, context and pinned memory
  detail::SwapFiles swap;  // its swap files on nvme
  detail::SwapPass pass;   // the swapper's pass beside backward
  ShardPlacement::BlockSource shard_values;  // nvme parameters: the values a load writes
  detail::RankExchange ranks_agree;          // outcomes agreed, values reduced over the ranks
  detail::RankExchange tensor_agree;         // the same over the tensor ranks (tensor parallelism; unset: none)
  // Each parameter by its full name (the inverse of `names`).
  std::unordered_map<std::string, const Parameter*> by_name() const {
    std::unordered_map<std::string, const Parameter*> out;
    for (const auto& [p, name] : names) out.emplace(name, p);
    return out;
  }

  detail::UnitIo io() const noexcept { return {*ctx, *comm, o.dtype}; }
  GradientWiring gradient_wiring() noexcept { return {io(), units, *shard_groups, timeline, stats, *residence, *this}; }
  ResidenceWiring residence_wiring() noexcept { return {io(), units, *shard_groups, timeline, stats, *gathers}; }
  ShardWiring shard_wiring() noexcept {
    return {io(),        units,      gathers->trace(), stats,     *residence, residence_wiring(), o.offload_optimizer == OptimizerOffload::nvme,
            host.pinned, swap.store, swap.files, host.stream.get(), static_cast<int>(o.offload_params.buffer_count), shard_values};
  }
  OptimizerWiring optimizer_wiring() noexcept {
    return {io(),       units,      *optimizer, settings(), o,    rank,         world,
            stats,      timeline,   *reduction, *residence, host, swap,         pass,
            mode,       shard_values, norm_summed_over_ranks};
  }
  detail::ParameterSettings settings() const noexcept {
    return {units, names, *optimizer, first_group, host.device_optimizer.get(), planned_trainable};
  }
  // GradientShardsOut: an offloaded unit's gradient shard during backward (step_in_backward.hpp).
  bool shards_leave_in_backward() const noexcept override { return mode.grads_out_in_backward; }
  Result<void> shard_reduced(FetchUnit& u) override {
    return detail::shard_reduced(optimizer_wiring(), *optimizer_placement, u);
  }
  bool offloaded() const noexcept { return o.offload_optimizer != OptimizerOffload::none; }

  // ---- the hooks (hooks.cpp): units acquired and given back as their modules run ----
  FetchUnit* unit_for(const Module& m) {
    const std::size_t* i = module_units.unit_index(m);
    return i ? units[*i].get() : nullptr;
  }
  bool owns(const Module& m) const { return &m == model || module_units.unit_index(m); }
  // The coalesced unit open in forward: its last module to run is unknown until another unit's
  // module starts, or the pass ends.
  FetchUnit* open_forward = nullptr;
  Result<void> close_open_forward(Context& ctx);
  Result<void> finish_forward(Context& ctx, FetchUnit& u);  // its span; the residence's after_use
  void reset_coalesced(bool new_step);  // a new pass (and step): no coalesced unit open or used
  void new_coalesced_pass();            // the model's forward or backward starts

  // ---- the loop and its passes (loop.cpp) ----
  detail::LoopState loop;
  StepMode mode;  // what this step does (begin_step decides it)
  std::int64_t steps_done = 0;
  bool has_values = false;  // initialize, load_parameters or a checkpoint gave the shards values
  Result<void> outside_loop(std::string_view what) const { return loop.outside(what); }
  // After the last micro-batch's backward: the gradient shards complete and scaled.
  async::Task<Result<void>> finish_gradients(std::size_t micro_batches);
  void begin_pass(std::string_view name);  // its trace chosen
  Result<void> end_pass();                 // its trace recorded
  // The ranks average their measurements (one small all-reduce at a pass's end), so every rank
  // makes the same prefetch decisions and issues its collectives in the same order.
  async::Task<Result<void>> agree_on_measurements();

  // ---- the step's clock: counters, timeline, where the time went (loop.cpp) ----
  EngineStepStats stats;
  detail::StepTimeline timeline;
  detail::StepClock step_clock;

  // ---- the shard surface (shards.cpp), checkpoints (engine/checkpoint_*.cpp) and exports ----
  // Stages 1-2: the full copies after the blocks changed outside a step (a load).
  async::Task<Result<void>> full_copies_from_shards();
  // Whole values by name for load_parameters: a missing, extra, repeated or reshaped name refused.
  Result<void> check_values(const std::vector<GatheredParameter>& values) const;
  // The whole values of the parameters `wanted` names (unpadded, on every rank: one all-gather per
  // unit that holds one of them at stage 3, in unit order on every rank).
  async::Task<Result<std::vector<GatheredParameter>>> gather_values(std::function<bool(const Parameter&)> wanted);
  // The parameters of the model's LoRA adapters: a base file has no value for them, so a load
  // keeps theirs (initialize's, or a PEFT folder's) where it gives none.
  std::unordered_set<const Parameter*> adapter_parameters() const;
  detail::CheckpointState checkpoint;
  // Rank 0, before a save into `dir`: the folder claimed for this run, and no published checkpoint
  // of another run about to be replaced (the same step's, or the one `latest` names).
  Result<void> claim_checkpoint_folder(const std::filesystem::path& dir, const CheckpointOptions& options);
  async::Task<Result<void>> publish_checkpoint();  // the pending save (every rank at the same point)
};

}  // namespace coshard::zero
