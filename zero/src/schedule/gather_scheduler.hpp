// Stage 3's gathers: each unit fetched as a module of it runs (gathered now, or waited for when it
// was gathered ahead), released after its use unless kept, and the units next along the trace of
// the last pass gathered ahead within the prefetch bucket and max_live_bytes. Every decision
// depends only on what every rank sees alike (the trace, the host's count of gathered bytes, the
// ranks' averaged measurements), never on how far a device has got: the ranks issue their
// collectives in one order. The device-paced budget is then awaited: a unit's bytes come back once
// the compute stream has passed its last use. Private: not installed.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "coshard/async/stream_budget.hpp"
#include "fetch_trace.hpp"
#include "fetch_unit.hpp"
#include "parameter_residence.hpp"
#include "placement/shard_placement.hpp"
#include "step_timeline.hpp"

namespace coshard::zero::detail {

class GatherScheduler final : public UnitGathers {
 public:
  // What it acts through: the units and their io, the options (bucket, budget, reuse), the step's
  // timeline and counters, and where the shards live (`shard_wiring` makes that placement's
  // wiring when asked: it holds this scheduler's trace).
  struct Wiring {
    UnitIo io;
    const std::vector<std::unique_ptr<FetchUnit>>& units;
    const EngineOptions& o;
    StepTimeline& timeline;
    EngineStepStats& stats;
    ShardPlacement& shards;
    std::function<ShardWiring()> shard_wiring;
    std::size_t largest_unit_bytes = 0;  // kept free of reuse, so keeping never starves a fetch
  };
  explicit GatherScheduler(Wiring w);

  // UnitGathers: a module of `u` is about to run (gathered on demand, or waited for if
  // prefetched, with the units next along the trace gathered ahead first); its buffer and budget
  // back once the compute stream has passed its last use; whether to keep it after a use (small,
  // or needed again soon, with room left for the largest unit).
  async::Task<Result<void>> fetch(FetchUnit& u) override;
  Result<void> release(FetchUnit& u) override;
  bool keep_after_use(const FetchUnit& u) const override;

  // Unit u's shards of every rank into `whole` on the communication stream (the shard placement
  // gives this rank's, and hears when the gather that read it is enqueued): for compute as the
  // unit's gathers are configured (int8 blocks with quantize_weights), or exactly (an export,
  // gather_parameters: the values a checkpoint or a user reads are the shards' own).
  enum class Exactness : std::uint8_t { as_configured, exact };
  Result<async::Event> gather_unit(FetchUnit& u, const Tensor& whole, Exactness exactness);

  // Routed units (FetchUnitInfo::routed: never in the trace, as which of them run follows the
  // routing) about to be fetched, in order: gathered ahead as the trace's units are, before them
  // (they come next), each until it is fetched. Replaces the last list.
  void announce(std::vector<FetchUnit*> next) { announced_ = std::move(next); }

  // A pass (a step's forward and backward, or an inference pass) starts: its trace chosen. Ends:
  // its order recorded for the next; whether it changed.
  void begin_pass(std::string_view name);
  bool end_pass();
  const FetchTrace& trace() const noexcept { return trace_; }

 private:
  // What must be awaited before the next unit can be gathered ahead: budget bytes (awaited into
  // prefetch_permit_), or with NVMe parameters the unit's read. {} when done.
  struct Awaiting {
    std::size_t bytes = 0;
    FetchUnit* read = nullptr;
    bool done() const noexcept { return bytes == 0 && read == nullptr; }
  };
  // Gathers units further along the trace, in order, while the bucket and the budget allow; stops
  // at the first that does not fit, so prefetched units are always the next ones in line and an
  // on-demand fetch never waits for budget held by a unit used after it. (A plain function: the
  // common path costs no coroutine frame.)
  Result<Awaiting> prefetch_ahead();
  // One unit of prefetch_ahead's: gathered ahead (or already), or what stops the walk there.
  enum class Ahead : std::uint8_t { issued, stop, wait };
  Result<Ahead> gather_ahead(FetchUnit& v, std::size_t cap, Awaiting& need);
  Result<void> issue_gather(FetchUnit& u, async::Semaphore::Permit permit, bool ahead);
  // The order departed from the trace: fetch on demand from here on, and give back what was
  // gathered ahead for the old order (it may never be used this step).
  Result<void> abandon_trace();
  // A prefetched unit is no longer ahead of use (fetched now, or released unused).
  void settle_prefetch(FetchUnit& u);

  Wiring w_;
  FetchTrace trace_;
  std::shared_ptr<async::StreamBudget> budget_;  // max_live_bytes, shared with the tasks returning bytes
  std::optional<async::Semaphore::Permit> prefetch_permit_;
  std::size_t prefetched_bytes_ = 0;
  // Bytes of units gathered or in flight as the host has issued them (released ones excluded at
  // once): the same on every rank, unlike the device-paced budget.
  std::size_t logical_live_ = 0;
  bool keep_secondaries_ = false;  // a training pass: units keep their secondary slices
  std::vector<FetchUnit*> announced_;  // routed units to gather ahead, in order
};

}  // namespace coshard::zero::detail
