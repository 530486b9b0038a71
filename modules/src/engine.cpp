#include "coshard/modules/engine.hpp"

#include <algorithm>
#include <deque>
#include <unordered_map>

#include "coshard/async/channel.hpp"
#include "coshard/async/join_handle.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/modules/memory_estimate.hpp"
#include "coshard/offload/swap_folder.hpp"
#include "coshard/offload/pinned_pool.hpp"
#include "coshard/offload/swapper.hpp"
#include "engine_plan.hpp"
#include "kernels.hpp"
#include "half_convert.hpp"

namespace coshard::modules {

namespace {

// Names of the step's phases in the timeline (spans keep pointers to their names).
const std::string kAllUnits = "all units";
const std::string kGradients = "gradients";
const std::string kGradStats = "gradient norm";
const std::string kOptimizer = "optimizer";
const std::string kParameters = "parameters";

using collectives::Coalesced;
using collectives::ReduceOp;

enum class Gather : std::uint8_t { released, in_flight, ready };

// A budget handed back in stream order: the max_live_bytes budget (released units' bytes come
// back once the compute stream has passed their last use) and the nvme parameter read slots
// (each comes back once the gather that copied out of its buffer has passed). Shared with the
// tasks that drain it (they may outlive a step, and the engine; never the engine's runtime).
struct Budget {
  explicit Budget(std::size_t capacity) : semaphore(capacity) {}
  async::Semaphore semaphore;
  std::size_t live_bytes = 0;  // touched on the reactor thread only
  // Returns whose last use has not been seen to complete, oldest first (the events of one stream
  // complete in order), and whether a task is draining them.
  struct Return {
    async::Event done;
    async::Semaphore::Permit permit;
    std::size_t bytes;
  };
  std::deque<Return> returns;
  bool draining = false;
};

struct Unit {
  FetchUnitInfo info;
  std::vector<Module*> modules;  // forward order
  struct Param {
    Parameter* parameter;
    std::int64_t offset;  // elements into the unit's buffer
  };
  std::vector<Param> params;
  std::size_t index = 0;  // in the engine's unit list

  // Persistent storage. Stage 3: `shard` is its own buffer. Stages 1-2: `full` holds the whole
  // unit and `shard` is this rank's block of it (in-place all-gather after the step).
  async::Block shard_block, full_block, grad_shard_block;
  Tensor shard, full, grad_shard;
  // Gradients of the whole unit: persistent at stage 1 (grad_shard is a view into it), one
  // buffer per backward pass at stages 2-3.
  async::Block grad_full_block;
  Tensor grad_full;
  int grads_this_step = 0;  // backward passes reduced into grad_shard this step
  bool grads_out = false;   // optimizer offload: copied to host_grad during backward this step
  int forward_uses = 0;     // forward passes this step (as many backward passes will come)
  bool stepped_early = false;  // step_in_backward: stepped on the host during backward

  // Optimizer offload: this rank's fp32 master and gradient shard in pinned host memory.
  offload::PinnedBlock host_master_block, host_grad_block;
  Tensor host_master, host_grad;
  // The pinned shard in the compute dtype the host step writes: with the optimizer on nvme and
  // the parameters offloaded to cpu (it is the shard), or with the optimizer on cpu and a bf16/f16
  // dtype (the optimizer group's parameters, cast down from its fp32 master; the shard too when
  // the parameters are offloaded, else copied to it).
  offload::PinnedBlock host_param_block;
  Tensor host_param;
  // nvme parameters: the read of the shard from its swap file (started ahead along the trace),
  // its buffer once read, and the read slot both hold until the gather that copies out of it.
  async::JoinHandle<Result<offload::PinnedBlock>> read;
  offload::PinnedBlock read_block;
  async::Semaphore::Permit read_slot;

  // Stage 3 gather state.
  Gather gather = Gather::released;
  async::Block gathered_block;
  Tensor gathered;
  async::Event gathered_event;
  std::optional<async::Semaphore::Permit> permit;
  bool prefetched = false;  // gathered ahead of use, not yet fetched
  async::Event compute_start;  // timeline: where this unit's current pass began on the compute stream
  std::size_t fetch_pos = 0;   // stage 3: the position of its latest fetch in the pass's order
};

// Hands bytes back to the budget as their release events complete: one task per burst of
// releases (not one per release), awaiting the oldest event and then taking every completed one.
async::Task<void> drain_returns(std::shared_ptr<Budget> budget) {
  while (!budget->returns.empty()) {
    auto& front = budget->returns.front();
    if (!front.done.ready()) {
      async::Event done = front.done;
      (void)co_await done;  // an error here is the stream's, reported where the stream is awaited
      continue;
    }
    budget->live_bytes -= front.bytes;
    front.permit.release();
    budget->returns.pop_front();
  }
  budget->draining = false;
}

// `permit` (and `bytes` of live_bytes) go back to `budget` once `last_use` has passed: one drain
// task per burst of returns, not one per return.
Result<void> return_after(const std::shared_ptr<Budget>& budget, async::Event last_use, async::Semaphore::Permit permit,
                          std::size_t bytes) {
  budget->returns.push_back({std::move(last_use), std::move(permit), bytes});
  if (budget->draining) return {};
  async::Runtime* rt = async::Runtime::current();
  if (!rt) return fail(ErrorCode::internal, "Engine: a budget returned outside a runtime");
  budget->draining = true;
  rt->spawn(drain_returns(budget)).detach();
  return {};
}

}  // namespace

struct Engine::State {
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
  std::vector<std::unique_ptr<Unit>> units;
  std::unordered_map<const Module*, std::size_t> unit_of;
  std::unordered_map<const Parameter*, std::string> names;
  std::size_t largest_unit_bytes = 0;
  std::size_t first_group = 0;  // the optimizer's group of unit i is first_group + i
  std::shared_ptr<Budget> budget;

  // Optimizer offload: a CPU stream and context the optimizer steps on, the pinned pool of its
  // shards, and device copies of the two small things the device needs from it.
  std::unique_ptr<async::Stream> host_stream;
  std::unique_ptr<async::CachingAllocator> host_allocator;
  std::unique_ptr<Context> host_ctx;
  std::shared_ptr<offload::PinnedPool> pinned;
  // nvme: each unit's master and state, one sub-group file each, streamed by the swapper. The
  // rank's folder is claimed (locked against a second run) first and let go last.
  offload::SwapFolder swap_folder;
  std::shared_ptr<offload::NvmeStore> store;
  std::unique_ptr<offload::Swapper> swapper;
  std::vector<offload::SubGroup> subgroups;
  bool swapped() const noexcept { return o.offload_optimizer == OptimizerOffload::nvme; }
  Tensor device_loss_scale;  // f32[1]: the seed of backward
  Tensor device_grad_stats;  // f32[2]: summed across ranks on the communication stream
  // f32[2] in pinned memory: the summed stats come back through it. A copy from the device into
  // pageable memory returns only once done: a hidden host wait for the whole step so far.
  offload::PinnedBlock grad_stats_back;
  bool offloaded() const noexcept { return o.offload_optimizer != OptimizerOffload::none; }
  bool params_offloaded() const noexcept { return o.offload_params != OffloadTarget::none; }
  bool params_on_nvme() const noexcept { return o.offload_params == OffloadTarget::nvme; }
  // bf16/f16 parameters: the host step writes them from the fp32 masters (half the bytes to the
  // device); with the optimizer on nvme and the shards on the device, through `staging`, one unit
  // at a time (the swapper's passes hand out one sub-group at a time and await its use). With the
  // parameters on nvme a shard is its master rounded as it is read, and `staging` holds a unit's
  // rounded master while a checkpoint visits it.
  bool narrow() const noexcept { return o.dtype != DataType::f32; }
  bool staged() const noexcept { return swapped() && narrow() && o.offload_params != OffloadTarget::cpu; }
  offload::PinnedBlock staging;
  Tensor staging_for(const Unit& u) const {
    return Tensor(staging.data(), Shape{u.info.shard}, o.dtype, async::Device::cpu());
  }
  // nvme parameters: param_buffer_count slots, one per shard read from its start to its gather.
  std::shared_ptr<Budget> read_slots;
  // nvme parameters: values for the swap files that initialize/load_parameters computed on the
  // host (there is no shard to copy them from), taken by masters_from_shards.
  std::vector<std::vector<std::byte>> pending_shards;
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
  // `later` runs after `event` of another stream: device-side when it can wait on it (a CPU
  // stream can wait on anything; a CUDA stream only on CUDA events), else the host awaits it.
  static async::Task<Result<void>> after(async::Stream& later, async::Event event) {
    if (later.device().is_cpu() || event.device().is_cuda()) co_return later.wait(event);
    co_return co_await event;
  }
  // The compute stream after everything the host stream has so far (the optimizer's casts into
  // its masters at build, a step's host work): before shards or masters are written outside a step.
  async::Task<Result<void>> compute_after_host() {
    if (!host_stream) co_return Result<void>{};
    COSHARD_CO_TRY_ASSIGN(auto done, host_stream->record());
    co_return co_await after(ctx->stream(), done);
  }
  // `n` elements of `src` converted into `dst` on the host stream, awaited.
  async::Task<Result<void>> cast_on_host(DataType from, const void* src, DataType to, void* dst, std::int64_t n) {
    COSHARD_CO_TRY(host_ctx->kernels().cast(*host_stream, from, src, to, dst, n));
    COSHARD_CO_TRY_ASSIGN(auto cast, host_stream->record());
    co_return co_await cast;
  }
  // The fp32 masters follow the shards (after initialisation or a load).
  async::Task<Result<void>> masters_from_shards() {
    if (!offloaded()) co_return optimizer->reset_masters(*ctx);
    if (swapped()) {
      // Every sub-group written anew: the master from the shard, the state zero.
      auto fill = [this](std::size_t k, std::span<std::byte> bytes) -> async::Task<Result<void>> {
        const Unit& u = *units[k];
        if (params_on_nvme()) {  // the values were computed on the host, in the compute dtype
          const auto& values = pending_shards.at(k);
          if (!narrow()) {
            std::copy(values.begin(), values.end(), bytes.begin());
            co_return Result<void>{};
          }
          co_return co_await cast_on_host(o.dtype, values.data(), DataType::f32, bytes.data(), u.info.shard);
        }
        if (!narrow()) {
          COSHARD_CO_TRY(ctx->stream().copy(bytes.data(), u.shard.data(), u.shard.bytes()));
          COSHARD_CO_TRY_ASSIGN(auto copied, ctx->stream().record());
          co_return co_await copied;
        }
        // bf16/f16: the shard (through the staging buffer when on the device) widened on the host.
        Tensor source = u.shard;
        if (!params_offloaded()) {
          source = staging_for(u);
          COSHARD_CO_TRY(ctx->stream().copy(source.data(), u.shard.data(), u.shard.bytes()));
        }
        COSHARD_CO_TRY_ASSIGN(auto copied, ctx->stream().record());
        COSHARD_CO_TRY(co_await after(*host_stream, copied));
        co_return co_await cast_on_host(o.dtype, source.data(), DataType::f32, bytes.data(), u.info.shard);
      };
      auto written = co_await swapper->initialize(subgroups, fill);
      pending_shards.clear();
      co_return written;
    }
    // (with cpu parameter offload the shard is the master, or its pinned bf16/f16 copy, already)
    const Tensor Unit::*host = narrow() ? &Unit::host_param : &Unit::host_master;
    for (auto& u : units)
      if (u->shard.data() != ((*u).*host).data())
        COSHARD_CO_TRY(ctx->stream().copy(((*u).*host).data(), u->shard.data(), u->shard.bytes()));
    COSHARD_CO_TRY_ASSIGN(auto copied, ctx->stream().record());
    COSHARD_CO_TRY(co_await after(*host_stream, copied));
    if (narrow()) {  // the fp32 masters from the bf16/f16 copies, on the host
      const auto& groups = optimizer->groups();
      for (const auto& u : units) {
        const auto& g = groups[first_group + u->index];
        COSHARD_CO_TRY(host_ctx->kernels().cast(*host_stream, o.dtype, u->host_param.data(), DataType::f32,
                                                g.master.data(), u->info.shard));
      }
      // What the compute stream does next (a checkpoint's load writes the copies and the masters)
      // comes after these reads and writes.
      COSHARD_CO_TRY_ASSIGN(auto widened, host_stream->record());
      COSHARD_CO_TRY(co_await after(ctx->stream(), widened));
    }
    co_return Result<void>{};
  }

