// A fetch unit as the engine keeps it: its modules and parameters, its shard group, its storage
// (shards, full copies, gradients, pinned buffers), and where it stands in a step (its gather,
// its backward passes). The strategies of engine_state.hpp fill and use what their mode needs.
// Private: not installed.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "coshard/async/event.hpp"
#include "coshard/async/join_handle.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/semaphore.hpp"
#include "coshard/offload/pinned_pool.hpp"
#include "coshard/zero/engine.hpp"
#include "shard_groups.hpp"

namespace coshard::zero::detail {

using modules::Module;
using modules::Parameter;
using modules::Tensor;

enum class Gather : std::uint8_t { released, in_flight, ready };

struct Unit {
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

}  // namespace coshard::zero::detail
