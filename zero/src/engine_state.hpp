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

namespace coshard::zero {
namespace detail {

using namespace modules;

using collectives::Coalesced;
using collectives::ReduceOp;

// nvme: one sub-group of the swap files, elements [begin, begin + count) of unit `unit`'s shard.
struct SwapPiece {
  std::size_t unit = 0;
  std::int64_t begin = 0, count = 0;
};

}  // namespace detail

struct Engine::State : GradientShardsOut {
  using FetchUnit = detail::FetchUnit;
  using Gather = detail::Gather;
  // The optimizer's groups of this engine hold memory of the engine's host context when the
  // optimizer is offloaded: they go first, with the host stream quiet, whether the engine ends
  // or its creation fails halfway (out of memory, say), or ~Optimizer later returns blocks to an
  // allocator that is gone (the segfault of a failed setup).
  ~State() {
    if (host_stream) (void)host_stream->synchronize();
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

  // Optimizer offload: a CPU stream and context the optimizer steps on, the pinned pool of its
  // shards, and device copies of the two small things the device needs from it.
  std::unique_ptr<async::Stream> host_stream;
  std::unique_ptr<async::CachingAllocator> host_allocator;
  std::unique_ptr<Context> host_ctx;
  std::shared_ptr<offload::PinnedPool> pinned;
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
  bool shards_leave_in_backward() const noexcept override { return grads_out_in_backward; }
  // What the parameter residence acts through (parameter_residence.hpp): at stage 3 it asks the
  // gather scheduler.
  ResidenceWiring residence_wiring() noexcept { return {io(), units, *shard_groups, timeline, stats, *gathers}; }
  // What the shard placement acts through (shard_placement.hpp).
  ShardWiring shard_wiring() noexcept {
    return {io(),    units,      gathers->trace(), stats,     *residence, residence_wiring(), swapped(),
            pinned,  store,      swap_files, host_stream.get(), static_cast<int>(o.offload_params.buffer_count), shard_values};
  }
  Result<void> shard_reduced(FetchUnit& u) override;
  // Collective launches so far, the shard groups' included.
  std::uint64_t launches() const noexcept { return comm->launches() + shard_groups->launches(); }
  // nvme: each unit's master and state, one sub-group file each, streamed by the swapper. The
  // rank's folder is claimed (locked against a second run) first and let go last.
  offload::SwapFolder swap_folder;
  std::shared_ptr<offload::NvmeStore> store;
  std::unique_ptr<offload::Swapper> swapper;
  // A unit's file holds its master, then each state tensor, each from a page boundary; a sub-group
  // (swap_pieces: sub_group_size elements at most) is one piece of each, read and written as one.
  std::vector<offload::SubGroup> subgroups;
  std::vector<detail::SwapPiece> swap_pieces;            // what each sub-group is
  std::vector<std::size_t> first_piece;            // unit k's sub-groups: [first_piece[k], first_piece[k + 1])
  std::vector<std::string> swap_files;             // unit k's file
  // The sub-groups a step reads, steps and writes back (frozen units' never are), and their
  // descriptions for its pass (grads_to_nvme: each with its gradient piece, read only).
  std::vector<std::size_t> stepped_pieces;
  std::vector<offload::SubGroup> stepped_subgroups;
  bool swapped() const noexcept { return o.offload_optimizer == OptimizerOffload::nvme; }
  // nvme with step_in_backward: no gradient shard in pinned memory. A unit's shard stays on the
  // device until the swapper's pass steps it: each sub-group's buffer has a gradient piece after
  // its master and state (never read from nor written to the file), copied from the device shard
  // just before the piece is stepped, its statistics added there; the shard goes after its last piece.
  bool grads_through_pass() const noexcept { return swapped() && o.step_in_backward; }
  // nvme with swap_gradients (and no step_in_backward): no gradient shard in pinned memory either.
  // A pass of the swapper beside backward (swap_step, fed through grads_ready like the one above)
  // writes each unit's shard into its swap file's gradient region as soon as the unit is handed
  // over, adding its statistics; the shard leaves the device after its last piece. The step's
  // pass then reads each sub-group's gradient piece (a read-only extent) with its master and state.
  bool grads_to_nvme() const noexcept { return swapped() && o.swap_gradients && !o.step_in_backward; }
  // Either way the device shard waits for a pass of the swapper (and backward for it, when the
  // shards pending would pass grads_pending_limit).
  bool grads_wait_for_a_pass() const noexcept { return grads_through_pass() || grads_to_nvme(); }
  // grads_to_nvme: per sub-group, the piece of its unit's gradient region the writing pass fills.
  std::vector<offload::SubGroup> grad_subgroups;
  // The sub-groups of a pass beside backward, in the order it expects their units to arrive:
  // last step's, or the units' reverse order at first (backward goes roughly that way). Trained
  // units only.
  std::vector<std::size_t> pieces_in_expected_order() const;
  // A piece of unit u's gradient shard from the device into `piece` (pinned, f32) on the
  // communication stream, after its reduction; the host stream after the copy, the piece's
  // statistics added there; the device shard given back after its last piece.
  Result<void> take_gradient_piece(FetchUnit& u, const detail::SwapPiece& p, const Tensor& piece);
  // Spawns the swapper's pass fed by grads_ready (swap_step): stepping each unit as it comes
  // (stepping_in_backward), or writing its gradient out (grads_to_nvme).
  Result<void> start_swap_pass(float lr);
  // Awaits the pass once every unit is handed over (its error, if any), and keeps the order the
  // units came in for the next step's.
  async::Task<Result<void>> finish_swap_pass();
  // grads_to_nvme: the pass that writes the gradient shards out (step_in_backward.cpp).
  async::Task<Result<void>> swap_gradients_out(async::Receiver<std::size_t> ready, async::Sender<char> ticks);
  Tensor device_loss_scale;  // f32[1]: the seed of backward
  Tensor device_grad_stats;  // f32[2]: summed across ranks on the communication stream
  // f32[2] in pinned memory: the stats go to the device and the sums come back through it. A copy
  // between the device and pageable memory waits for its stream: a hidden host wait.
  offload::PinnedBlock grad_stats_back;
  bool offloaded() const noexcept { return o.offload_optimizer != OptimizerOffload::none; }
  // offload_optimizer=cpu with a device_memory_budget (Twin-Flow): the units whose optimizer state
  // the budget keeps on the device (FetchUnitInfo::optimizer_offloaded false) step with this part
  // of the optimizer (Optimizer::empty_like), on the compute stream, their fp32 gradient shards
  // resident; the user's optimizer holds an empty frozen group in each one's place. Its step
  // state is the host's, copied in through `step_state_out` at each step's start; its gradient
  // statistics join the host's before the sum over ranks, and come back summed.
  std::unique_ptr<Optimizer> device_optimizer;
  // Offloaded: the host's step state on its way to the device at each step's start (pinned: the
  // loss scale that seeds backward, and the device part's state).
  offload::PinnedBlock step_state_out;
  // Where unit u's optimizer group is: the device part's for a unit stepped on the device.
  struct GroupRef {
    Optimizer& optimizer;
    std::size_t index;
  };
  GroupRef group_of(const FetchUnit& u) const noexcept {
    if (device_optimizer && !u.info.optimizer_offloaded && !u.info.frozen) return {*device_optimizer, u.device_group};
    return {*optimizer, first_group + u.index};
  }
  bool params_on_nvme() const noexcept { return o.offload_params == OffloadTarget::nvme; }
  // bf16/f16 parameters: the host step writes them from the fp32 masters (half the bytes to the
  // device); with the optimizer on nvme and the shards on the device, through `staging`, one unit
  // at a time (the swapper's passes hand out one sub-group at a time and await its use). With the
  // parameters on nvme a shard is its master rounded as it is read, and `staging` holds a unit's
  // rounded master while a checkpoint visits it.
  bool narrow() const noexcept { return o.dtype != DataType::f32; }
  bool staged() const noexcept {
    return swapped() && narrow() &&
           (params_on_nvme() || std::any_of(units.begin(), units.end(), [](const auto& u) { return !u->info.shard_offloaded; }));
  }
  offload::PinnedBlock staging;
  // The staging buffer as `count` elements of the compute dtype (a shard, or a piece of one).
  Tensor staging_for(std::int64_t count) const {
    return Tensor(staging.data(), Shape{count}, o.dtype, async::Device::cpu());
  }
  // nvme parameters: this rank's block of a unit for its swap file, made on the host by
  // initialize/load_parameters as masters_from_shards writes the file (there is no shard to copy
  // from), one unit at a time.
  ShardPlacement::BlockSource shard_values;
  // Optimizer offload at stages 2-3 with one micro-batch: each gradient shard goes out to pinned
  // memory on the communication stream right after its reduction, overlapped with the rest of
  // backward (with more micro-batches the shards are scaled after the last one first).
  bool grads_out_in_backward = false;
  // step_in_backward this step (one micro-batch): each unit is stepped on the host once its last
  // gradient shard is out, at `step_lr`.
  bool stepping_in_backward = false;
  float step_lr = 0.0f;
  // step_in_backward with the optimizer on nvme: a pass of the swapper runs beside forward and
  // backward (swap_step), reading each unit's sub-group ahead and stepping it once the unit is
  // handed over through grads_ready (its gradient shard out, its share of the statistics added).
  // It goes in the order the units came last step (backward_order), reverse unit order at first.
  std::optional<async::Sender<std::size_t>> grads_ready;
  async::JoinHandle<Result<void>> swap_step;
  std::vector<std::size_t> backward_order, handed_order;
  // With grads_through_pass the shards handed to the pass wait on the device until it steps
  // them: a unit's backward waits (wait_for_the_pass) while those pending would pass the two
  // largest units' shards, for the pass's next tick (a piece stepped, or an arrival awaited).
  // It never waits while the pass awaits an arrival (that could be this very unit).
  std::size_t grads_pending_bytes = 0, grads_pending_limit = 0;
  bool pass_awaits_arrival = false;
  std::optional<async::Receiver<char>> pass_ticks;
  async::Task<Result<void>> wait_for_the_pass(const FetchUnit& u);
  // A pass beside backward awaits unit k's arrival through `ready` (noting in `arrived` every unit
  // that comes meanwhile), telling a waiting backward through `ticks`; fails when `ready` closes
  // first (the step ended before the unit came).
  async::Task<Result<void>> await_arrival(std::size_t k, async::Receiver<std::size_t>& ready, std::vector<bool>& arrived,
                                          async::Sender<char>& ticks);
  Context& optimizer_ctx() const noexcept { return offloaded() ? *host_ctx : *ctx; }
  Tensor backward_seed() const { return offloaded() ? device_loss_scale : optimizer->loss_scale(); }

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
  // `later` runs after `event` of another stream: device-side when it can wait on it (a CPU
  // stream can wait on anything; a CUDA stream only on CUDA events), else the host awaits it.
  static async::Task<Result<void>> after(async::Stream& later, async::Event event) {
    if (later.device().is_cpu() || event.device().is_cuda()) co_return later.wait(event);
    co_return co_await event;
  }
  // The compute stream after everything the host stream has so far (the optimizer's casts into
  // its masters at build, a step's host work): before shards or masters are written outside a step.
  async::Task<Result<void>> compute_after_host();
  // `n` elements of `src` converted into `dst` on the host stream, awaited.
  async::Task<Result<void>> cast_on_host(DataType from, const void* src, DataType to, void* dst, std::int64_t n);

  // Stages 1-2: every rank's block of every unit into the full copies, after the blocks changed
  // outside a step (a load). Stage 3 keeps no full copies.
  async::Task<Result<void>> full_copies_from_shards();
  // nvme: sub-group i's piece of its unit's shard (params: the shard's piece, or the master on
  // nvme) with its master and state, as views of the swap buffer holding them.
  UnitShard swapped_shard(std::size_t i, std::span<std::byte> bytes) const;

  EngineStepStats stats;

  // The step's timeline, its waits of compute on communication, and adaptive prefetch's
  // measurements (step_timeline.hpp).
  detail::StepTimeline timeline;
  // Where each step's time went (StepTimeSplit), from counters read at the steps' ends.
  detail::StepClock step_clock;
  detail::StepClock::Sources clock_sources() const noexcept {
    return {&ctx->stream(), host_stream.get(), store.get()};
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

  // ---- trainable and frozen parameters, parameter groups, unused units (parameter_settings.cpp) ----

  // The optimizer's segments of this rank's block of u: each parameter's run with its settings
  // (frozen, or its parameter group's), clipped to the block.
  std::vector<Optimizer::Segment> segments_of(const FetchUnit& u) const;
  // Whether each parameter trains as it did when the engine was made: a change since is refused,
  // naming the parameter (the gradients, reductions and optimizer groups were planned for it).
  Result<void> check_trainability() const;
  std::vector<std::pair<const Parameter*, bool>> planned_trainable;
  // Before the optimizer steps: units that got no gradient this step on any rank are left
  // untouched, as PyTorch leaves a parameter whose gradient is None (stage 1 asks the other ranks).
  async::Task<Result<void>> skip_units_without_gradients();
  // Coalesced unit u: the elements of its modules whose flag in `used` (one a module) is 0 are left
  // untouched by the coming step (empty `used`: every module steps).
  Result<void> skip_unused_modules(FetchUnit& u, std::span<const double> used);
  Result<void> skip_modules_unused_here(FetchUnit& u);  // (step_in_backward.cpp)
  // After a step that counted (not skipped for a non-finite gradient): each parameter left out of
  // it missed one more step; the optimizer's groups are told where that changed anything.
  Result<void> count_steps_missed();
  // Every unit's runs of parameters that missed steps, to its optimizer group (after a load too).
  Result<void> set_steps_missed();
  // Before a step ends: no parameter's gradient was asked for without one bound (an undeclared
  // read of another module's parameter: Parameter::grad), else an error naming each.
  Result<void> check_no_gradient_missed() const;
  void clear_gradients_missed();
  const Tensor& values_of(const FetchUnit& u) const { return residence->values(u); }

  // ---- gradients: the reduction (gradient_reduction.hpp, gradients.cpp) ----

  // ---- stepping during backward (step_in_backward.cpp) ----

  // After a step_in_backward step whose optimizer report says it was skipped (the overflow flag
  // is summed over ranks, so every rank reads the same): the units stepped during backward
  // cannot be skipped any more, so the step fails, on every rank alike.
  Result<void> step_in_backward_saw_non_finite() const;

  // step_in_backward: the unit's last gradient shard of the step is on its way to pinned memory;
  // the host stream steps it once the copy has passed (its share of the norm and overflow flag
  // first, so that they are complete for the step's report).
  Result<void> step_on_host(FetchUnit& u);
  // nvme: the unit goes to the swapper's pass, which steps it when its sub-group is in. A pass
  // that failed (an I/O error) is gone: backward goes on regardless, so that the step fails
  // where stepping after backward would, with every rank's collectives launched alike, when the
  // pass is awaited (with its error).
  Result<void> hand_to_swap_step(FetchUnit& u);

  // ---- the optimizer step on NVMe (optimizer_on_nvme.cpp) ----

  // nvme: sub-group i (a piece of a unit's master and state, in `bytes`) stepped on the host
  // stream, and the new piece of the shard copied to the device on `to` (the buffer goes back to the swapper, to be written
  // and reused, only after that copy). nvme parameters: the master in the file is the shard.
  async::Task<Result<void>> step_swapped_piece(std::size_t i, std::span<std::byte> bytes, float lr, async::Stream& to);

  // step_in_backward with the optimizer on nvme: one pass of the swapper over every sub-group,
  // beside forward and backward. Each is read ahead (from the start of the step) and stepped
  // once its unit arrives through `ready`; its new shard goes to the device on the communication
  // stream, which has passed the unit's last backward (its reduction came after it). The
  // channel closing before a unit arrives (backward failed) ends the pass with an error.
  async::Task<Result<void>> swapped_step_in_backward(async::Receiver<std::size_t> ready, float lr,
                                                     async::Sender<char> ticks);


  // After the last micro-batch's backward: the gradient shards complete and scaled (gradients.cpp).
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