  // Stages 1-2: every rank's block of every unit into the full copies, after the blocks changed
  // outside a step (a load). Stage 3 keeps no full copies.
  async::Task<Result<void>> full_copies_from_shards() {
    if (stage3()) co_return Result<void>{};
    auto& compute = ctx->stream();
    auto& cs = comm->stream();
    COSHARD_CO_TRY(order(compute, cs));
    COSHARD_CO_TRY(gather_full_copies());
    COSHARD_CO_TRY(order(cs, compute));
    co_return Result<void>{};
  }
  // nvme: unit k's shard with its master and state as views of the swap buffer holding them.
  UnitShard swapped_shard(std::size_t k, std::span<std::byte> bytes) const {
    const Unit& u = *units[k];
    const Shape shape{u.info.shard};
    const std::size_t states = optimizer->state_tensors();
    const auto len = static_cast<std::size_t>(u.info.shard) * sizeof(float);
    auto* base = bytes.data();
    auto view = [&](std::size_t i) { return Tensor(base + i * len, shape, DataType::f32, async::Device::cpu()); };
    return {u.info, params_on_nvme() ? view(0) : u.shard, view(0), states >= 1 ? view(1) : Tensor{},
            states >= 2 ? view(2) : Tensor{}};
  }

  // Traces of fetch order, per phase.
  std::string phase = "train";
  std::map<std::string, std::vector<std::size_t>> traces;
  std::vector<std::size_t> recording;
  const std::vector<std::size_t>* trace = nullptr;  // null: none yet, or departed from this step
  std::size_t trace_pos = 0;
  std::size_t prefetched_bytes = 0;
  // Bytes of units gathered or in flight as the host has issued them (released ones excluded at
  // once): the same on every rank, unlike the device-paced budget semaphore.
  std::size_t logical_live = 0;
  EngineStepStats stats;

  // Timing (options.timing / record_timeline): the step's waits of compute on communication and
  // its timeline, as event pairs read once the step is over.
  struct Span {
    bool compute;
    const char* category;
    const std::string* name;  // a unit's name, or a static phase name
    async::Event start, end;
    std::size_t pos;   // compute spans of stage 3: the fetch's position in the pass's order
    std::size_t unit;  // gathers: the unit
  };
  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
  std::vector<Span> spans;
  std::vector<std::pair<async::Event, async::Event>> waits;
  async::Event epoch;

  // Adaptive prefetch: measured milliseconds (device timestamps, a moving average over steps) of
  // each unit's gather, and of the compute at each position of each phase's fetch order.
  std::vector<double> gather_ms;                          // per unit; < 0: not measured yet
  std::map<std::string, std::vector<double>> compute_ms;  // per phase, per trace position
  static void learn(double& average, double sample) { average = average < 0 ? sample : 0.5 * average + 0.5 * sample; }
  // A gather's span also holds time spent waiting for peers and for a busy host: the estimate
  // follows the fastest recent sample, rising by at most a quarter a step when the link slows.
  static void learn_gather(double& estimate, double sample) {
    estimate = estimate < 0 ? sample : std::min(sample, 1.25 * estimate);
  }

  // The ranks average their measurements (one small all-reduce at the end of a pass), so every
  // rank makes the same prefetch decisions and issues its collectives in the same order.
  async::Task<Result<void>> agree_on_measurements() {
    if (!o.adaptive_prefetch) co_return Result<void>{};
    auto& positions = compute_ms[phase];
    std::vector<double> mine(gather_ms);
    mine.insert(mine.end(), positions.begin(), positions.end());
    auto bytes = encode_values(mine, DataType::f32);
    COSHARD_CO_TRY_ASSIGN(Tensor t, ctx->upload(bytes, Shape{static_cast<std::int64_t>(mine.size())}, DataType::f32));
    COSHARD_CO_TRY(order(ctx->stream(), comm->stream()));
    COSHARD_CO_TRY(comm->all_reduce(t.data(), t.data(), mine.size(), DataType::f32, ReduceOp::avg));
    COSHARD_CO_TRY(order(comm->stream(), ctx->stream()));
    COSHARD_CO_TRY_ASSIGN(auto agreed, co_await ctx->read(t));
    std::copy(agreed.begin(), agreed.begin() + static_cast<std::ptrdiff_t>(gather_ms.size()), gather_ms.begin());
    std::copy(agreed.begin() + static_cast<std::ptrdiff_t>(gather_ms.size()), agreed.end(), positions.begin());
    co_return Result<void>{};
  }

  bool timing() const noexcept { return o.timing || spans_on(); }
  // Spans are kept for the timeline, and for adaptive prefetch (its measurements).
  bool spans_on() const noexcept { return o.record_timeline || o.adaptive_prefetch; }
  Result<async::Event> mark(async::Stream& stream) const { return timing() ? stream.record_timed() : stream.record(); }
  void span(bool compute, const char* category, const std::string& name, async::Event start, async::Event end,
            std::size_t pos = kNone, std::size_t unit = kNone) {
    if (spans_on()) spans.push_back({compute, category, &name, std::move(start), std::move(end), pos, unit});
  }
  // The compute stream waits for `event` of the communication stream; with timing, the time it
  // stands there is measured (a timed event on each side of the wait).
  Result<void> compute_waits(const async::Event& event, const std::string& what) {
    auto& compute = ctx->stream();
    if (!timing()) return compute.wait(event);
    COSHARD_TRY_ASSIGN(auto before, compute.record_timed());
    COSHARD_TRY(compute.wait(event));
    COSHARD_TRY_ASSIGN(auto after, compute.record_timed());
    span(true, "wait", what, before, after);
    waits.emplace_back(std::move(before), std::move(after));
    return {};
  }
  Result<void> compute_waits_for_comm(const std::string& what) {
    COSHARD_TRY_ASSIGN(auto ev, comm->stream().record());
    return compute_waits(ev, what);
  }
  // Spans are stamped by the streams when they pass their events, so a span can only be
  // trusted to start after the epoch if both streams are ordered after it: under load a stream
  // (or another rank's clock stream) may stamp the epoch later than the host recorded it.
  Result<void> streams_after_epoch() {
    COSHARD_TRY(ctx->stream().wait(epoch));
    return comm->stream().wait(epoch);
  }
  // After the step's last event has passed: the waits' total and the timeline.
  void collect_timing() {
    if (!timing()) return;
    double exposed = 0;
    bool complete = true;
    for (const auto& [before, after] : waits) {
      auto ms = after.elapsed_ms_since(before);
      if (ms) exposed += *ms;
      else complete = false;
    }
    waits.clear();
    if (complete) stats.exposed_comm_ms = exposed;
    auto& compute_of_pass = compute_ms[phase];
    compute_of_pass.resize(recording.size(), -1.0);
    for (const auto& sp : spans) {
      if (o.adaptive_prefetch) {
        if (auto d = sp.end.elapsed_ms_since(sp.start)) {
          if (sp.pos != kNone && sp.pos < compute_of_pass.size()) learn(compute_of_pass[sp.pos], *d);
          if (sp.unit != kNone) learn_gather(gather_ms[sp.unit], *d);
        }
      }
      if (!o.record_timeline) continue;
      auto a = sp.start.elapsed_ms_since(epoch);
      auto b = sp.end.elapsed_ms_since(epoch);
      if (a && b) stats.timeline.push_back({sp.compute ? "compute" : "comm", sp.category, *sp.name, *a, *b});
    }
    spans.clear();
  }

  bool stage3() const noexcept { return o.zero_stage == 3; }
  Unit* unit_for(const Module& m) {
    auto it = unit_of.find(&m);
    return it == unit_of.end() ? nullptr : units[it->second].get();
  }
  // A prefetched unit is no longer ahead of use (fetched now, or released unused).
  void settle_prefetch(Unit& u) {
    if (!u.prefetched) return;
    prefetched_bytes -= u.info.padded_bytes;
    u.prefetched = false;
  }

  Result<void> bind_values(Unit& u, const Tensor& buffer) {
    for (auto& p : u.params) {
      Tensor grad = u.grad_full ? u.grad_full.slice(p.offset, p.parameter->shape()) : Tensor{};
      COSHARD_TRY(p.parameter->bind(buffer.slice(p.offset, p.parameter->shape()), std::move(grad)));
    }
    return {};
  }
  const Tensor& values_of(const Unit& u) const { return stage3() ? u.gathered : u.full; }

  // ---- stage 3: gather and release ----

  // Unit u's shards of every rank into `whole` on the communication stream. This rank's shard
  // comes from the device, or with parameter offload from host memory (pinned, or the buffer its
  // nvme read filled): copied into its place in `whole`, then gathered in place (NCCL reads
  // device memory only).
  Result<async::Event> gather_unit(Unit& u, const Tensor& whole) {
    auto& cs = comm->stream();
    const auto shard = static_cast<std::size_t>(u.info.shard);
    const void* source = u.shard.data();
    if (params_on_nvme()) {
      if (!u.read_block)
        return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " gathered before its shard was read");
      source = u.read_block.data();
    }
    void* mine = whole.slice(static_cast<std::int64_t>(rank) * u.info.shard, Shape{u.info.shard}).data();
    Result<async::Event> done = async::Event{};
    if (o.fetch_mode == FetchMode::all_gather && !params_offloaded()) {
      done = comm->all_gather(source, whole.data(), shard, o.dtype);
    } else if (o.fetch_mode == FetchMode::all_gather) {
      COSHARD_TRY(cs.copy(mine, source, shard * element_size));
      done = comm->all_gather(mine, whole.data(), shard, o.dtype);
    } else {
      COSHARD_TRY(cs.fill(whole.data(), 0, u.info.padded_bytes));
      COSHARD_TRY(cs.copy(mine, source, shard * element_size));
      done = comm->all_reduce(whole.data(), whole.data(), static_cast<std::size_t>(u.info.padded), o.dtype,
                              ReduceOp::sum);
    }
    if (done && params_on_nvme()) {
      // The read buffer and its slot come back once the copy out of it has passed.
      u.read_block.release_after(*done);
      COSHARD_TRY(return_after(read_slots, *done, std::move(u.read_slot), 0));
    }
    return done;
  }

