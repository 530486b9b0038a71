// Where a unit's whole parameters reside, chosen once when the engine is made (by stage): one
// interface, three implementations, instead of `stage3()` tests through the hooks and the loop.
//
// - whole and unsharded (stage 0): the unit's buffer is its shard; nothing to gather, ever;
// - whole, gathered after each step (stages 1-2): every rank keeps the whole unit; the optimizer
//   steps this rank's shard and the whole copies follow in one all-gather after the step;
// - gathered on use (stage 3): only the shard stays; the unit is fetched before a module of it
//   (or one lent it) runs and released after, unless kept (persistence, reuse distance).
//
// Each acts on the units through ResidenceWiring, never the engine's whole state.
#pragma once

#include <memory>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "fetch_unit.hpp"
#include "shard_groups.hpp"
#include "step_timeline.hpp"

namespace coshard::zero {

// The stage-3 scheduler of gathers (gather_scheduler.cpp), which the residence that gathers
// on use asks: a unit fetched (gathered now, or waited for if prefetched, with the units next
// along the trace gathered ahead), released, or kept after its use.
class UnitGathers {
 public:
  virtual ~UnitGathers() = default;
  virtual async::Task<Result<void>> fetch(detail::FetchUnit& u) = 0;
  virtual Result<void> release(detail::FetchUnit& u) = 0;
  virtual bool keep_after_use(const detail::FetchUnit& u) const = 0;
};

// What a residence acts through: the units and their io, the shard groups, the step's timeline
// and counters, and the scheduler of gathers.
struct ResidenceWiring {
  detail::UnitIo io;
  const std::vector<std::unique_ptr<detail::FetchUnit>>& units;
  const detail::ShardGroups& groups;
  detail::StepTimeline& timeline;
  EngineStepStats& stats;
  UnitGathers& gathers;
};

// The units' sizes the parameters' memory follows (memory_estimate.cpp), in the compute dtype.
struct ParameterSizes {
  std::size_t whole = 0;             // every unit's padded bytes
  std::size_t shards_on_device = 0;  // this rank's shards of them not offloaded (FetchUnitInfo::shard_offloaded)
};

class ParameterResidence {
 public:
  virtual ~ParameterResidence() = default;
  // Its lines of the memory estimate for the options `o` (the shards' own line only where they
  // stay on the device).
  virtual void estimate(MemoryEstimate& m, const ParameterSizes& p, const EngineOptions& o) const = 0;
  // When the engine is made, after u's shard has storage: the parameters bound where they live.
  virtual Result<void> bind_at_creation(const ResidenceWiring& w, detail::FetchUnit& u) = 0;
  // Before a module of u (or one lent u) computes: u's whole parameters there.
  virtual async::Task<Result<void>> acquire(const ResidenceWiring& w, detail::FetchUnit& u) = 0;
  // After such a use: given back, unless kept.
  virtual Result<void> after_use(const ResidenceWiring& w, detail::FetchUnit& u) = 0;
  // The end of a pass: whatever is still gathered, given back.
  virtual Result<void> end_pass(const ResidenceWiring& w) = 0;
  // After the optimizer stepped the shards, on the communication stream: the whole copies follow.
  virtual Result<void> after_step(const ResidenceWiring& w) = 0;
  // Outside a step (initialisation, a load), once the shards were written: the whole copies
  // follow, and the compute stream is ordered after them.
  virtual async::Task<Result<void>> follow_shards(const ResidenceWiring& w) = 0;
  // The buffer the unit's parameters are bound to while it computes.
  virtual const modules::Tensor& values(const detail::FetchUnit& u) const = 0;
  // u's parameters on the device when the engine is made: its shard alone (gathered on use), or
  // the whole unit with the shard a view of this rank's block.
  virtual Result<void> allocate_on_device(const ResidenceWiring& w, detail::FetchUnit& u) = 0;
  // Whether every rank holds the whole unit between uses (initial values and an export are then
  // written and read there, not through the shard).
  virtual bool holds_whole() const noexcept = 0;
  // Whether each rank's block is its own (else every rank's block is the whole unit, at 0).
  virtual bool sharded() const noexcept = 0;
};

std::unique_ptr<ParameterResidence> make_whole_unsharded();
std::unique_ptr<ParameterResidence> make_whole_gathered_after_step();
std::unique_ptr<ParameterResidence> make_gathered_on_use();
// The one a stage uses (0: whole and unsharded, 1-2: whole, gathered after each step, 3: gathered on use).
std::unique_ptr<ParameterResidence> make_parameter_residence(int zero_stage);

}  // namespace coshard::zero
