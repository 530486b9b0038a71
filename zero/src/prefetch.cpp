// A pass's start and end, the adaptive prefetch's horizon (how far ahead the measured gather and
// compute times need units gathered) and the ranks' agreement on those measurements. The gathers
// themselves are gather_scheduler.cpp's.
#include "engine_state.hpp"
#include "prefetch_horizon.hpp"

namespace coshard::zero {

namespace detail {

std::size_t prefetch_horizon(std::span<const std::size_t> trace, std::size_t pos, std::span<const double> gather_ms,
                             std::span<const double> compute_ms) {
  double queued_ms = 0, compute_before_ms = 0;
  for (std::size_t i = pos; i < trace.size(); ++i) {
    queued_ms += std::max(0.0, gather_ms[trace[i]]);
    if (i > pos) compute_before_ms += std::max(0.0, compute_ms[i - 1]);
    if (queued_ms * kPrefetchMargin < compute_before_ms) return i;
  }
  return trace.size();
}

}  // namespace detail

using namespace modules;
using namespace detail;

void Engine::State::begin_pass(std::string_view name) {
  reset_coalesced(name == "train");
  gathers->begin_pass(name);
  stats = {};
  timeline.begin_pass();
}

Result<void> Engine::State::end_pass() {
  COSHARD_TRY(residence->end_pass(residence_wiring()));
  if (gathers->end_pass()) stats.trace_changed = true;
  return {};
}

async::Task<Result<void>> Engine::State::agree_on_measurements() {
  if (!o.adaptive_prefetch) co_return Result<void>{};
  auto& positions = timeline.compute_ms[gathers->trace().phase()];
  std::vector<double> mine(timeline.gather_ms);
  mine.insert(mine.end(), positions.begin(), positions.end());
  COSHARD_CO_TRY_ASSIGN(auto agreed, co_await ranks_agree.all_reduce_values(mine, ReduceOp::avg, "the prefetch's measurements"));
  std::copy(agreed.begin(), agreed.begin() + static_cast<std::ptrdiff_t>(timeline.gather_ms.size()), timeline.gather_ms.begin());
  std::copy(agreed.begin() + static_cast<std::ptrdiff_t>(timeline.gather_ms.size()), agreed.end(), positions.begin());
  co_return Result<void>{};
}

}  // namespace coshard::zero