  // ---- nvme parameters: reads ahead along the trace ----

  static async::Task<Result<offload::PinnedBlock>> read_shard(std::shared_ptr<offload::NvmeStore> store,
                                                              std::shared_ptr<offload::PinnedPool> pool,
                                                              std::string file, std::size_t bytes) {
    COSHARD_CO_TRY_ASSIGN(auto block, pool->acquire(bytes));
    // The whole page-rounded buffer: the swap file is padded to whole pages past the master.
    COSHARD_CO_TRY(co_await store->read(std::move(file), 0, block.pages()));
    co_return block;
  }
  Result<void> start_read(Unit& u, async::Semaphore::Permit slot) {
    async::Runtime* rt = async::Runtime::current();
    if (!rt) return fail(ErrorCode::internal, "Engine: a parameter read outside a runtime");
    const auto bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);  // the fp32 master
    u.read = rt->spawn(read_shard(store, pinned, subgroups[u.index].name, bytes));
    u.read_slot = std::move(slot);
    return {};
  }
  // Unit u's shard in u.read_block: the read started ahead, or one now.
  async::Task<Result<void>> ensure_read(Unit& u) {
    if (u.read_block) co_return Result<void>{};
    if (!u.read.valid()) {
      auto slot = read_slots->semaphore.try_acquire(1);
      if (!slot) {
        // Every slot is taken: by reads for units further along (the order departed from the
        // trace), which are dropped, or by gathers in flight, which give theirs back as they pass.
        COSHARD_CO_TRY(co_await drain_reads());
        slot = read_slots->semaphore.try_acquire(1);
      }
      if (!slot) {
        COSHARD_CO_TRY_ASSIGN(auto freed, co_await read_slots->semaphore.acquire(1));
        slot = std::move(freed);
      }
      COSHARD_CO_TRY(start_read(u, std::move(*slot)));
    }
    auto handle = std::move(u.read);
    auto block = co_await handle;
    if (!block) {
      u.read_slot.release();
      co_return fail(std::move(block).error().with_context("reading the parameters of unit " + u.info.name));
    }
    u.read_block = std::move(*block);
    stats.swap_bytes += u.read_block.size();
    if (narrow()) {  // bf16/f16: the master rounded, in place, on the host stream (off the reactor)
      const auto n = static_cast<std::size_t>(u.info.shard);
      void* data = u.read_block.data();
      const DataType dt = o.dtype;
      COSHARD_CO_TRY(host_stream->launch([data, n, dt] { detail::narrow_in_place(data, n, dt); }));
      COSHARD_CO_TRY_ASSIGN(auto narrowed, host_stream->record());
      COSHARD_CO_TRY(co_await narrowed);
    }
    co_return Result<void>{};
  }
  // Starts reads for the units next in the trace that are neither gathered nor read, while slots
  // are free (never waits: a read that must happen now is ensure_read's).
  Result<void> read_ahead() {
    if (!params_on_nvme() || !trace) return {};
    for (std::size_t i = trace_pos; i < trace->size(); ++i) {
      Unit& v = *units[(*trace)[i]];
      if (v.gather != Gather::released || v.read_block || v.read.valid()) continue;
      auto slot = read_slots->semaphore.try_acquire(1);
      if (!slot) break;
      COSHARD_TRY(start_read(v, std::move(*slot)));
    }
    return {};
  }
  // Before the optimizer rewrites the swap files: every read finished, unused buffers back.
  async::Task<Result<void>> drain_reads() {
    Result<void> first{};
    for (auto& u : units) {
      if (u->read.valid()) {
        auto handle = std::move(u->read);
        auto block = co_await handle;
        if (!block && first) first = fail(std::move(block).error());
      }
      u->read_block.reset();
      u->read_slot.release();
    }
    co_return first;
  }

  Result<void> issue_gather(Unit& u, async::Semaphore::Permit permit, bool ahead) {
    auto& cs = comm->stream();
    async::Event started;
    if (spans_on()) {
      COSHARD_TRY_ASSIGN(started, cs.record_timed());
    }
    // Allocated for the compute stream (its last user); the gather's own use is recorded below,
    // so returning the block needs no record on the communication stream.
    COSHARD_TRY_ASSIGN(u.gathered_block, ctx->allocator().allocate(u.info.padded_bytes, ctx->stream()));
    u.gathered = Tensor(u.gathered_block.data(), Shape{u.info.padded}, o.dtype, ctx->device());
    auto done = gather_unit(u, u.gathered);
    if (!done) return fail(std::move(done).error().with_context("gathering unit " + u.info.name));
    u.gathered_event = std::move(*done);
    if (spans_on()) {
      COSHARD_TRY_ASSIGN(auto finished, cs.record_timed());
      span(false, ahead ? "prefetch" : "fetch", u.info.name, std::move(started), std::move(finished), kNone, u.index);
    }
    u.gathered_block.record_use(u.gathered_event);
    u.gather = Gather::in_flight;
    u.permit = std::move(permit);
    budget->live_bytes += u.info.padded_bytes;
    logical_live += u.info.padded_bytes;
    stats.peak_live_bytes = std::max(stats.peak_live_bytes, budget->live_bytes);
    ++stats.gathers;
    stats.gathered_bytes += u.info.padded_bytes;
    return {};
  }

  // The buffer and its budget come back once the compute stream has passed its last use.
  Result<void> release(Unit& u) {
    if (u.gather == Gather::released) return {};
    COSHARD_TRY_ASSIGN(auto last_use, spans_on() ? ctx->stream().record_timed() : ctx->stream().record());
    span(true, "release", u.info.name, last_use, last_use);
    // The block's uses: the gather (recorded at issue, so a stale prefetch's memory still waits
    // for it) and the compute stream up to `last_use`.
    u.gathered_block.reset_after(last_use);
    u.gathered = {};
    for (auto& p : u.params) p.parameter->unbind();
    settle_prefetch(u);
    u.gather = Gather::released;
    logical_live -= u.info.padded_bytes;
    auto permit = std::move(*u.permit);
    u.permit.reset();
    return return_after(budget, std::move(last_use), std::move(permit), u.info.padded_bytes);
  }

  // Gathers units further along the trace, in order, while the bucket and the budget allow.
  // Stops at the first that does not fit, so prefetched units are always the next ones in
  // line and an on-demand fetch never waits for budget held by a unit used after it.
  //
  // Every decision here depends only on what every rank sees alike (the trace, the host-side
  // count of gathered bytes, and measurements the ranks have averaged), never on how far a
  // device has got: the ranks must issue their collectives in one order. The physical budget is
  // then awaited (the bytes come back once released units' last uses have passed on the device).
  //
  // Returns {} when done, or what must be awaited before the next unit can be gathered: budget
  // (its bytes: the caller awaits them into `prefetch_permit`) or, with nvme parameters, the
  // unit's read (ensure_read). The caller then calls again (a plain function, so the common path
  // costs no coroutine frame).
  struct Awaiting {
    std::size_t bytes = 0;
    Unit* read = nullptr;
    bool done() const noexcept { return bytes == 0 && read == nullptr; }
  };
  Result<Awaiting> prefetch_ahead() {
    if (!trace || (o.prefetch_bucket_bytes == 0 && !o.adaptive_prefetch)) return Awaiting{};
    const std::size_t cap = o.prefetch_bucket_bytes == 0 ? std::numeric_limits<std::size_t>::max() : o.prefetch_bucket_bytes;
    // Adaptive: gather a unit now when waiting for the next fetch would make it late, i.e. when
    // the communication queued up to it (its gather and those before it in the trace) would
    // outlast the compute between the next fetch and its use. Measured one step behind; before
    // there are measurements, the bucket alone decides.
    const auto measured = compute_ms.find(phase);
    const bool adaptive = o.adaptive_prefetch && measured != compute_ms.end() &&
                          measured->second.size() >= trace->size() && !gather_ms.empty();
    double queued_ms = 0, compute_before_ms = 0;
    for (std::size_t i = trace_pos; i < trace->size(); ++i) {
      Unit& v = *units[(*trace)[i]];
      if (adaptive) {
        constexpr double kMargin = 1.5;  // measurements move from step to step
        queued_ms += std::max(0.0, gather_ms[v.index]);
        if (i > trace_pos) compute_before_ms += std::max(0.0, measured->second[i - 1]);
        if (queued_ms * kMargin < compute_before_ms) break;
      }
      if (v.gather != Gather::released) continue;
      if (prefetched_bytes + v.info.padded_bytes > cap) break;
      if (logical_live + v.info.padded_bytes > o.max_live_bytes) break;
      if (params_on_nvme() && !v.read_block) return Awaiting{0, &v};
      std::optional<async::Semaphore::Permit> permit;
      if (prefetch_permit && prefetch_permit->count() == v.info.padded_bytes) {
        permit = std::move(prefetch_permit);
        prefetch_permit.reset();
      } else {
        permit = budget->semaphore.try_acquire(v.info.padded_bytes);
      }
      if (!permit) return Awaiting{v.info.padded_bytes, nullptr};  // free once released units' last uses pass
      COSHARD_TRY(issue_gather(v, std::move(*permit), true));
      v.prefetched = true;
      prefetched_bytes += v.info.padded_bytes;
      stats.peak_prefetched_bytes = std::max(stats.peak_prefetched_bytes, prefetched_bytes);
    }
    return Awaiting{};
  }
  std::optional<async::Semaphore::Permit> prefetch_permit;

  // The order departed from the trace: fetch on demand from here on, and give back what was
  // gathered ahead for the old order (it may never be used this step).
  Result<void> abandon_trace() {
    trace = nullptr;
    stats.trace_changed = true;
    for (auto& u : units)
      if (u->prefetched) COSHARD_TRY(release(*u));
    return {};
  }

  async::Task<Result<void>> fetch(Unit& u) {
    ++stats.fetches;
    u.fetch_pos = recording.size();
    recording.push_back(u.index);
    if (trace) {
      if (trace_pos < trace->size() && (*trace)[trace_pos] == u.index)
        ++trace_pos;
      else
        COSHARD_CO_TRY(abandon_trace());
    }
    if (u.gather != Gather::released) ++stats.prefetch_hits;
    settle_prefetch(u);
    if (u.gather == Gather::released) {
      if (params_on_nvme()) COSHARD_CO_TRY(co_await ensure_read(u));
      COSHARD_CO_TRY_ASSIGN(auto permit, co_await budget->semaphore.acquire(u.info.padded_bytes));
      COSHARD_CO_TRY(issue_gather(u, std::move(permit), false));
    }
    // Issued before this unit's wait.
    for (;;) {
      COSHARD_CO_TRY_ASSIGN(const Awaiting need, prefetch_ahead());
      if (need.done()) break;
      if (need.read) {
        COSHARD_CO_TRY(co_await ensure_read(*need.read));
        continue;
      }
      COSHARD_CO_TRY_ASSIGN(auto permit, co_await budget->semaphore.acquire(need.bytes));
      prefetch_permit = std::move(permit);
    }
    prefetch_permit.reset();  // not used after all (the trace moved on): back to the budget
    COSHARD_CO_TRY(read_ahead());
    if (u.gather == Gather::in_flight) {
      COSHARD_CO_TRY(compute_waits(u.gathered_event, u.info.name));
      u.gather = Gather::ready;
    }
    co_return bind_values(u, u.gathered);
  }

  // Keep a unit gathered after its use when it is small, or needed again soon (and the budget
  // keeps room for the largest unit, so keeping never starves an on-demand fetch).
  bool keep_after_use(const Unit& u) const {
    if (u.info.persistent) return true;
    if ((o.max_reuse_distance == 0 && o.max_reuse_distance_elements == 0) || !trace) return false;
    bool soon = false;
    std::size_t elements = 0;
    for (std::size_t i = trace_pos; i < trace->size() && !soon; ++i) {
      const Unit& next = *units[(*trace)[i]];
      const bool by_count = i - trace_pos < o.max_reuse_distance;
      const bool by_elements = elements < o.max_reuse_distance_elements;
      if (!by_count && !by_elements) break;
      soon = next.index == u.index;
      elements += static_cast<std::size_t>(next.info.numel);
    }
    return soon && o.max_live_bytes - logical_live >= largest_unit_bytes;
  }

  // ---- gradients ----

  Result<void> begin_backward(Unit& u) {
    if (o.zero_stage == 1) return {};
    COSHARD_TRY_ASSIGN(u.grad_full_block, ctx->allocator().allocate(u.info.padded_bytes, ctx->stream()));
    u.grad_full = Tensor(u.grad_full_block.data(), Shape{u.info.padded}, o.dtype, ctx->device());
    COSHARD_TRY(ctx->stream().fill(u.grad_full.data(), 0, u.info.padded_bytes));
    return bind_values(u, values_of(u));
  }

  // The reduced block `mine` (compute dtype) into an fp32 tensor, on the communication stream.
  Result<void> shard_from(const Unit& u, const Tensor& mine, const Tensor& out) {
    auto& cs = comm->stream();
    if (o.dtype == DataType::f32) return cs.copy(out.data(), mine.data(), mine.bytes());
    return ctx->kernels().cast(cs, o.dtype, mine.data(), DataType::f32, out.data(), u.info.shard);
  }

  // Stages 2-3: reduce-scatter (average) the unit's gradient into this rank's block, in place,
  // then add it into the shard, all on the communication stream; the full buffer goes behind it.
  Result<void> reduce_gradients(Unit& u) {
    if (o.zero_stage == 1) return {};
    auto& cs = comm->stream();
    COSHARD_TRY_ASSIGN(auto produced, ctx->stream().record());
    COSHARD_TRY(cs.wait(produced));
    async::Event started;
    if (spans_on()) {
      COSHARD_TRY_ASSIGN(started, cs.record_timed());
    }
    Tensor mine = u.grad_full.slice(static_cast<std::int64_t>(rank) * u.info.shard, Shape{u.info.shard});
    auto rs = comm->reduce_scatter(u.grad_full.data(), mine.data(), static_cast<std::size_t>(u.info.shard), o.dtype,
                                   ReduceOp::avg);
    stats.reduce_scattered_bytes += u.info.padded_bytes;
    if (!rs) return fail(std::move(rs).error().with_context("reducing the gradients of unit " + u.info.name));
    // Into the fp32 shard (bf16/f16 compute reduces in its own dtype, accumulates in fp32).
    async::Block scratch;
    if (u.grads_this_step == 0) {
      COSHARD_TRY(shard_from(u, mine, u.grad_shard));
    } else if (o.dtype == DataType::f32) {
      COSHARD_TRY(ctx->kernels().add(cs, DataType::f32, u.grad_shard.data(), mine.data(), u.grad_shard.data(), u.info.shard));
    } else {
      COSHARD_TRY_ASSIGN(scratch, ctx->allocator().allocate(u.grad_shard.bytes(), cs));
      Tensor widened(scratch.data(), Shape{u.info.shard}, DataType::f32, ctx->device());
      COSHARD_TRY(shard_from(u, mine, widened));
      COSHARD_TRY(ctx->kernels().add(cs, DataType::f32, u.grad_shard.data(), widened.data(), u.grad_shard.data(), u.info.shard));
    }
    ++u.grads_this_step;
    COSHARD_TRY_ASSIGN(auto reduced, spans_on() ? cs.record_timed() : cs.record());
    if (grads_out_in_backward) {  // (a unit with two backward passes is copied again: the last copy wins)
      COSHARD_TRY(cs.copy(u.host_grad.data(), u.grad_shard.data(), u.grad_shard.bytes()));
      stats.swap_bytes += u.grad_shard.bytes();
      u.grads_out = true;
      if (stepping_in_backward && u.grads_this_step == u.forward_uses) COSHARD_TRY(step_on_host(u));
    }
    if (scratch) scratch.reset_after(reduced);
    span(false, "reduce_scatter", u.info.name, std::move(started), reduced);
    u.grad_full_block.record_use(reduced);
    u.grad_full_block.reset();
    u.grad_full = {};
    return bind_values(u, values_of(u));
  }

  // After a step_in_backward step whose optimizer report says it was skipped (the overflow flag
  // is summed over ranks, so every rank reads the same): the units stepped during backward
  // cannot be skipped any more, so the step fails, on every rank alike.
  Result<void> step_in_backward_saw_non_finite() const {
    std::size_t stepped = 0;
    for (const auto& u : units) stepped += u->stepped_early ? 1 : 0;
    return fail(ErrorCode::unsupported, "Engine::step: a non-finite gradient with step_in_backward: ", stepped,
                " of ", units.size(), " units on this rank were stepped during backward and cannot be skipped, so ",
                "the parameters are no longer trustworthy. Restore the last checkpoint; without step_in_backward, ",
                "such a step is skipped");
  }

  // step_in_backward: the unit's last gradient shard of the step is on its way to pinned memory;
  // the host stream steps it once the copy has passed (its share of the norm and overflow flag
  // first, so that they are complete for the step's report).
  Result<void> step_on_host(Unit& u) {
    COSHARD_TRY_ASSIGN(auto out, comm->stream().record());
    COSHARD_TRY(host_stream->wait(out));
    COSHARD_TRY(optimizer->add_grad_stats(*host_ctx, first_group + u.index));
    if (swapped()) {
      COSHARD_TRY(hand_to_swap_step(u));
    } else {
      COSHARD_TRY(optimizer->apply_one(*host_ctx, first_group + u.index, step_lr));
    }
    u.stepped_early = true;
    ++stats.stepped_in_backward;
    return {};
  }
  // nvme: the unit goes to the swapper's pass, which steps it when its sub-group is in. A pass
  // that failed (an I/O error) is gone: backward goes on regardless, so that the step fails
  // where stepping after backward would, with every rank's collectives launched alike, when the
  // pass is awaited (with its error).
  Result<void> hand_to_swap_step(const Unit& u) {
    std::size_t index = u.index;
    if (!grads_ready) return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " handed to no swapped step");
    auto sent = grads_ready->try_send(index);
    if (!sent && sent.error().code() != ErrorCode::closed)
      return fail(std::move(sent).error().with_context("stepping unit " + u.info.name + " in backward"));
    handed_order.push_back(index);
    return {};
  }

  // nvme: unit k's sub-group (master and state, in `bytes`) stepped on the host stream, and the
  // new shard copied to the device on `to` (the buffer goes back to the swapper, to be written
  // and reused, only after that copy). nvme parameters: the master in the file is the shard.
  async::Task<Result<void>> step_swapped_unit(std::size_t k, std::span<std::byte> bytes, float lr, async::Stream& to) {
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

  // step_in_backward with the optimizer on nvme: one pass of the swapper over every sub-group,
  // beside forward and backward. Each is read ahead (from the start of the step) and stepped
  // once its unit arrives through `ready`; its new shard goes to the device on the communication
  // stream, which has passed the unit's last backward (its reduction came after it). The
  // channel closing before a unit arrives (backward failed) ends the pass with an error.
  async::Task<Result<void>> swapped_step_in_backward(async::Receiver<std::size_t> ready, float lr) {
    std::vector<std::size_t> order = backward_order;
    if (order.size() != units.size()) {  // no step yet: backward goes roughly in reverse
      order.clear();
      for (std::size_t k = units.size(); k-- > 0;) order.push_back(k);
    }
    std::vector<offload::SubGroup> groups;
    for (std::size_t k : order) groups.push_back(subgroups[k]);
    std::vector<bool> arrived(units.size(), false);
    const auto read_before = swapper->stats().bytes_read, written_before = swapper->stats().bytes_written;
    auto step_when_ready = [&](std::size_t i, std::span<std::byte> bytes) -> async::Task<Result<void>> {
      const std::size_t k = order[i];
      while (!arrived[k]) {
        auto next = co_await ready.recv();
        if (!next)
          co_return fail(ErrorCode::closed, "step_in_backward: the step ended before unit ", units[k]->info.name,
                         " was stepped");
        arrived.at(*next) = true;
      }
      co_return co_await step_swapped_unit(k, bytes, lr, comm->stream());
    };
    auto passed = co_await swapper->for_each(groups, step_when_ready, true);
    stats.swap_bytes += (swapper->stats().bytes_read - read_before) + (swapper->stats().bytes_written - written_before);
    co_return passed;
  }

  // Stages 1-2: every rank's shard into every rank's full copy, in one launch on the
  // communication stream (after what is enqueued there).
  Result<void> gather_full_copies() {
    auto& cs = comm->stream();
    COSHARD_TRY_ASSIGN(auto started, mark(cs));
    Coalesced group;
    for (auto& u : units) {
      group.all_gather(u->shard.data(), u->full.data(), static_cast<std::size_t>(u->info.shard), o.dtype);
      stats.gathered_bytes += u->info.padded_bytes;
    }
    COSHARD_TRY(comm->launch(group));
    COSHARD_TRY_ASSIGN(auto finished, mark(cs));
    span(false, "all_gather", kParameters, std::move(started), std::move(finished));
    return {};
  }

  // ---- a pass ----

  void begin_pass(std::string_view name) {
    phase = std::string(name);
    auto it = traces.find(phase);
    trace = it == traces.end() ? nullptr : &it->second;
    trace_pos = 0;
    recording.clear();
    prefetched_bytes = 0;
    stats = {};
    spans.clear();
    waits.clear();
  }

  Result<void> end_pass() {
    if (stage3())
      for (auto& u : units) COSHARD_TRY(release(*u));
    const auto it = traces.find(phase);
    if (it == traces.end() || it->second != recording) {
      if (it != traces.end()) stats.trace_changed = true;
      traces[phase] = recording;
    }
    trace = nullptr;
    return {};
  }

  // Orders `to` after everything enqueued on `from` so far.
  static Result<void> order(async::Stream& from, async::Stream& to) {
    COSHARD_TRY_ASSIGN(auto ev, from.record());
    return to.wait(ev);
  }
};

