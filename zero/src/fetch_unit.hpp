// A fetch unit: the engine's grain. One module's parameters (or several small modules' together,
// EngineOptions::module_granularity_bytes) flattened into one buffer, padded to a multiple of its
// shard group's size and split rank-major, so a gather lands every parameter in place and each
// parameter is a view of the buffer. The engine is its units, the strategies chosen once that act
// on them (parameter_residence.hpp, gradient_reduction.hpp, optimizer_placement.hpp,
// shard_placement.hpp), and the step's clock.
//
// A unit's life:
//
//   planned    at Engine::create (fetch_units.cpp): its modules, its parameters and their offsets,
//              its shard group (the world, or a group of hybrid sharding), whether it trains, where
//              its shard and its optimizer state live (FetchUnitInfo).
//   sharded    this rank keeps its block (`shard`: a buffer of its own at stage 3, a view of the
//              whole copy `full` at stages 1-2, the whole unit at stage 0), with its fp32 master
//              and optimizer state where the optimizer placement keeps them.
//   gathered   (stage 3) before a module of it runs: budget taken from max_live_bytes, the shards
//              of its group gathered into `gathered` on the communication stream (gather_into),
//              the compute stream waiting for that event, never the host. Along the trace of
//              the last pass the next units are gathered ahead (Gather::in_flight, then ready).
//   released   after its last use of the pass unless kept: its memory and budget come back once
//              the compute stream has passed that use (Gather::released).
//   reduced    as its backward ends (its last use of the micro-batch): its whole gradient
//              `grad_full` reduce-scattered within its group and all-reduced across copies (or
//              all-reduced at stage 0, or kept for one launch after backward at stage 1), and
//              the reduced block added into its fp32 gradient shard `grad_shard`.
//   stepped    the optimizer updates this rank's block where its state lives (the device, a CPU
//              stream, the swapper's pass over NVMe), and the new values reach where the
//              parameters reside (in place; the whole copies after the step; the next gather).
//
// Its operations act through what they are given (UnitIo: the compute context, the world
// communicator whose one communication stream orders every collective, the compute dtype), never
// through the engine's state. Private: not installed.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coshard/async/event.hpp"
#include "coshard/async/join_handle.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/semaphore.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/module.hpp"
#include "coshard/offload/pinned_pool.hpp"
#include "coshard/zero/engine.hpp"
#include "kernels/kernel_args.hpp"
#include "shard_groups.hpp"

