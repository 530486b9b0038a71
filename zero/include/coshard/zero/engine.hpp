// The ZeRO engine: a model's parameters split into fetch units and sharded across ranks, with
// every fetch, prefetch and release an awaitable step of the training loop.
//
// Fetch units: the direct parameters of one module form a unit; consecutive leaf units smaller
// than module_granularity_bytes are coalesced into one (thousands of tiny modules must not cost
// thousands of collectives). A unit's parameters are flattened into one buffer, padded to a
// multiple of the world size and split evenly in rank-major order, so an all-gather writes every
// parameter in place: the parameter views are pointer arithmetic on the gathered buffer, never a
// copy. Every rank owns the same number of elements.
//
// Stages: 0 shards nothing (plain data parallelism: every rank holds the whole of every unit,
// its gradient and its optimizer state; each unit's gradient is all-reduced, averaged, as soon as
// its backward is done, overlapped with the backward of the units before it; no offload);
// 1 shards the optimizer state (full parameters and gradients on every rank; one
// coalesced reduce-scatter of all gradients after the last micro-batch, one all-gather of the
// updated shards after the step); 2 also shards gradients (each unit's gradient is
// reduce-scattered, averaged, into the rank's shard as soon as its backward is done, and the full
// gradient buffer goes behind that collective's event); 3 also shards parameters (a unit is
// gathered when a module of it is about to run, and released after its last use).
//
// Hybrid sharding (shard_group_size, shard_group_size_of; stages 1-3): a unit is sharded over a
// group of consecutive ranks instead of the world, and each group holds a copy of every block.
// The groups' communicators are split from the world's once, in create; their collectives are
// ordered within the world communicator's stream, so everything below holds unchanged: within
// a group for gathers and reduce-scatters, across the copies for one all-reduce of each reduced
// block. The optimizer steps every copy alike; the norm counts copy 0 only; a checkpoint writes
// copy 0 only.
//
// Stage 3 in detail: `before_forward` awaits the unit's fetch: nothing if it is gathered; if its
// gather is in flight the compute stream waits on its event (the host does not); otherwise it
// takes the unit's bytes from the max_live_bytes budget (an async semaphore: waits, never
// over-admits), allocates, and issues one collective on the communication stream. Before that
// wait, units further along the recorded trace are gathered ahead, up to prefetch_bucket_bytes
// and only with budget to spare. A unit is released after its last module: an event is recorded
// on the compute stream, and its memory and budget come back only when that event completes.
// The first step records the order of fetches; a step that departs from it fetches on demand
// and its order becomes the trace. Traces are kept per phase ("train", "eval").
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/semaphore.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/mesh.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/optimizer.hpp"
#include "coshard/zero/checkpoint.hpp"
#include "coshard/zero/engine_options.hpp"