Engine::Engine(std::unique_ptr<State> state) : s_(std::move(state)) {}

Result<void> Engine::set_timeline_epoch(async::Event epoch) {
  if (!epoch.timed() || !(epoch.device() == s_->ctx->device()))
    return fail(ErrorCode::invalid_argument, "set_timeline_epoch: expected a timed event (Stream::record_timed) on ",
                s_->ctx->device().to_string());
  s_->epoch = std::move(epoch);
  return s_->streams_after_epoch();
}

Engine::~Engine() {
  if (!s_) return;
  if (s_->host_stream) {
    // Teardown: the host stream goes quiet, then the optimizer lets go of the groups made on the
    // engine's host context (their memory belongs to it) before that context goes.
    (void)s_->host_stream->synchronize();
    s_->optimizer->drop_groups_from(s_->first_group);
  }
  if (s_->ctx->hooks() == this) s_->ctx->set_hooks(nullptr);
  for (auto& u : s_->units) {
    if (u->gather != Gather::released) {
      // The block goes back behind the gather and the compute stream's point (reset records
      // it); the budget goes with the engine.
      u->gathered_block.reset();
      if (u->permit) u->permit->forget();
    }
    if (auto ev = s_->comm->stream().record()) {
      u->shard_block.record_use(*ev);
      u->full_block.record_use(*ev);
      u->grad_shard_block.record_use(*ev);
      u->grad_full_block.record_use(*ev);
    }
    for (auto& p : u->params) p.parameter->unbind();
    u->read_slot.forget();  // nvme parameters: the read slots go with the engine too
  }
}

