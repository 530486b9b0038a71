// The engine's state, shared by the files of zero/src that each do one of its jobs (engine.hpp has
// the rules of the whole; each file its own at its top). Private: not installed.
#pragma once

#include <algorithm>
#include <deque>
#include <map>
#include <unordered_map>

#include "coshard/async/channel.hpp"
#include "coshard/async/join_handle.hpp"
#include "coshard/async/log.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/stream_budget.hpp"
#include "coshard/offload/pinned_pool.hpp"
#include "coshard/offload/swap_folder.hpp"
#include "coshard/offload/swapper.hpp"
#include "coshard/zero/engine.hpp"
#include "checkpoint_files.hpp"
#include "kernels/half_convert.hpp"
#include "kernels/kernels.hpp"
#include "optimizer_placement.hpp"
#include "shard_placement.hpp"
#include "gradient_reduction.hpp"
#include "parameter_residence.hpp"
#include "shard_groups.hpp"
#include "step_clock.hpp"
#include "step_timeline.hpp"
#include "stream_order.hpp"
#include "gather_scheduler.hpp"
#include "rank_exchange.hpp"
#include "fetch_unit.hpp"
#include "host_side.hpp"
#include "parameter_settings.hpp"
#include "step_in_backward.hpp"
#include "swap_files.hpp"

namespace coshard::zero {
namespace detail {

using namespace modules;

using collectives::Coalesced;
using collectives::ReduceOp;

}  // namespace detail

struct Engine::State : GradientShardsOut {
  using FetchUnit = detail::FetchUnit;
  using Gather = detail::Gather;
  // The optimizer's groups of this engine hold memory of the engine's host context when the
  // optimizer is offloaded: they go first, with the host stream quiet, whether the engine ends
  // or its creation fails halfway (out of memory, say), or ~Optimizer later returns blocks to an
  // allocator that is gone (the segfault of a failed setup).
  ~State() {
    if (host.stream) (void)host.stream->synchronize();
    if (optimizer) optimizer->drop_groups_from(first_group);
  }
  Context* ctx = nullptr;
  collectives::Communicator* comm = nullptr;
  Module* model = nullptr;
  Optimizer* optimizer = nullptr;
  EngineOptions o;
  int rank = 0, world = 1;
  std::size_t element_size = 4;
  std::vector<std::unique_ptr<FetchUnit>> units;
  std::unordered_map<const Module*, std::size_t> unit_of;
  // A coalesced unit's modules: where each is in its unit's modules (FetchUnit::module_runs).
  std::unordered_map<const Module*, std::size_t> position_in_unit;
  // The coalesced unit open in forward (its last module to run unknown until another unit's
  // module starts, or the pass ends): closed by close_open_forward (hooks.cpp).
  FetchUnit* open_forward = nullptr;
  Result<void> close_open_forward(Context& ctx);
  // A unit's forward use is done: its timeline span, and the residence's after_use (stage 3: released).
  Result<void> finish_forward(Context& ctx, FetchUnit& u);
  // A new pass: no coalesced unit open, none of their modules used yet (and, for a step, none used).
  void reset_coalesced(bool new_step);
  // The model's forward or backward starts: no coalesced unit has opened in it yet.
  void new_coalesced_pass();
  // Units of other modules a module declared it uses (Module::use_parameters_of): fetched, and
  // their gradient taken and reduced, around it as if their owner ran.
  std::unordered_map<const Module*, std::vector<std::size_t>> borrowed_units;
  std::unordered_map<const Parameter*, std::string> names;
  std::size_t largest_unit_bytes = 0;
  std::size_t first_group = 0;  // the optimizer's group of unit i is first_group + i
  // Stage 3's gathers: fetch, prefetch along the trace, release, keep (gather_scheduler.hpp).
  std::unique_ptr<detail::GatherScheduler> gathers;