namespace coshard::zero::detail {

using modules::Module;
using modules::Parameter;
using modules::Tensor;

enum class Gather : std::uint8_t { released, in_flight, ready };

// What a unit's operations act through: the compute context (its stream, memory and kernels), the
// world communicator (its stream orders every collective, the shard groups' too), the compute
// dtype. Made once by the engine.
struct UnitIo {
  modules::Context& ctx;
  collectives::Communicator& world;
  modules::DataType dtype;
  std::size_t element_size() const noexcept { return modules::size_of(dtype); }
};

class FetchUnit {
 public:
  FetchUnitInfo info;
  std::vector<Module*> modules;  // forward order
  struct Param {
    Parameter* parameter;
    std::int64_t offset;  // elements into the unit's buffer
    std::size_t module = 0;  // coalesced: its module's place in `modules`
    // Steps it was left out of (no gradient): PyTorch counts each parameter's own steps, which its
    // AdamW bias correction follows (Optimizer::set_group_steps_missed). Saved in checkpoints.
    std::int32_t steps_missed = 0;
    bool left_out = false;  // this step
  };
  std::vector<Param> params;
  // A unit of several modules (small leaves coalesced): any of them may be skipped in a pass (a
  // branch not taken). The unit opens at the first of its modules to run and closes after the
  // last that ran (hooks.cpp), and a module that got no gradient in a step is left untouched
  // while the rest of the unit steps (PyTorch's rule is per parameter, not per unit).
  struct ModuleRun {
    std::int64_t begin = 0, end = 0;  // its parameters' elements in the unit's buffer
    bool used = false;                // its backward ran this step (on this rank)
  };
  std::vector<ModuleRun> module_runs;  // per modules[k]; empty for a unit of one module
  bool coalesced() const noexcept { return modules.size() > 1; }
  bool forward_open = false, backward_open = false;            // coalesced: between its first and last module
  bool opened_in_forward = false, opened_in_backward = false;  // coalesced: opened in this pass of the model
  const Module* first_ran = nullptr;  // coalesced: the module that opened its latest forward
  std::size_t index = 0;  // in the engine's unit list
  const ShardGroup* group = nullptr;  // the ranks it is sharded over, and the copies of its blocks
  // What its collectives are for, in a mismatch's message (made once: no string per launch).
  std::string gather_purpose, reduce_purpose;
  // Where this rank's block starts in a whole buffer: its place in its shard group x shard when
  // sharded; 0 unsharded (stage 0: the block is the whole unit on every rank). Set at create.
  std::int64_t block_offset = 0;
  // Quantized blocks over the unit's buffer (plan_blocks): 0 `block` for none.
  struct BlockPlan {
    std::int64_t block = 0;
    modules::detail::BlockBits bits = modules::detail::BlockBits::int8;
    std::int64_t piece_bytes = 0;  // every rank's piece padded to the largest
    std::int64_t own_bytes = 0;    // what this rank's segments fill of its piece
    bool uneven = false;           // some rank's piece is shorter than piece_bytes
    std::int64_t own_segments = 0, own_blocks = 0, all_segments = 0, all_blocks = 0;
    async::Block tables_block;     // this rank's segments (values from its shard's start), then every piece's
    const modules::detail::QuantSegment* own = nullptr;
    const modules::detail::QuantSegment* all = nullptr;
    std::size_t gather_bytes(int ranks) const noexcept {
      return static_cast<std::size_t>(piece_bytes) * static_cast<std::size_t>(ranks);
    }
    // What a collective over the whole unit carries: its quantized pieces where planned, else the
    // unit's own bytes (the stats' gathered and reduce-scattered bytes).
    std::size_t carried_bytes(const FetchUnitInfo& info) const noexcept {
      return block > 0 ? gather_bytes(info.shard_ranks) : info.padded_bytes;
    }
  };
  // Stage 3 with quantized gathers for it (EngineOptions::quantize_weights, or
  // quantize_frozen_weights and frozen): its gathers for compute carry int8 blocks.
  BlockPlan weight_blocks;
  // Stages 2-3 with quantized gradients (EngineOptions::quantize_gradients), a unit that trains:
  // its reduce-scatter carries int8 or int4 blocks.
  BlockPlan grad_blocks;