const EngineOptions& Engine::options() const noexcept { return s_->o; }

std::size_t Engine::units_in_flight() const noexcept {
  std::size_t n = 0;
  for (const auto& u : s_->units) n += u->gather == Gather::in_flight ? 1 : 0;
  return n;
}

int Engine::rank() const noexcept { return s_->rank; }
int Engine::world_size() const noexcept { return s_->world; }

ShardLayout Engine::shard_layout() const noexcept {
  const State& s = *s_;
  return {s.o.dtype != DataType::f32 || s.offloaded(), static_cast<int>(s.optimizer->state_tensors())};
}

async::Task<Result<void>> Engine::visit_shards(ShardVisitor use, bool written) {
  State& s = *s_;
  COSHARD_CO_TRY(co_await s.compute_after_host());
  if (s.swapped()) {
    auto visit_group = [&s, &use](std::size_t k, std::span<std::byte> bytes) -> async::Task<Result<void>> {
      UnitShard shard = s.swapped_shard(k, bytes);
      if (s.params_on_nvme() && s.narrow()) {
        // bf16/f16 on nvme: the parameters are the master rounded, made for the visit (what a load
        // writes there is dropped: the master it loads decides them).
        shard.params = s.staging_for(*s.units[k]);
        COSHARD_CO_TRY(co_await s.cast_on_host(DataType::f32, shard.master.data(), s.o.dtype, shard.params.data(),
                                               shard.info.shard));
      }
      co_return co_await use(shard);
    };
    COSHARD_CO_TRY(co_await s.swapper->for_each(s.subgroups, visit_group, written));
  } else {
    const auto& groups = s.optimizer->groups();
    for (const auto& u : s.units) {
      const auto& g = groups[s.first_group + u->index];
      const UnitShard shard{u->info, u->shard, g.master, g.state1, g.state2};
      COSHARD_CO_TRY(co_await use(shard));
    }
  }
  if (!written) co_return Result<void>{};
  co_return co_await s.full_copies_from_shards();
}
async::Task<Result<std::vector<GatheredParameter>>> Engine::gather_parameters() {
  State& s = *s_;
  Context& ctx = *s.ctx;
  auto& compute = ctx.stream();
  auto& cs = s.comm->stream();
  std::vector<GatheredParameter> out;
  COSHARD_CO_TRY(State::order(compute, cs));
  for (auto& up : s.units) {
    Unit& u = *up;
    Tensor whole = u.full;
    if (s.stage3()) {
      // One unit at a time: a consolidated export must not need the whole model on one rank's device.
      COSHARD_CO_TRY_ASSIGN(whole, ctx.empty(Shape{u.info.padded}, s.o.dtype));
      if (s.params_on_nvme()) COSHARD_CO_TRY(co_await s.ensure_read(u));
      auto done = s.gather_unit(u, whole);
      if (!done) co_return fail(std::move(done).error().with_context("gathering unit " + u.info.name + " for export"));
      COSHARD_CO_TRY(compute.wait(*done));
    }
    COSHARD_CO_TRY_ASSIGN(auto bytes, co_await ctx.read_bytes(whole));
    for (const auto& p : u.params) {
      const auto begin = static_cast<std::size_t>(p.offset) * s.element_size;
      const auto n = static_cast<std::size_t>(p.parameter->numel()) * s.element_size;
      out.push_back({s.names.at(p.parameter), p.parameter->shape(),
                     std::vector<std::byte>(bytes.begin() + static_cast<std::ptrdiff_t>(begin),
                                            bytes.begin() + static_cast<std::ptrdiff_t>(begin + n))});
    }
  }
  co_return out;
}

async::Task<Result<void>> Engine::load_parameters(const std::vector<GatheredParameter>& values) {
  State& s = *s_;
  std::unordered_map<std::string_view, const Parameter*> parameter_named;
  for (const auto& [param, name] : s.names) parameter_named.emplace(name, param);
  std::unordered_map<std::string_view, const GatheredParameter*> by_name;
  for (const auto& v : values) {
    if (!by_name.emplace(v.name, &v).second)
      co_return fail(ErrorCode::invalid_argument, "load_parameters: '", v.name, "' given twice");
    const auto it = parameter_named.find(v.name);
    if (it == parameter_named.end())
      co_return fail(ErrorCode::invalid_argument, "load_parameters: '", v.name, "' is not a parameter of the model");
    if (!(it->second->shape() == v.shape) || v.bytes.size() != static_cast<std::size_t>(v.shape.numel()) * s.element_size)
      co_return fail(ErrorCode::invalid_argument, "load_parameters: '", v.name, "' has shape ", v.shape.to_string(),
                     " and ", v.bytes.size(), " bytes; the model expects ", it->second->shape().to_string(), " in ",
                     collectives::to_string(s.o.dtype));
  }
  for (const auto& [param, name] : s.names)
    if (!by_name.contains(name))
      co_return fail(ErrorCode::invalid_argument, "load_parameters: no value for parameter '", name, "'");
  // Everything checked: now each rank writes its block of every unit.
  COSHARD_CO_TRY(co_await s.compute_after_host());
  s.pending_shards.clear();
  for (auto& up : s.units) {
    Unit& u = *up;
    std::vector<std::byte> unit_bytes(u.info.padded_bytes, std::byte{0});
    for (const auto& p : u.params) {
      const auto& v = *by_name.at(s.names.at(p.parameter));
      std::copy(v.bytes.begin(), v.bytes.end(), unit_bytes.begin() + static_cast<std::ptrdiff_t>(p.offset) * static_cast<std::ptrdiff_t>(s.element_size));
    }
    const auto shard_bytes = static_cast<std::size_t>(u.info.shard) * s.element_size;
    const auto first = static_cast<std::size_t>(s.rank) * shard_bytes;
    const auto mine = std::span<const std::byte>(unit_bytes).subspan(first, shard_bytes);
    if (s.params_on_nvme())
      s.pending_shards.emplace_back(mine.begin(), mine.end());  // straight into the swap files
    else
      COSHARD_CO_TRY(s.ctx->copy_from_host(u.shard, mine));
  }
  COSHARD_CO_TRY(co_await s.masters_from_shards());
  co_return co_await s.full_copies_from_shards();
}

Result<void> check_offload_placement(const EngineOptions& o) {
  if (o.offload_params == OffloadTarget::none) return {};
  const auto where = to_string(o.offload_params);
  if (o.zero_stage != 3)
    return fail(ErrorCode::invalid_argument, "offload_params=", where, " with zero_stage=", o.zero_stage,
                ": parameters are sharded, and so offloaded, at stage 3 only");
  if (o.offload_optimizer == OffloadTarget::none)
    return fail(ErrorCode::invalid_argument, "offload_params=", where,
                " with offload_optimizer=none: the optimizer steps the shards where they live (offload it too)");
  if (o.offload_params == OffloadTarget::nvme && o.offload_optimizer != OffloadTarget::nvme)
    return fail(ErrorCode::invalid_argument, "offload_params=nvme with offload_optimizer=", to_string(o.offload_optimizer),
                ": the shards on NVMe are the masters in the optimizer's swap files (expected offload_optimizer=nvme; "
                "with cpu, the masters hold the parameters in host memory already: use offload_params=cpu)");
  if (o.param_buffer_count < 1)
    return fail(ErrorCode::invalid_argument, "param_buffer_count=", o.param_buffer_count, ": expected >= 1");
  return {};
}

Result<void> check_step_in_backward(const EngineOptions& o, const StepControlOptions& control) {
  if (!o.step_in_backward) return {};
  if (o.offload_optimizer == OffloadTarget::none)
    return fail(ErrorCode::invalid_argument, "step_in_backward with offload_optimizer=", to_string(o.offload_optimizer),
                ": steps the shards on the CPU as their gradients come (expected offload_optimizer=cpu or nvme)");
  if (o.zero_stage < 2)
    return fail(ErrorCode::invalid_argument, "step_in_backward with zero_stage=", o.zero_stage,
                ": the gradients are reduced after backward there (expected zero_stage 2 or 3)");
  if (control.max_grad_norm != 0.0f)
    return fail(ErrorCode::invalid_argument, "step_in_backward with max_grad_norm=", control.max_grad_norm,
                ": clipping needs the global norm, known only after backward (expected 0: no clipping)");
  if (control.loss_scaling != LossScaling::none)
    return fail(ErrorCode::invalid_argument, "step_in_backward with loss scaling: an overflow must be able to ",
                "skip the whole step (expected none)");
  return {};
}

std::string_view to_string(OffloadTarget t) noexcept {
  switch (t) {
    case OffloadTarget::none: return "none";
    case OffloadTarget::cpu: return "cpu";
    case OffloadTarget::nvme: return "nvme";
  }
  return "?";
}

std::vector<FetchUnitInfo> Engine::units() const {
  std::vector<FetchUnitInfo> out;
  for (const auto& u : s_->units) out.push_back(u->info);
  return out;
}