namespace coshard::zero {

// The model side the engine works on (coshard::modules), named here without the prefix.
using modules::Batch;
using modules::Context;
using modules::DataType;
using modules::Loss;
using modules::Module;
using modules::ModuleHooks;
using modules::Optimizer;
using modules::OptimizerStats;
using modules::Parameter;
using modules::Shape;
using modules::StepControlOptions;
using modules::Tensor;

// One span of a step's timeline, in milliseconds from the engine's timeline epoch.
struct TimelineSpan {
  std::string track;     // "compute", "comm", or (NVMe offload) "nvme read" and "nvme write"
  std::string category;  // forward, backward, wait, release, fetch, prefetch, reduce_scatter, ...
  std::string name;      // the unit, or the step phase
  double start_ms = 0;
  double end_ms = 0;     // == start_ms for instants (release)
};

struct FetchUnitInfo {
  std::string name;                     // the first module's path
  std::vector<std::string> parameters;  // full names, in buffer order
  std::int64_t numel = 0;               // parameters' elements
  // Sharded stages (1-3): numel rounded up to a multiple of shard_ranks, and padded /
  // shard_ranks. Stage 0 shards nothing: padded == shard == numel on every rank.
  std::int64_t padded = 0;
  std::int64_t shard = 0;
  std::size_t padded_bytes = 0;
  bool persistent = false;
  // Every parameter of the unit is frozen (Parameter::trainable): it has no gradient, no
  // reduction, no fp32 master and no optimizer state, and a checkpoint keeps its parameters only.
  bool frozen = false;
  // Its parameters are tensor-parallel parts (Parameter::split): each tensor rank holds other
  // values. A unit is all parts or all replicated parameters.
  bool tensor_split = false;
  // The ranks it is sharded over (its shard group: the world unless hybrid sharding says less;
  // 1 at stage 0). Each of the world / shard_ranks groups holds a copy of every block.
  int shard_ranks = 1;
  // This rank's shard lives off the device (offload_params; with a device_memory_budget, only the
  // units whose shards did not fit on the device).
  bool shard_offloaded = false;
  // This rank's optimizer state of the unit lives off the device and steps on the host
  // (offload_optimizer; with a device_memory_budget and offload_optimizer=cpu, only the units
  // whose state did not fit on the device). Frozen units have none: as offload_optimizer says.
  bool optimizer_offloaded = false;
  // Stage 3: its gathers for compute carry int8 blocks of this many elements (quantize_weights,
  // or quantize_frozen_weights and frozen); 0: exact.
  std::int64_t gather_int8_block = 0;
  // Stages 2-3: its gradient's reduction carries quantized blocks of this many elements
  // (quantize_gradients, int8 or int4, for a unit that trains over more than one rank); 0: exact.
  std::int64_t reduce_quant_block = 0;
  // Stage 3: the step's later gathers of it go within groups of this many ranks from the slices
  // kept at its first (secondary_partition_ranks); 0: none (its group is no larger).
  int secondary_ranks = 0;
  // Made of a mixture-of-experts layer's experts alone (modules::SparseMoe): gathered and reduced
  // only in the passes some rank routes a token to it, off the trace, ahead once announced.
  bool routed = false;
  // Expert parallelism: its parameters are experts one rank of every `expert_parallel` holds
  // (Parameter::expert_parallel): the runs of world / expert_parallel consecutive ranks hold other
  // experts, each run shards its own over shard_ranks of its ranks, and their gradients are
  // reduced within the run alone. 1: every rank's plan holds it.
  int expert_parallel = 1;
};

// This rank's share of one unit, as views of the engine's state (valid while a visit_shards
// visitor runs): what a sharded checkpoint saves and loads.
struct UnitShard {
  FetchUnitInfo info;
  Tensor params;  // this rank's block of the unit, elements [b * shard, (b + 1) * shard), b its place in the shard group
  Tensor master;  // its fp32 master (the same memory as params when the dtype is f32 on the device)
  Tensor state1;  // Adam's first moment / SGD's momentum (empty when the optimizer keeps none)
  Tensor state2;  // Adam's second moment (empty for SGD)
};

// Which tensors every UnitShard of an engine holds (known before any visit).
struct ShardLayout {
  bool master = false;  // a master apart from params (bf16/f16, or offloaded optimizer)
  int states = 0;       // 0, 1 (state1) or 2 (state1 and state2)
};

// One parameter's whole value, unpadded, in the engine dtype (host bytes).
struct GatheredParameter {
  std::string name;
  Shape shape;
  std::vector<std::byte> bytes;
};

// Where a step's time went, from the end of the previous finish_step (the first step: from its
// begin_step) to the end of this one. Read from counters the streams and the store keep: no wait.
struct StepTimeSplit {
  double wall_ms = 0;  // the interval, on the host's clock
  // The compute stream running the model's kernels, and with the optimizer offloaded the host
  // stream running its step: CPU streams measure it; CUDA streams do not (nullopt).
  std::optional<double> compute_ms, optimizer_ms;
  // NVMe offload (parameters or optimizer state): bytes read and written, and how long reads,
  // writes, and either were in flight (reads and writes overlap: busy_ms <= read_ms + write_ms).
  bool nvme = false;
  std::uint64_t nvme_read_bytes = 0, nvme_written_bytes = 0;
  double nvme_read_ms = 0, nvme_write_ms = 0, nvme_busy_ms = 0;
  // The compute stream idle: waiting for reads, gathers, the optimizer or the host.
  std::optional<double> compute_idle_ms() const noexcept {
    if (!compute_ms) return std::nullopt;
    return wall_ms > *compute_ms ? wall_ms - *compute_ms : 0.0;
  }
};

struct EngineStepStats {
  double loss = 0;                    // mean over micro-batches and ranks
  std::uint64_t fetches = 0;          // stage 3: units awaited by a module
  std::uint64_t prefetch_hits = 0;    // of those, already gathered or in flight
  std::uint64_t gathers = 0;          // collectives issued to gather units
  std::uint64_t collective_launches = 0;
  std::uint64_t gathered_bytes = 0;         // parameter bytes received by all-gathers (padded units; int8 blocks and scales where quantized)
  // Of `gathers`, those within the secondary partition's group (secondary_partition_ranks), and
  // the bytes they received (not in gathered_bytes: these stay within a node).
  std::uint64_t secondary_gathers = 0;
  std::uint64_t secondary_gathered_bytes = 0;
  std::uint64_t reduce_scattered_bytes = 0; // gradient bytes put into reduce-scatters
  std::uint64_t swap_bytes = 0;             // offload: gradient shards out, parameter shards back, state and parameter shards read and written
  std::uint64_t stepped_in_backward = 0;    // step_in_backward: units stepped on the host during backward
  std::size_t peak_live_bytes = 0;    // most gathered bytes held at once (stage 3)
  std::size_t peak_prefetched_bytes = 0;  // most bytes gathered ahead of use at once (the prefetch depth)
  // Activation memory: the most bytes of tensors the compute context made (activations, their
  // gradients, the layers' temporaries) held at once during the step (Context::activation_memory;
  // activation checkpointing lowers it).
  std::size_t peak_activation_bytes = 0;
  bool trace_changed = false;         // the order departed from the recorded trace
  // Time the compute stream stood waiting on communication (gathers, and the reductions and
  // gathers at the end of the step), from device timestamps. Empty unless options.timing.
  std::optional<double> exposed_comm_ms;
  std::vector<TimelineSpan> timeline;  // options.record_timeline
  StepTimeSplit time_split;
  OptimizerStats optimizer;
  double hit_rate() const noexcept {
    return fetches == 0 ? 1.0 : static_cast<double>(prefetch_hits) / static_cast<double>(fetches);
  }
};

class Engine final : public ModuleHooks {
 public:
  // Builds the units of `model` and this rank's shards on ctx's device. The context, the
  // communicator, the model and the optimizer must outlive the engine; the engine installs
  // itself as the context's hooks.
  static Result<std::unique_ptr<Engine>> create(Context& ctx, collectives::Communicator& comm, Module& model,
                                                Optimizer& optimizer, EngineOptions options);
  // Over a mesh: ZeRO over this rank's data group (hybrid sharding as the mesh says), the norm over
  // its tensor group too (EngineOptions::tensor_parallel). Refused when the options name a shard
  // group size or tensor group of their own that differ from the mesh's (0 takes the mesh's).
  static Result<std::unique_ptr<Engine>> create(Context& ctx, const collectives::Mesh& mesh, Module& model,
                                                Optimizer& optimizer, EngineOptions options);
  ~Engine() override;