  // Where the optimizer's state lives and steps (device, pinned host memory, NVMe), chosen once.
  std::unique_ptr<OptimizerPlacement> optimizer_placement;
  // Where this rank's parameter shards live (device, pinned host memory, NVMe), chosen once.
  std::unique_ptr<ShardPlacement> shard_placement;
  // How gradients are reduced over the ranks (by stage; chosen once in create).
  std::unique_ptr<GradientReduction> reduction;
  // Where whole parameters reside: unsharded, whole and gathered after steps, or gathered on use.
  std::unique_ptr<ParameterResidence> residence;
  // The communicators of the units' shard groups and copies (hybrid sharding; the world's own
  // when every unit is sharded over the whole world).
  std::unique_ptr<detail::ShardGroups> shard_groups;
  // What the units' operations act through (fetch_unit.hpp).
  detail::UnitIo io() const noexcept { return {*ctx, *comm, o.dtype}; }
  // What the gradient reduction acts through (gradient_reduction.hpp), and its GradientShardsOut:
  // where an offloaded unit's shard goes during backward (step_in_backward.cpp).
  GradientWiring gradient_wiring() noexcept { return {io(), units, *shard_groups, timeline, stats, *residence, *this}; }
  bool shards_leave_in_backward() const noexcept override { return mode.grads_out_in_backward; }
  // What the parameter residence acts through (parameter_residence.hpp): at stage 3 it asks the
  // gather scheduler.
  ResidenceWiring residence_wiring() noexcept { return {io(), units, *shard_groups, timeline, stats, *gathers}; }
  // What the shard placement acts through (shard_placement.hpp).
  ShardWiring shard_wiring() noexcept {
    return {io(),        units,      gathers->trace(), stats,     *residence, residence_wiring(), offloaded_to_nvme(),
            host.pinned, swap.store, swap.files, host.stream.get(), static_cast<int>(o.offload_params.buffer_count), shard_values};
  }
  Result<void> shard_reduced(FetchUnit& u) override {
    return detail::shard_reduced(optimizer_wiring(), *optimizer_placement, u);
  }
  // Collective launches so far, the shard groups' included.
  std::uint64_t launches() const noexcept { return comm->launches() + shard_groups->launches(); }
  // The offloaded optimizer's host side (host_side.hpp), its swap files on nvme (swap_files.hpp),
  // and the pass of the swapper beside backward (step_in_backward.hpp).
  detail::HostSide host;
  detail::SwapFiles swap;
  detail::SwapPass pass;
  bool offloaded() const noexcept { return o.offload_optimizer != OptimizerOffload::none; }
  bool offloaded_to_nvme() const noexcept { return o.offload_optimizer == OptimizerOffload::nvme; }
  // nvme parameters: the values a load or initialisation writes into the swap files (OptimizerWiring).
  ShardPlacement::BlockSource shard_values;
  // What this step does (begin_step decides it).
  StepMode mode;
  // What the optimizer placement acts through (optimizer_placement.hpp).
  OptimizerWiring optimizer_wiring() noexcept {
    return {io(),       units,      *optimizer, settings(), o,    rank, world, stats, timeline, *reduction,
            *residence, host,       swap,       pass,       mode, shard_values};
  }
  // Each unit's parameters' settings and optimizer groups (parameter_settings.hpp).
  detail::ParameterSettings settings() const noexcept {
    return {units, names, *optimizer, first_group, host.device_optimizer.get(), planned_trainable};
  }
  std::vector<std::pair<const Parameter*, bool>> planned_trainable;
  Context& optimizer_ctx() const noexcept { return host.offloaded() ? *host.ctx : *ctx; }
  Tensor backward_seed() const { return host.offloaded() ? host.device_loss_scale : optimizer->loss_scale(); }