Result<std::unique_ptr<Engine>> Engine::create(Context& ctx, collectives::Communicator& comm, Module& model,
                                               Optimizer& optimizer, EngineOptions o) {
  if (o.zero_stage < 1 || o.zero_stage > 3)
    return fail(ErrorCode::invalid_argument, "zero_stage=", o.zero_stage,
                ": expected 1, 2 or 3 (stage 0 is the unsharded ParameterStore)");
  if (o.dtype != DataType::f32 && o.dtype != DataType::bf16 && o.dtype != DataType::f16)
    return fail(ErrorCode::invalid_argument, "Engine dtype ", collectives::to_string(o.dtype),
                ": expected f32, bf16 or f16");
  COSHARD_TRY(detail::check_supported(ctx.kernels(), o.dtype, ctx.device(), "Engine"));
  if (!(comm.stream().device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, "Engine: the communicator's stream runs on ",
                comm.stream().device().to_string(), ", the compute stream on ", ctx.device().to_string());

  auto s = std::make_unique<State>();
  s->ctx = &ctx;
  s->comm = &comm;
  s->model = &model;
  s->optimizer = &optimizer;
  s->o = o;
  s->rank = comm.rank();
  s->world = comm.size();
  s->element_size = size_of(o.dtype);
  s->first_group = optimizer.groups().size();
  // Units: modules with direct parameters, in execution (pre-order) order; small leaves merge.
  COSHARD_TRY_ASSIGN(auto plan, detail::plan_fetch_units(model, s->world, o));
  s->names = std::move(plan.names);
  s->largest_unit_bytes = plan.largest_unit_bytes;
  for (auto& planned : plan.units) {
    auto u = std::make_unique<Unit>();
    u->info = std::move(planned.info);
    u->modules = std::move(planned.modules);
    for (const auto& p : planned.parameters) u->params.push_back({p.parameter, p.offset});
    u->index = s->units.size();
    for (Module* m : u->modules) s->unit_of.emplace(m, u->index);
    s->units.push_back(std::move(u));
  }
  s->budget = std::make_shared<Budget>(o.max_live_bytes);

  COSHARD_TRY(check_offload_placement(o));
  COSHARD_TRY(check_step_in_backward(o, optimizer.control()));
  // A plan this machine cannot hold is refused with the numbers before anything is allocated
  // (activations come on top: a trainer checks those with the rest).
  if (o.check_memory) {
    COSHARD_TRY_ASSIGN(auto estimate, estimate_engine_memory(model, s->world, o, optimizer.state_tensors()));
    COSHARD_TRY_ASSIGN(auto machine, machine_memory(ctx.device(), o.offload_optimizer == OffloadTarget::nvme ? o.nvme_path
                                                                                                            : std::filesystem::path()));
    COSHARD_TRY(check_fits(estimate, 1, machine));
  }

  // Optimizer offload: its stream, context and pinned memory (checked against the budget now).
  if (s->offloaded()) {
    std::vector<FetchUnitInfo> infos;
    for (const auto& u : s->units) infos.push_back(u->info);
    const std::vector<std::size_t> sizes = detail::offload_pinned_sizes(infos, o, optimizer.state_tensors());
    std::size_t needed = 0, largest_shard = 0;
    const std::size_t per_element = 4 * (1 + optimizer.state_tensors());  // master and state, f32
    for (const auto& u : s->units)
      largest_shard = std::max(largest_shard, static_cast<std::size_t>(u->info.shard) * s->element_size);
    if (s->swapped() && o.nvme_path.empty())
      return fail(ErrorCode::invalid_argument, "offload_optimizer=nvme: needs a folder (nvme_path)");
    if (s->params_on_nvme()) s->read_slots = std::make_shared<Budget>(static_cast<std::size_t>(o.param_buffer_count));
    for (std::size_t b : sizes) needed += offload::page_rounded(b);
    offload::PinnedPoolOptions pool_options;
    pool_options.host_memory_budget = o.host_memory_budget == 0 ? needed : o.host_memory_budget;
    COSHARD_TRY_ASSIGN(s->pinned, offload::PinnedPool::create(pool_options));
    if (auto fits = s->pinned->reserve(sizes); !fits)
      return fail(std::move(fits).error().with_context(
          std::string(s->swapped() ? "offload_optimizer=nvme (gradient shards and swap buffers" : "offload_optimizer=cpu (fp32 master and gradient shards") +
          (s->params_on_nvme() ? ", parameter read buffers)" : o.offload_params == OffloadTarget::cpu && s->swapped() ? ", pinned parameter shards)" : ")")));
    async::StreamOptions host_options;
    host_options.name = "optimizer" + std::to_string(s->rank);
    COSHARD_TRY_ASSIGN(auto host_stream, async::Stream::create(async::Device::cpu(), host_options));
    s->host_stream = std::make_unique<async::Stream>(std::move(host_stream));
    COSHARD_TRY_ASSIGN(s->host_allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_TRY_ASSIGN(auto host_ctx, Context::create(*s->host_stream, *s->host_allocator));
    s->host_ctx = std::make_unique<Context>(std::move(host_ctx));
    if (s->staged()) {
      COSHARD_TRY_ASSIGN(s->staging, s->pinned->acquire(largest_shard));
    }
    if (s->swapped()) {
      const std::string rank_folder = "rank" + std::to_string(s->rank) + "-of-" + std::to_string(s->world);
      auto claimed = offload::SwapFolder::claim(o.nvme_path / rank_folder, "coshard rank " + std::to_string(s->rank) +
                                                                               " of " + std::to_string(s->world));
      if (!claimed) return fail(std::move(claimed).error().with_context("offload_optimizer=nvme"));
      s->swap_folder = std::move(*claimed);
      offload::NvmeStoreOptions store_options;
      store_options.directory = o.nvme_path;
      store_options.direct = offload::NvmeStore::supports_direct_io(o.nvme_path);
      COSHARD_TRY_ASSIGN(s->store, offload::NvmeStore::open(store_options));
      offload::SwapperOptions swap_options;
      swap_options.buffer_count = o.swap_buffer_count;
      COSHARD_TRY_ASSIGN(s->swapper, offload::Swapper::create(*s->store, s->pinned, swap_options));
      const std::string folder = rank_folder + "/unit";
      for (const auto& u : s->units)
        s->subgroups.push_back({folder + std::to_string(u->index), static_cast<std::size_t>(u->info.shard) * per_element});
    }
  }

  // Storage.
  auto& stream = ctx.stream();
  auto& alloc = ctx.allocator();
  for (auto& up : s->units) {
    Unit& u = *up;
    const auto shard_bytes = static_cast<std::size_t>(u.info.shard) * s->element_size;
    const Shape shard_shape{u.info.shard};
    const std::int64_t mine = static_cast<std::int64_t>(s->rank) * u.info.shard;
    if (s->params_offloaded()) {
      // Nothing on the device: the shard is the pinned master (set below), a pinned copy, or in
      // the swap file.
      if (o.offload_params == OffloadTarget::cpu && s->swapped()) {
        COSHARD_TRY_ASSIGN(u.host_param_block, s->pinned->acquire(shard_bytes));
        u.shard = Tensor(u.host_param_block.data(), shard_shape, o.dtype, async::Device::cpu());
      }
    } else if (s->stage3()) {
      COSHARD_TRY_ASSIGN(u.shard_block, alloc.allocate(shard_bytes, stream));
      u.shard = Tensor(u.shard_block.data(), shard_shape, o.dtype, ctx.device());
    } else {
      COSHARD_TRY_ASSIGN(u.full_block, alloc.allocate(u.info.padded_bytes, stream));
      u.full = Tensor(u.full_block.data(), Shape{u.info.padded}, o.dtype, ctx.device());
      COSHARD_TRY(stream.fill(u.full.data(), 0, u.info.padded_bytes));
      u.shard = u.full.slice(mine, shard_shape);
    }
    // Gradient shards are fp32 whatever the compute dtype (the optimizer reads them as they are).
    const auto grad_shard_bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);
    if (o.zero_stage == 1) {
      COSHARD_TRY_ASSIGN(u.grad_full_block, alloc.allocate(u.info.padded_bytes, stream));
      u.grad_full = Tensor(u.grad_full_block.data(), Shape{u.info.padded}, o.dtype, ctx.device());
      COSHARD_TRY(stream.fill(u.grad_full.data(), 0, u.info.padded_bytes));
    }
    if (o.zero_stage == 1 && o.dtype == DataType::f32) {
      u.grad_shard = u.grad_full.slice(mine, shard_shape);  // reduced in place: no copy
    } else {
      COSHARD_TRY_ASSIGN(u.grad_shard_block, alloc.allocate(grad_shard_bytes, stream));
      u.grad_shard = Tensor(u.grad_shard_block.data(), shard_shape, DataType::f32, ctx.device());
      COSHARD_TRY(stream.fill(u.grad_shard.data(), 0, grad_shard_bytes));
    }
    if (!s->stage3()) COSHARD_TRY(s->bind_values(u, u.full));
    if (s->offloaded()) {
      COSHARD_TRY_ASSIGN(u.host_grad_block, s->pinned->acquire(grad_shard_bytes));
      u.host_grad = Tensor(u.host_grad_block.data(), shard_shape, DataType::f32, async::Device::cpu());
    }
    if (s->swapped()) {
      COSHARD_TRY(optimizer.add_swapped_group(*s->host_ctx, u.host_grad));
    } else if (s->offloaded() && s->narrow()) {
      // bf16/f16: the group's parameters are a pinned copy in the compute dtype (the shard itself
      // when the parameters are offloaded); the optimizer makes the fp32 master.
      COSHARD_TRY_ASSIGN(u.host_param_block, s->pinned->acquire(shard_bytes));
      u.host_param = Tensor(u.host_param_block.data(), shard_shape, o.dtype, async::Device::cpu());
      if (s->params_offloaded()) u.shard = u.host_param;
      COSHARD_TRY(optimizer.add_group(*s->host_ctx, u.host_param, u.host_grad));
    } else if (s->offloaded()) {
      COSHARD_TRY_ASSIGN(u.host_master_block, s->pinned->acquire(shard_bytes));
      u.host_master = Tensor(u.host_master_block.data(), shard_shape, DataType::f32, async::Device::cpu());
      if (s->params_offloaded()) u.shard = u.host_master;  // f32: the master is the parameter
      COSHARD_TRY(optimizer.add_group(*s->host_ctx, u.host_master, u.host_grad));
    } else {
      COSHARD_TRY(optimizer.add_group(ctx, u.shard, u.grad_shard));
    }
  }
  if (s->offloaded()) {
    COSHARD_TRY_ASSIGN(s->device_loss_scale, ctx.zeros(Shape{1}, DataType::f32));
    COSHARD_TRY_ASSIGN(s->device_grad_stats, ctx.zeros(Shape{2}, DataType::f32));
    COSHARD_TRY_ASSIGN(s->grad_stats_back, s->pinned->acquire(2 * sizeof(float)));
  }
  if (s->timing()) {
    COSHARD_TRY_ASSIGN(s->epoch, stream.record_timed());
    COSHARD_TRY(s->streams_after_epoch());
  }
  s->gather_ms.assign(s->units.size(), -1.0);
  auto engine = std::unique_ptr<Engine>(new Engine(std::move(s)));
  ctx.set_hooks(engine.get());
  return engine;
}

async::Task<Result<void>> Engine::initialize(std::uint64_t seed) {
  State& s = *s_;
  COSHARD_CO_TRY(co_await s.compute_after_host());
  s.pending_shards.clear();
  for (auto& up : s.units) {
    Unit& u = *up;
    std::vector<double> values(static_cast<std::size_t>(u.info.padded), 0.0);
    for (const auto& p : u.params) {
      auto part = std::span<double>(values).subspan(static_cast<std::size_t>(p.offset),
                                                   static_cast<std::size_t>(p.parameter->numel()));
      initial_values(p.parameter->init(), s.names.at(p.parameter), seed, part);
    }
    // Stages 1-2 hold the whole unit; stage 3 only this rank's block.
    const auto first = s.stage3() ? static_cast<std::size_t>(s.rank * u.info.shard) : 0;
    const auto count = static_cast<std::size_t>(s.stage3() ? u.info.shard : u.info.padded);
    auto bytes = encode_values(std::span<const double>(values).subspan(first, count), s.o.dtype);
    if (s.params_on_nvme()) {
      s.pending_shards.push_back(std::move(bytes));  // straight into the swap files
      continue;
    }
    COSHARD_CO_TRY(s.ctx->copy_from_host(s.stage3() ? u.shard : u.full, bytes));
  }
  // The optimizer's fp32 masters (bf16/f16, or offloaded) follow the new parameters.
  COSHARD_CO_TRY(co_await s.masters_from_shards());
  co_return Result<void>{};
}

async::Task<Result<void>> Engine::before_forward(Context&, Module& module) {
  State& s = *s_;
  if (s.owns(module)) {
    if (s.open == State::Open::none)
      co_return fail(ErrorCode::invalid_argument, "Engine: forward of ", module.type_name(),
                     " outside a step or an inference pass (call begin_step or begin_inference first, or use "
                     "step / evaluate)");
    if (&module == s.model && s.open == State::Open::step && ++s.model_forwards > s.declared_micro_batches)
      co_return fail(ErrorCode::invalid_argument, "Engine: forward of micro-batch ", s.model_forwards,
                     " in a step begun with ", s.declared_micro_batches,
                     " (begin_step(micro_batches) declares the gradient accumulation up front)");
  }
  Unit* u = s.unit_for(module);
  if (!u || &module != u->modules.front()) co_return Result<void>{};
  ++u->forward_uses;
  if (s.stage3()) COSHARD_CO_TRY(co_await s.fetch(*u));
  if (s.spans_on()) {
    COSHARD_CO_TRY_ASSIGN(u->compute_start, s.ctx->stream().record_timed());
  }
  co_return Result<void>{};
}

Result<void> Engine::after_forward(Context&, Module& module) {
  State& s = *s_;
  Unit* u = s.unit_for(module);
  if (!u || &module != u->modules.back()) return {};
  if (s.spans_on()) {
    COSHARD_TRY_ASSIGN(auto end, s.ctx->stream().record_timed());
    s.span(true, "forward", u->info.name, std::move(u->compute_start), std::move(end), u->fetch_pos);
  }
  if (!s.stage3() || s.keep_after_use(*u)) return {};
  return s.release(*u);
}

async::Task<Result<void>> Engine::before_backward(Context&, Module& module) {
  State& s = *s_;
  if (s.owns(module)) {
    if (s.open != State::Open::step)
      co_return fail(ErrorCode::invalid_argument, "Engine: backward of ", module.type_name(), " outside a step",
                     s.open == State::Open::inference ? " (in an inference pass: forward only)" : " (call begin_step first)");
    if (&module == s.model) ++s.model_backwards;
  }
  Unit* u = s.unit_for(module);
  if (!u || &module != u->modules.back()) co_return Result<void>{};
  if (s.stage3()) COSHARD_CO_TRY(co_await s.fetch(*u));
  COSHARD_CO_TRY(s.begin_backward(*u));
  if (s.spans_on()) {
    COSHARD_CO_TRY_ASSIGN(u->compute_start, s.ctx->stream().record_timed());
  }
  co_return Result<void>{};
}

Result<void> Engine::after_backward(Context&, Module& module) {
  State& s = *s_;
  Unit* u = s.unit_for(module);
  if (!u || &module != u->modules.front()) return {};
  if (s.spans_on()) {
    COSHARD_TRY_ASSIGN(auto end, s.ctx->stream().record_timed());
    s.span(true, "backward", u->info.name, std::move(u->compute_start), std::move(end), u->fetch_pos);
  }
  COSHARD_TRY(s.reduce_gradients(*u));
  if (!s.stage3() || s.keep_after_use(*u)) return {};
  return s.release(*u);
}

async::Task<Result<EngineStepStats>> Engine::step(Loss& loss, std::span<const Batch> micro_batches,
                                                  float lr) {
  State& s = *s_;
  if (micro_batches.empty()) co_return fail(ErrorCode::invalid_argument, "Engine::step: no micro-batches");
  COSHARD_CO_TRY(co_await begin_step(static_cast<int>(micro_batches.size()), lr));
  for (const auto& mb : micro_batches) {
    auto value = co_await forward_backward(*s.ctx, *s.model, loss, mb.inputs, mb.targets, backward_seed());
    if (!value) {
      co_await abandon_step();
      co_return fail(std::move(value).error());
    }
    COSHARD_CO_TRY(add_loss(*value));
  }
  co_return co_await finish_step();
}

async::Task<void> Engine::end_swap_pass() {
  State& s = *s_;
  if (s.swap_step.valid()) {
    // The step failed before the swapper's pass was awaited: with the channel closed, the pass
    // stops at the first unit not handed over, and its transfers finish before the state goes.
    s.grads_ready.reset();
    auto handle = std::move(s.swap_step);
    (void)co_await handle;  // (its error, if any, follows from the step's)
  }
  s.grads_ready.reset();
}

async::Task<Result<void>> Engine::begin_step(int micro_batches, float lr) {
  State& s = *s_;
  if (s.open != State::Open::none)
    co_return fail(ErrorCode::invalid_argument, "Engine::begin_step: a ",
                   s.open == State::Open::step ? "step" : "inference pass", " is open (finish it first)");
  if (micro_batches < 1)
    co_return fail(ErrorCode::invalid_argument, "Engine::begin_step(micro_batches=", micro_batches, "): expected >= 1");
  Context& ctx = *s.ctx;
  auto& compute = ctx.stream();
  auto& cs = s.comm->stream();
  s.launches_before = s.comm->launches();
  s.begin_pass("train");
  s.open = State::Open::step;
  s.declared_micro_batches = micro_batches;
  s.model_forwards = s.model_backwards = s.losses_added = 0;

  // The communication stream goes after the last step's optimizer (it reads the shards).
  COSHARD_CO_TRY(State::order(compute, cs));
  s.grads_out_in_backward = s.offloaded() && s.o.zero_stage >= 2 && micro_batches == 1;
  s.stepping_in_backward = s.o.step_in_backward && s.grads_out_in_backward;
  s.step_lr = lr;
  if (s.stepping_in_backward) {
    if (!(lr >= 0)) {
      co_await abandon_step();
      co_return fail(ErrorCode::invalid_argument, "lr=", lr, ": expected >= 0");
    }
    COSHARD_CO_TRY(s.optimizer->begin_grad_stats(*s.host_ctx));
    s.handed_order.clear();
  }
  for (auto& u : s.units) {
    u->grads_this_step = 0;
    u->grads_out = false;
    u->forward_uses = 0;
    u->stepped_early = false;
    if (s.o.zero_stage == 1) COSHARD_CO_TRY(compute.fill(u->grad_full.data(), 0, u->info.padded_bytes));
  }
  if (s.offloaded()) {
    // Backward is seeded with the loss scale the host optimizer holds (it may have changed at the
    // last step, or with a checkpoint load).
    COSHARD_CO_TRY_ASSIGN(auto host_done, s.host_stream->record());
    COSHARD_CO_TRY(co_await State::after(compute, host_done));
    const Tensor scale = s.optimizer->loss_scale();
    COSHARD_CO_TRY(compute.copy(s.device_loss_scale.data(), scale.data(), scale.bytes()));
  }
  if (s.stepping_in_backward && s.swapped()) {  // the swapper's pass starts reading now
    async::Runtime* rt = async::Runtime::current();
    if (!rt) co_return fail(ErrorCode::invalid_argument, "Engine::step: must be awaited on a coshard Runtime");
    COSHARD_CO_TRY_ASSIGN(auto channel, async::make_channel<std::size_t>(s.units.size() + 1));
    s.grads_ready.emplace(std::move(channel.first));
    s.swap_step = rt->spawn(s.swapped_step_in_backward(std::move(channel.second), lr));
  }
  COSHARD_CO_TRY_ASSIGN(s.loss_sum, ctx.zeros(Shape{1}, DataType::f32));
  co_return Result<void>{};
}

Tensor Engine::backward_seed() const { return s_->backward_seed(); }

Result<void> Engine::add_loss(const Tensor& loss) {
  State& s = *s_;
  if (s.open != State::Open::step) return fail(ErrorCode::invalid_argument, "Engine::add_loss outside a step");
  if (!loss || loss.numel() != 1 || loss.dtype() != DataType::f32 || !(loss.device() == s.ctx->device()))
    return fail(ErrorCode::invalid_argument, "Engine::add_loss: ", loss ? loss.describe() : "empty",
                ", expected one f32 on ", s.ctx->device().to_string(), " (a loss's forward)");
  ++s.losses_added;
  return s.ctx->kernels().add(s.ctx->stream(), DataType::f32, s.loss_sum.data(), loss.data(), s.loss_sum.data(), 1);
}

async::Task<void> Engine::abandon_step() {
  State& s = *s_;
  if (s.open != State::Open::step) co_return;
  co_await end_swap_pass();
  s.model->clear_saved_recursive();
  (void)s.end_pass();
  s.open = State::Open::none;
}

async::Task<Result<EngineStepStats>> Engine::finish_step() {
  State& s = *s_;
  if (s.open != State::Open::step)
    co_return fail(ErrorCode::invalid_argument, "Engine::finish_step without begin_step");
  if (s.model_backwards < s.declared_micro_batches || s.model_forwards != s.model_backwards) {
    const int forwards = s.model_forwards, backwards = s.model_backwards, declared = s.declared_micro_batches;
    co_await abandon_step();
    co_return fail(ErrorCode::invalid_argument, "Engine::finish_step: ", backwards == 0 ? "no backward in this step: " : "",
                   forwards, " forward and ", backwards, " backward passes of the model in a step begun with ", declared,
                   " micro-batches (each needs one of each); the step is abandoned, nothing updated");
  }
  auto finished = co_await finish_open_step(s.step_lr);
  co_await end_swap_pass();
  s.open = State::Open::none;
  co_return finished;
}

async::Task<Result<EngineStepStats>> Engine::finish_open_step(float lr) {
  State& s = *s_;
  Context& ctx = *s.ctx;
  auto& compute = ctx.stream();
  auto& cs = s.comm->stream();
  const auto& k = ctx.kernels();
  Tensor loss_sum = s.loss_sum;
  const auto micro_batches = static_cast<std::size_t>(s.declared_micro_batches);
  // nvme parameters: no read may be left over when the optimizer rewrites the swap files.
  if (s.params_on_nvme()) COSHARD_CO_TRY(co_await s.drain_reads());

  // Gradients: stage 1 reduces everything now, in one launch; stages 2-3 did it per unit.
  COSHARD_CO_TRY(State::order(compute, cs));
  if (s.o.zero_stage == 1) {
    COSHARD_CO_TRY_ASSIGN(auto started, s.mark(cs));
    Coalesced group;
    for (auto& u : s.units) {
      Tensor mine = u->grad_full.slice(static_cast<std::int64_t>(s.rank) * u->info.shard, Shape{u->info.shard});
      group.reduce_scatter(u->grad_full.data(), mine.data(), static_cast<std::size_t>(u->info.shard), s.o.dtype,
                           ReduceOp::avg);
      s.stats.reduce_scattered_bytes += u->info.padded_bytes;
    }
    COSHARD_CO_TRY(s.comm->launch(group));
    if (s.o.dtype != DataType::f32)  // bf16/f16: the reduced blocks into the fp32 shards
      for (auto& u : s.units)
        COSHARD_CO_TRY(s.shard_from(*u, u->grad_full.slice(static_cast<std::int64_t>(s.rank) * u->info.shard,
                                                           Shape{u->info.shard}),
                                    u->grad_shard));
    COSHARD_CO_TRY_ASSIGN(auto finished, s.mark(cs));
    s.span(false, "reduce_scatter", kAllUnits, std::move(started), std::move(finished));
  } else {
    for (auto& u : s.units)  // units without a backward this step (unused parameters)
      if (u->grads_this_step == 0) COSHARD_CO_TRY(cs.fill(u->grad_shard.data(), 0, u->grad_shard.bytes()));
  }
  const auto K = static_cast<float>(micro_batches);
  if (micro_batches > 1)
    for (auto& u : s.units) COSHARD_CO_TRY(k.scale(cs, DataType::f32, u->grad_shard.data(), 1.0f / K, u->info.shard));
  COSHARD_CO_TRY(s.compute_waits_for_comm(kGradients));

  // The optimizer: local shards only; the norm and overflow flag are summed over ranks first.
  COSHARD_CO_TRY_ASSIGN(auto optimizer_started, s.mark(compute));
  if (!s.offloaded()) {
    COSHARD_CO_TRY(s.optimizer->compute_grad_stats(ctx));
    COSHARD_CO_TRY(State::order(compute, cs));
    const Tensor grad_stats = s.optimizer->grad_stats();
    COSHARD_CO_TRY(s.comm->all_reduce(grad_stats.data(), grad_stats.data(), 2, DataType::f32, ReduceOp::sum));
    COSHARD_CO_TRY(s.compute_waits_for_comm(kGradStats));
    COSHARD_CO_TRY(s.optimizer->apply(ctx, lr));
  } else {
    // Offloaded: gradient shards out to pinned memory, the step on the CPU stream (the same
    // kernels and order as on a CPU device), the updated shards back.
    auto& host = *s.host_stream;
    for (auto& u : s.units) {
      if (u->grads_out) continue;  // out during backward (the compute stream has waited for it)
      COSHARD_CO_TRY(compute.copy(u->host_grad.data(), u->grad_shard.data(), u->grad_shard.bytes()));
      s.stats.swap_bytes += u->grad_shard.bytes();
    }
    COSHARD_CO_TRY_ASSIGN(auto grads_out, compute.record());
    COSHARD_CO_TRY(host.wait(grads_out));
    if (s.stepping_in_backward) {  // the units not stepped yet add their share
      for (auto& u : s.units) {
        if (u->stepped_early) continue;
        COSHARD_CO_TRY(s.optimizer->add_grad_stats(*s.host_ctx, s.first_group + u->index));
        if (s.swapped()) COSHARD_CO_TRY(s.hand_to_swap_step(*u));  // stepped by the swapper's pass
      }
      s.grads_ready.reset();  // every unit is handed over
    } else {
      COSHARD_CO_TRY(s.optimizer->compute_grad_stats(*s.host_ctx));
    }
    COSHARD_CO_TRY_ASSIGN(auto stats_ready, host.record());
    COSHARD_CO_TRY(co_await State::after(compute, stats_ready));
    const Tensor host_stats = s.optimizer->grad_stats();
    COSHARD_CO_TRY(compute.copy(s.device_grad_stats.data(), host_stats.data(), host_stats.bytes()));
    COSHARD_CO_TRY(State::order(compute, cs));
    COSHARD_CO_TRY(s.comm->all_reduce(s.device_grad_stats.data(), s.device_grad_stats.data(), 2, DataType::f32,
                                      ReduceOp::sum));
    COSHARD_CO_TRY(s.compute_waits_for_comm(kGradStats));
    COSHARD_CO_TRY(compute.copy(s.grad_stats_back.data(), s.device_grad_stats.data(), host_stats.bytes()));
    COSHARD_CO_TRY_ASSIGN(auto stats_back, compute.record());
    COSHARD_CO_TRY(host.wait(stats_back));
    COSHARD_CO_TRY(host.copy(host_stats.data(), s.grad_stats_back.data(), host_stats.bytes()));
    if (!s.swapped()) {
      if (s.stepping_in_backward) {
        for (auto& u : s.units)
          if (!u->stepped_early) COSHARD_CO_TRY(s.optimizer->apply_one(*s.host_ctx, s.first_group + u->index, lr));
        COSHARD_CO_TRY(s.optimizer->finish_step(*s.host_ctx));
      } else {
        COSHARD_CO_TRY(s.optimizer->apply(*s.host_ctx, lr));
      }
      COSHARD_CO_TRY_ASSIGN(auto stepped, host.record());
      COSHARD_CO_TRY(co_await State::after(compute, stepped));
      for (auto& u : s.units) {
        // (bf16/f16: the optimizer wrote the pinned copy in the compute dtype)
        const Tensor& stepped_shard = s.narrow() ? u->host_param : u->host_master;
        if (u->shard.data() == stepped_shard.data()) continue;  // parameters offloaded: it is the shard
        COSHARD_CO_TRY(compute.copy(u->shard.data(), stepped_shard.data(), u->shard.bytes()));
        s.stats.swap_bytes += u->shard.bytes();
      }
    } else if (s.stepping_in_backward) {
      // The swapper's pass has every unit now; its last copies to the device are on the
      // communication stream, which the compute stream waits for below.
      auto handle = std::move(s.swap_step);
      COSHARD_CO_TRY(co_await handle);
      s.backward_order = s.handed_order;
      COSHARD_CO_TRY(s.optimizer->finish_step(*s.host_ctx));
      COSHARD_CO_TRY_ASSIGN(auto finished, host.record());
      COSHARD_CO_TRY(co_await State::after(compute, finished));
      COSHARD_CO_TRY(State::order(cs, compute));
    } else {
      // Each unit's master and state come in from NVMe (read ahead), are stepped on the host,
      // the new shard goes to the device, and the sub-group goes back (written behind).
      const auto read_before = s.swapper->stats().bytes_read, written_before = s.swapper->stats().bytes_written;
      auto step_unit = [&](std::size_t k, std::span<std::byte> bytes) -> async::Task<Result<void>> {
        return s.step_swapped_unit(k, bytes, lr, compute);
      };
      COSHARD_CO_TRY(co_await s.swapper->for_each(s.subgroups, step_unit, true));
      COSHARD_CO_TRY(s.optimizer->finish_step(*s.host_ctx));
      COSHARD_CO_TRY_ASSIGN(auto finished, host.record());
      COSHARD_CO_TRY(co_await State::after(compute, finished));
      s.stats.swap_bytes += (s.swapper->stats().bytes_read - read_before) + (s.swapper->stats().bytes_written - written_before);
    }
  }
  COSHARD_CO_TRY_ASSIGN(auto optimizer_finished, s.mark(compute));
  s.span(true, "optimizer", kOptimizer, std::move(optimizer_started), std::move(optimizer_finished));

  // The loss, averaged over micro-batches and ranks.
  // (the losses the loop added: when it added fewer than its micro-batches, their mean still)
  const float added = static_cast<float>(std::max(s.losses_added, 1));
  if (added > 1) COSHARD_CO_TRY(k.scale(compute, DataType::f32, loss_sum.data(), 1.0f / added, 1));
  COSHARD_CO_TRY(State::order(compute, cs));
  COSHARD_CO_TRY(s.comm->all_reduce(loss_sum.data(), loss_sum.data(), 1, DataType::f32, ReduceOp::avg));

  // Stages 1-2: every rank gets the updated parameters, in one launch.
  if (!s.stage3()) COSHARD_CO_TRY(s.gather_full_copies());
  COSHARD_CO_TRY(s.compute_waits_for_comm(kParameters));
  COSHARD_CO_TRY(s.end_pass());

  const std::uint64_t launches = s.comm->launches() - s.launches_before;
  COSHARD_CO_TRY_ASSIGN(auto host_loss, co_await ctx.read(loss_sum));
  COSHARD_CO_TRY_ASSIGN(auto optimizer_stats, co_await s.optimizer->read_stats(s.optimizer_ctx()));
  if (s.stepping_in_backward && optimizer_stats.last_skipped) {
    auto refused = s.step_in_backward_saw_non_finite();
    co_return fail(std::move(refused).error());
  }
  // Every event of the step has passed now (the reads came after all of it): read the timings.
  s.collect_timing();
    COSHARD_CO_TRY(co_await s.agree_on_measurements());
  EngineStepStats stats = std::move(s.stats);
  s.stats = {};
  stats.collective_launches = launches;
  stats.loss = host_loss[0];
  stats.optimizer = optimizer_stats;
  co_return stats;
}

Result<void> Engine::begin_inference() {
  State& s = *s_;
  if (s.open != State::Open::none)
    return fail(ErrorCode::invalid_argument, "Engine::begin_inference: a ",
                s.open == State::Open::step ? "step" : "inference pass", " is open (finish it first)");
  s.begin_pass("eval");
  s.open = State::Open::inference;
  return State::order(s.ctx->stream(), s.comm->stream());
}

async::Task<Result<void>> Engine::end_inference() {
  State& s = *s_;
  if (s.open != State::Open::inference)
    co_return fail(ErrorCode::invalid_argument, "Engine::end_inference without begin_inference");
  s.open = State::Open::none;
  s.model->clear_saved_recursive();
  COSHARD_CO_TRY(s.end_pass());
  if (s.params_on_nvme()) COSHARD_CO_TRY(co_await s.drain_reads());
  co_return Result<void>{};
}

async::Task<Result<double>> Engine::evaluate(Loss& loss, const Batch& batch) {
  State& s = *s_;
  Context& ctx = *s.ctx;
  COSHARD_CO_TRY(begin_inference());
  // The forward and the mean over ranks; the pass ends whether they worked or not.
  auto value = co_await [&]() -> async::Task<Result<Tensor>> {
    COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(*s.model, batch.inputs));
    loss.set_targets(batch.targets);
    COSHARD_CO_TRY_ASSIGN(Tensor v, co_await ctx.forward(loss, std::move(logits)));
    COSHARD_CO_TRY(State::order(ctx.stream(), s.comm->stream()));
    COSHARD_CO_TRY(s.comm->all_reduce(v.data(), v.data(), 1, DataType::f32, ReduceOp::avg));
    COSHARD_CO_TRY(State::order(s.comm->stream(), ctx.stream()));
    co_return v;
  }();
  loss.clear_saved();
  auto ended = co_await end_inference();
  if (!value) co_return fail(std::move(value).error());
  COSHARD_CO_TRY(ended);
  COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx.read(*value));
  s.collect_timing();  // the eval trace's measurements, for adaptive prefetch
  s.stats = {};
  COSHARD_CO_TRY(co_await s.agree_on_measurements());
  co_return host[0];
}

}  // namespace coshard::modules
