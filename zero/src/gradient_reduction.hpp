// How the gradients are reduced over the ranks, chosen once when the engine is made (by stage):
// one interface, three implementations, instead of `zero_stage` branches through the step.
//
// - all-reduced per unit (stage 0): each unit's whole gradient averaged over the ranks into its
//   fp32 copy as soon as its backward is done (a unit is the bucket, overlapped with the backward
//   of the units before it);
// - reduce-scattered per unit (stages 2-3): the same, each rank keeping its block, added into its
//   fp32 shard;
// - coalesced after backward (stage 1): every unit's whole gradient kept through the step and
//   reduce-scattered in one launch after the last micro-batch.
//
// Each owns the gradient storage it needs (the fp32 shard the optimizer reads, and any whole
// buffer), made in `allocate` and kept ready for each step in `begin_step`. It acts on the units
// through GradientWiring, never the engine's whole state.
#pragma once

#include <memory>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "fetch_unit.hpp"
#include "parameter_residence.hpp"
#include "shard_groups.hpp"
#include "step_timeline.hpp"

namespace coshard::zero {

// What becomes of a unit's gradient shard during backward when the optimizer is offloaded: the
// optimizer placement's business (the engine answers for it), not the reduction's.
class GradientShardsOut {
 public:
  virtual ~GradientShardsOut() = default;
  // Whether shards leave for the host during backward this step (offloaded, one micro-batch):
  // then none is made at the step's start, each at its unit's reduction instead.
  virtual bool shards_leave_in_backward() const noexcept = 0;
  // u's gradient shard has just been reduced on the communication stream (an offloaded unit's,
  // in a step whose shards leave during backward): copied out, stepped, or handed to a pass.
  virtual Result<void> shard_reduced(detail::FetchUnit& u) = 0;
};

// What a reduction acts through: the units and their io, the shard groups, the step's timeline
// and counters, where the parameters are bound while a unit computes, and where shards go.
struct GradientWiring {
  detail::UnitIo io;
  const std::vector<std::unique_ptr<detail::FetchUnit>>& units;
  const detail::ShardGroups& groups;
  detail::StepTimeline& timeline;
  EngineStepStats& stats;
  const ParameterResidence& residence;
  GradientShardsOut& out;
};

// The trained units' sizes the gradients' memory follows (memory_estimate.cpp).
struct GradientSizes {
  std::size_t whole = 0;          // every trained unit's padded bytes, in the compute dtype
  std::size_t largest_whole = 0;  // the largest trained unit's
  std::size_t shards_f32 = 0;     // this rank's fp32 shards of them (whole units at stage 0)
  std::size_t largest_shard_f32 = 0;
  // With the optimizer offloaded: the fp32 shards of the units a device budget steps on the device,
  // kept there for good (shards_f32 and largest_shard_f32 are then the other units').
  std::size_t resident_shards_f32 = 0;
  // The optimizer is offloaded and steps have one micro-batch: a shard is on the device only from
  // its reduction until it is out (stages 0, 2-3).
  bool shards_in_flight = false;
};

class GradientReduction {
 public:
  virtual ~GradientReduction() = default;
  // Its lines of the memory estimate: the gradient storage `allocate` makes and a step holds.
  virtual void estimate(MemoryEstimate& m, const GradientSizes& g, DataType dtype) const = 0;
  // u's gradient storage when the engine is made.
  virtual Result<void> allocate(const GradientWiring& w, detail::FetchUnit& u) = 0;
  // A new step: storage kept across steps made ready (zeroed, or what an abandoned step left).
  virtual Result<void> begin_step(const GradientWiring& w, detail::FetchUnit& u) = 0;
  // u's backward is about to run: the buffer its parameters' gradients go into, bound.
  virtual Result<void> begin_backward(const GradientWiring& w, detail::FetchUnit& u) = 0;
  // u's backward is done (one use of it): reduced now, or counted for after backward.
  virtual Result<void> after_backward(const GradientWiring& w, detail::FetchUnit& u) = 0;
  // After the last micro-batch, on the communication stream: what is left to reduce, into the
  // fp32 shards (their scaling by the micro-batch count and the compute stream's wait follow).
  virtual async::Task<Result<void>> finish(const GradientWiring& w) = 0;
  // Whether a unit's shard is complete when its last backward of the step is done (so it may go
  // to the host, or be stepped, during backward).
  virtual bool complete_per_unit() const noexcept = 0;
  // Whether a unit may go unreduced on one rank and reduced on another within a step (the
  // reduction takes every unit after backward): then which units no rank used takes an
  // all-reduce of flags.
  virtual bool reduces_every_unit() const noexcept = 0;
};

std::unique_ptr<GradientReduction> make_all_reduce_per_unit();
std::unique_ptr<GradientReduction> make_reduce_scatter_per_unit();
std::unique_ptr<GradientReduction> make_coalesced_after_backward();
// The one a stage uses (0: all-reduce per unit, 1: coalesced, 2-3: reduce-scatter per unit).
std::unique_ptr<GradientReduction> make_gradient_reduction(int zero_stage);

}  // namespace coshard::zero