  // The loop's place: between begin_step and finish_step, between begin_inference and
  // end_inference, or neither (then the engine's modules may not run).
  enum class Open : std::uint8_t { none, step, inference };
  Open open = Open::none;
  int declared_micro_batches = 0;  // begin_step's
  int model_forwards = 0, model_backwards = 0;  // of the whole model, this step
  Tensor loss_sum;                 // f32[1]: add_loss's sum
  int losses_added = 0;
  std::uint64_t launches_before = 0;
  bool owns(const Module& m) const { return &m == model || unit_of.contains(&m); }
  // `what` (a checkpoint, an export, a load) only between steps: an error names the open one.
  Result<void> outside_loop(std::string_view what) const;
  std::int64_t steps_done = 0;
  // Values were given (initialize, load_parameters, a checkpoint): before that the shards, and
  // with nvme offload the swap files, hold nothing a checkpoint load could visit.
  bool has_values = false;
  // Stages 1-2: every rank's block of every unit into the full copies, after the blocks changed
  // outside a step (a load). Stage 3 keeps no full copies.
  async::Task<Result<void>> full_copies_from_shards();
  EngineStepStats stats;

  // The step's timeline, its waits of compute on communication, and adaptive prefetch's
  // measurements (step_timeline.hpp).
  detail::StepTimeline timeline;
  // Where each step's time went (StepTimeSplit), from counters read at the steps' ends.
  detail::StepClock step_clock;
  detail::StepClock::Sources clock_sources() const noexcept {
    return {&ctx->stream(), host.stream.get(), swap.store.get()};
  }
  // The ranks average their measurements (one small all-reduce at the end of a pass), so every
  // rank makes the same prefetch decisions and issues its collectives in the same order.
  async::Task<Result<void>> agree_on_measurements();
  // The compute stream waits for `event` (of the communication stream), timed with the timeline.
  Result<void> compute_waits(const async::Event& event, const std::string& what) {
    return timeline.wait(ctx->stream(), event, what);
  }
  Result<void> compute_waits_for_comm(const std::string& what) {
    COSHARD_TRY_ASSIGN(auto ev, comm->stream().record());
    return compute_waits(ev, what);
  }
  // After the pass's last event has passed: the waits' total, the timeline, the measurements.
  void collect_timing() { timeline.collect(stats, gathers->trace().phase(), gathers->trace().recorded()); }

  const std::vector<std::size_t>* borrowed_of(const Module& m) const {
    if (borrowed_units.empty()) return nullptr;
    auto it = borrowed_units.find(&m);
    return it == borrowed_units.end() ? nullptr : &it->second;
  }
  FetchUnit* unit_for(const Module& m) {
    auto it = unit_of.find(&m);
    return it == unit_of.end() ? nullptr : units[it->second].get();
  }

  // After the last micro-batch's backward: the gradient shards complete and scaled (loop.cpp).
  async::Task<Result<void>> finish_gradients(std::size_t micro_batches);

  // ---- a pass (prefetch.cpp): its trace chosen at the start, recorded at the end ----

  void begin_pass(std::string_view name);
  Result<void> end_pass();

  // ---- checkpoints (checkpoint_save.cpp, checkpoint_load.cpp; export.cpp) ----

  detail::CheckpointState checkpoint;
  // Small exchanges between the ranks: outcomes agreed, values reduced (rank_exchange.hpp).
  detail::RankExchange ranks_agree;
  // Rank 0, before a save into `dir`: the folder claimed for this run (a FolderLock shared within
  // the process), and no published checkpoint of another run about to be replaced (the same
  // step's, or the one `latest` names, saved with another run identity).
  Result<void> claim_checkpoint_folder(const std::filesystem::path& dir, const CheckpointOptions& options);
  // Publishes the pending save (every rank calls it at the same point).
  async::Task<Result<void>> publish_checkpoint();
  // Whole values by name for load_parameters: a missing, extra, repeated or reshaped name refused (shards.cpp).
  Result<void> check_values(const std::vector<GatheredParameter>& values) const;

};

}  // namespace coshard::zero
