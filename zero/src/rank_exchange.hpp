// Small exchanges between the engine's ranks, each one collective on the communication stream
// after what the compute stream holds, awaited (the host awaits an event, never blocks): how the
// ranks agree on a checkpoint's or a load's outcome, which units no rank used, and the prefetch's
// measurements. Private: not installed.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/module.hpp"

namespace coshard::zero::detail {

class RankExchange {
 public:
  RankExchange() = default;  // (set when the engine is made)
  RankExchange(modules::Context& ctx, collectives::Communicator& world) : ctx_(&ctx), world_(&world) {}
  int size() const noexcept { return world_ ? world_->size() : 1; }

  // Each rank's `mine` (the same length on every rank), rank-major: one all-gather.
  async::Task<Result<std::vector<std::int64_t>>> all_ranks(std::vector<std::int64_t> mine);
  // Whether every rank could do `what` (its own check passed: `ok`): an error names the first rank
  // that could not (that rank's own error says why), ending with `consequence` ("nothing was
  // saved"). A rank whose `ok` is false returns its own error instead; either way, no rank goes on
  // to change anything or wait for the others.
  async::Task<Result<void>> every_rank_agrees(bool ok, std::string what, std::string consequence);
  // The same for a load: "nothing was loaded".
  async::Task<Result<void>> every_rank_can_load(bool ok, std::string what);
  // `values` reduced over the ranks (as f32) with `op`, back on the host: one all-reduce.
  async::Task<Result<std::vector<double>>> all_reduce_values(std::span<const double> values, collectives::ReduceOp op,
                                                            std::string_view purpose);

 private:
  modules::Context* ctx_ = nullptr;
  collectives::Communicator* world_ = nullptr;
};

}  // namespace coshard::zero::detail