  // The same initial weights as ParameterStore::initialize with this seed, at any world size.
  async::Task<Result<void>> initialize(std::uint64_t seed);
  // A loop of your own (FSDP2's shape: shard once, then an ordinary loop):
  //
  //   co_await engine.begin_step(micro_batches, lr);        // gradients reset, trace and prefetch armed
  //   for (const auto& mb : batches) {                      // exactly micro_batches times
  //     loss.set_targets(mb.targets);                       // first: a fused output layer takes them
  //     auto out = co_await ctx.forward(model, mb.inputs);  // units gathered as modules run
  //     auto value = co_await ctx.forward(loss, *out);
  //     auto dout = co_await ctx.backward(loss, engine.backward_seed());
  //     co_await ctx.backward(model, *dout);                // gradients reduced as units finish
  //     engine.add_loss(*value);                            // for the step's mean loss
  //   }
  //   auto stats = co_await engine.finish_step();           // reductions, the optimizer, gathers
  //
  // Everything step() does happens inside these calls, at every stage and offload. Misuse is a
  // named error, never a wrong update: a forward of the model outside a step or an inference
  // pass, a backward outside a step, more forwards than micro_batches, a finish_step without
  // a backward for every micro-batch (the step is then abandoned: nothing updated), a second
  // begin_step while one is open. `abandon_step` drops an open step (after a failed forward,
  // say); the next begin_step starts clean.
  //
  // A unit whose parameters got no gradient on any rank in a step (a branch the model skipped)
  // is left untouched by the optimizer: no decay, no moment update, as PyTorch leaves a parameter
  // whose gradient is None. At stage 1, which allows a branch run by some ranks only, the ranks
  // agree on which units none used through one all-reduce of a flag per unit.
  async::Task<Result<void>> begin_step(int micro_batches, float lr);
  // The seed of the loss's backward: the loss scale (one f32 on the device; 1 without scaling).
  Tensor backward_seed() const;
  // Adds one micro-batch's loss (one f32 on the device) into the step's mean (no host wait).
  Result<void> add_loss(const Tensor& loss);
  async::Task<Result<EngineStepStats>> finish_step();
  async::Task<void> abandon_step();
  // A forward-only pass of your own (under the "eval" trace): the model may run between them.
  Result<void> begin_inference();
  async::Task<Result<void>> end_inference();