  // Its parameters bound to `values` (a whole buffer of the unit), each with its view of
  // `grad_full` where the unit has one.
  Result<void> bind(const Tensor& values);
  // A group of collectives within its shard group, or across the copies of its block (hybrid
  // sharding), ordered within the world's communication stream like every other collective.
  Result<async::Event> launch_in_group(collectives::Communicator& world, const collectives::Coalesced& group) const;
  Result<async::Event> launch_across_copies(collectives::Communicator& world, const collectives::Coalesced& group) const;
  // Every rank's shard into `whole` on the communication stream, from this rank's `source` (on
  // the device, or in host memory: copied into its place first, then gathered in place).
  Result<async::Event> gather_into(const UnitIo& io, FetchMode mode, const Tensor& whole, const void* source,
                                   bool source_on_device) const;
  // The same with the shards carried as int8 blocks (quantize_weights; `weight_blocks` planned):
  // this rank's quantized into its piece of `staging` (weight_blocks.gather_bytes()), the pieces gathered, and
  // every piece (this rank's too) dequantized into `whole`, so every rank holds the same values.
  // The event marks the dequantization's end.
  Result<async::Event> gather_int8_into(const UnitIo& io, const Tensor& whole, const void* source, bool source_on_device,
                                        void* staging) const;
  // Plans blocks of `block` elements in `bits`' format over its whole buffer (its quantized
  // gathers, or its gradients' quantized reduction): each rank's piece cut where a parameter begins or ends (no
  // block mixes two parameters' magnitudes: a norm's weights near 1 and its bias near 0), the
  // segments' tables on the device (written on the communication stream, which every collective
  // follows).
  struct BlockPlan;
  Result<BlockPlan> plan_blocks(const UnitIo& io, std::int64_t block, modules::detail::BlockBits bits) const;
  // Its whole gradient averaged over every rank holding it, in place (stage 0).
  Result<async::Event> all_reduce_gradient(const UnitIo& io) const;
  // An expert-parallel unit's whole gradient is the sum over its expert-parallel group's tokens:
  // divided by that group's size here (on the communication stream, before its reduction), the
  // average over the run of ranks holding it becomes the world's average. Nothing for another unit.
  Result<void> scale_expert_gradient(const UnitIo& io) const;
  // Its whole gradient averaged into this rank's block `mine`: reduce-scattered within its shard
  // group (with grad_blocks planned, as ZeRO++'s qgZ: each rank quantizes every rank's block of its
  // gradient, an all-to-all sends each its own, and each sums the pieces it received in f32), then
  // all-reduced across the copies of the block (exactly).
  Result<async::Event> reduce_scatter_gradient(const UnitIo& io, const Tensor& mine) const;
  // The secondary partition (EngineOptions::secondary_partition_ranks): this rank's slice of the
  // gathered `whole` kept in `secondary_block` (copied on the communication stream after the
  // gather; allocated at the first), and `whole` gathered from those slices within the secondary
  // group, exactly.
  Result<void> keep_secondary(const UnitIo& io, const Tensor& whole);
  Result<async::Event> gather_secondary_into(const UnitIo& io, FetchMode mode, const Tensor& whole) const;
  // Its fp32 gradient shard, for use on `stream`; zeroed there unless the caller writes all of it.
  Result<void> allocate_grad_shard(const UnitIo& io, async::Stream& stream, bool zeroed = true);
  // The reduced block `mine` (compute dtype) into an fp32 tensor `out`, on the communication stream.
  Result<void> widen_block(const UnitIo& io, const Tensor& mine, const Tensor& out) const;
  // (info.frozen: every parameter of the unit is frozen, so no gradient buffer, no reduction,
  // never stepped)

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
  // Uses whose backward has not come yet: a unit used more than once in a micro-batch (a module
  // run twice, a declared reader) adds every use's gradient into one grad_full and is reduced
  // once, after the last (fewer collectives, and the unsharded model's order of additions).
  int uses_pending = 0;
  int backwards_this_step = 0;
  bool stepped_early = false;  // step_in_backward: stepped on the host during backward
  bool grad_pending = false;   // grads_through_pass: handed to the pass, its shard not stepped yet

  // Stepped on the device under offload_optimizer=cpu (a device budget kept its state there): its
  // group in the engine's device part of the optimizer (State::device_optimizer).
  std::size_t device_group = 0;
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

  // Stage 3 with a secondary partition over more ranks than it (secondary_ranks_for): the group
  // its slice is gathered within; the slice; whether it holds this step's values (kept at the
  // unit's first gather of a training step, dropped when the step begins or the unit steps).
  const ShardGroup* secondary = nullptr;
  async::Block secondary_block;
  bool secondary_holds = false;
  std::int64_t secondary_elements() const noexcept { return secondary ? info.padded / secondary->ranks : 0; }

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

// What `add(unit, group)` puts in for every unit, one launch per shard group (or, across_copies,
// per group of copies; none where a block has one copy), in the same order on every rank.
template <class Add>
Result<void> launch_by_group(collectives::Communicator& world, const ShardGroups& groups,
                             const std::vector<std::unique_ptr<FetchUnit>>& units, bool across_copies, Add add) {
  // (the groups' order: expert-parallel size, then shard size, alike on every rank)
  std::map<std::pair<int, int>, std::pair<const FetchUnitInfo*, collectives::Coalesced>> by_size;
  for (auto& u : units) {
    auto& [info, group] = by_size[{u->info.expert_parallel, u->info.shard_ranks}];
    info = &u->info;
    add(*u, group);
  }
  for (const auto& [key, unit_group] : by_size) {
    const auto& [info, group] = unit_group;
    const auto& g = groups.of(*info);
    collectives::Communicator* over = across_copies ? g.replicate : g.shard;
    if (over && !group.empty()) COSHARD_TRY(launch_within(world, *over, group));
  }
  return {};
}

}  // namespace coshard::zero::detail