  // Forward and backward of every micro-batch (gradients averaged over them and over ranks),
  // then one optimizer step on this rank's shards: the loop above, with `loss`.
  async::Task<Result<EngineStepStats>> step(Loss& loss, std::span<const Batch> micro_batches, float lr);
  // Forward only, in an inference pass; returns the mean loss over ranks.
  async::Task<Result<double>> evaluate(Loss& loss, const Batch& batch);

  std::vector<FetchUnitInfo> units() const;
  int rank() const noexcept;
  int world_size() const noexcept;
  // Steps finished (finish_step calls that returned statistics, skipped steps included), or the
  // step of the checkpoint loaded last: the step a save records, and a schedule's position.
  std::int64_t steps_done() const noexcept;

  // Sharded checkpoints of everything a step depends on (parameters, fp32 masters, optimizer
  // moments and step state, the step count), wherever the placements keep it; checkpoint.hpp has
  // the layout and the protocol. Every rank calls these at the same point, outside a step or an
  // inference pass, with the same `dir`.
  //
  // Starts a checkpoint of steps_done() under `dir`: this rank's blocks are staged now, its file
  // written behind training; a pending one is published first. It is published by the next
  // finish_checkpoint, save_checkpoint or load_checkpoint, or by the begin_step of the second
  // step after it.
  async::Task<Result<void>> save_checkpoint(const std::filesystem::path& dir, CheckpointOptions options = {});
  // Publishes the pending checkpoint, if any: every rank's file written, then the manifest and
  // `latest` (rank 0). An error names the rank that failed; nothing is published then.
  async::Task<Result<void>> finish_checkpoint();
  // Loads `dir/latest` (or `dir` itself when it is one checkpoint folder), saved at any world
  // size. Each rank reads and checks its part (manifest, sizes, CRC-32, dtype, optimizer, units,
  // options.run against the saved run); nothing changes on any rank unless every rank's part
  // passed. The engine needs no initialize before it.
  async::Task<Result<void>> load_checkpoint(const std::filesystem::path& dir, const CheckpointOptions& options = {});
  // The whole model as one safetensors file at `path` (rank 0 writes it; every rank gathers):
  // every parameter by name, unpadded, in the engine's dtype.
  async::Task<Result<void>> export_safetensors(const std::filesystem::path& path);
  // Every parameter from a safetensors file by name (any float dtype, converted; each finite):
  // load_parameters with the file's values. A LoRA adapter's parameters (apply_lora's) the file
  // has no value for keep theirs: a base model's file loads under its adapters.
  async::Task<Result<void>> load_safetensors(const std::filesystem::path& path);

  // The same for a file format of your own. `write` gets every parameter's whole value (rank 0
  // alone calls it, on the blocking pool; every rank returns its outcome). `read` gives whole
  // values in the engine's dtype (every rank calls it, on the blocking pool); they are checked
  // (names, shapes, finite) and loaded only when every rank's read and check passed; LoRA
  // adapters' parameters `read` leaves out keep their values, as in load_safetensors. `what`
  // names the operation in errors.
  using ParameterWriter = std::function<Result<void>(const std::vector<GatheredParameter>&)>;
  using ParameterReader = std::function<Result<std::vector<GatheredParameter>>()>;
  async::Task<Result<void>> export_parameters(std::string what, ParameterWriter write);
  async::Task<Result<void>> load_parameters_from(std::string what, ParameterReader read);
  // The same for a part of the model: the parameters `kept` names may be left out of what `read`
  // gives, and keep their values (a PEFT folder's adapters over the base: every base parameter
  // kept). Whole values, cut into this rank's parts under tensor parallelism.
  using ParameterFilter = std::function<bool(const modules::Parameter&)>;
  async::Task<Result<void>> load_parameters_from(std::string what, ParameterReader read, ParameterFilter kept);

  // What checkpoints are made of (for a format of your own). `visit_shards` awaits `use` on this
  // rank's block of every unit in order, with its optimizer state: views of device memory, of
  // pinned memory (optimizer offload), or, with nvme offload, of a swap buffer read from the
  // store just before (the next ones read ahead). `use` must finish with the views (await its
  // copies) before it returns. With `written`, `use` wrote new values: the swapped state goes back
  // to the store behind the visit and, at the end, stages 1-2 gather every rank's updated block
  // into the full copies. The first error ends the visit; everything in flight finishes first.
  using ShardVisitor = std::function<async::Task<Result<void>>(const UnitShard&)>;
  async::Task<Result<void>> visit_shards(ShardVisitor use, bool written);
  ShardLayout shard_layout() const noexcept;
  // Every parameter's whole value, unpadded, on every rank: one all-gather per unit (stage 3;
  // stages 1-2 hold the full values already). For exporting a consolidated model.
  async::Task<Result<std::vector<GatheredParameter>>> gather_parameters();
  // Fails, on every rank alike, when a weight is no longer finite, naming how many and the first
  // one's parameter and element (a gather of every parameter: for when a loss was not finite).
  async::Task<Result<void>> check_parameters_finite();
  // Sets every parameter from whole values by name (each rank keeps its block); a missing,
  // extra or reshaped name is refused before anything changes. The fp32 masters follow.
  async::Task<Result<void>> load_parameters(const std::vector<GatheredParameter>& values);
  const EngineOptions& options() const noexcept;
  // Units with their gather in flight right now (for tests of prefetch).
  std::size_t units_in_flight() const noexcept;
  // Timeline spans are measured from this timed event (by default one recorded on the compute
  // stream when the engine was made). Ranks that share a clock (CPU streams) can share one, so
  // their timelines line up.
  Result<void> set_timeline_epoch(async::Event epoch);

  // ModuleHooks
  async::Task<Result<void>> before_forward(Context& ctx, Module& module) override;
  Result<void> after_forward(Context& ctx, Module& module) override;
  async::Task<Result<void>> before_backward(Context& ctx, Module& module) override;
  Result<void> after_backward(Context& ctx, Module& module) override;
  // Names the parameters `module` read while their unit was not gathered (an undeclared read of
  // another module's parameter at stage 3), with both modules, before the error itself.
  Error explain_failure(Module& module, Error error) override;
  // A tensor-parallel layer's sum: the compute stream's wait, timed as exposed communication.
  Result<void> wait_for_collective(Context& ctx, const async::Event& done, const std::string& what) override;
  async::Task<Result<void>> agree_on_union(Context& ctx, std::span<double> chosen, const std::string& what) override;
  void announce_next(Context& ctx, std::span<Module* const> modules) override;

  struct State;

 private:
  explicit Engine(std::unique_ptr<State> state);
  async::Task<Result<EngineStepStats>> finish_open_step(float lr);
  // Ends the swapper's pass of step_in_backward (when a step fails before it was awaited).
  async::Task<void> end_swap_pass();
  std::unique_ptr<State> s_;
};

}  // namespace coshard::zero
