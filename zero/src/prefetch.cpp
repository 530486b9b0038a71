// Trace, prefetch and reuse: the order of fetches recorded per phase, units gathered ahead along
// it within the bucket and the budget (adaptive: as far as the measured gather and compute times
// need), and units kept after use when needed again soon.
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
  trace.begin(name);
  prefetched_bytes = 0;
  stats = {};
  timeline.begin_pass();
}

Result<void> Engine::State::end_pass() {
  COSHARD_TRY(residence->end_pass(residence_wiring()));
  if (trace.end()) stats.trace_changed = true;
  return {};
}

Result<void> Engine::State::abandon_trace() {
  COSHARD_LOG_DEBUG(zero, "{}: the fetch order left the recorded trace at position {} of {}; prefetched units released",
                    trace.phase(), trace.pos(), trace.order().size());
  trace.abandon();
  stats.trace_changed = true;
  for (auto& u : units)
    if (u->prefetched) COSHARD_TRY(release(*u));
  return {};
}

Result<Engine::State::Awaiting> Engine::State::prefetch_ahead() {
  if (!trace.following() || (o.prefetch_bucket_bytes == 0 && !o.adaptive_prefetch)) return Awaiting{};
  const auto order = trace.order();
  const std::size_t cap = o.prefetch_bucket_bytes == 0 ? std::numeric_limits<std::size_t>::max() : o.prefetch_bucket_bytes;
  // Adaptive: as far ahead as the measured gathers and compute need (prefetch_horizon.hpp).
  // Measured one step behind; before there are measurements, the bucket alone decides.
  const auto measured = timeline.compute_ms.find(trace.phase());
  const bool adaptive = o.adaptive_prefetch && measured != timeline.compute_ms.end() &&
                        measured->second.size() >= order.size() && !timeline.gather_ms.empty();
  const std::size_t end = adaptive ? prefetch_horizon(order, trace.pos(), timeline.gather_ms, measured->second) : order.size();
  for (std::size_t i = trace.pos(); i < end; ++i) {
    FetchUnit& v = *units[order[i]];
    if (v.gather != Gather::released) continue;
    if (prefetched_bytes + v.info.padded_bytes > cap) break;
    if (logical_live + v.info.padded_bytes > o.max_live_bytes) break;
    if (!shard_placement->ready(v)) return Awaiting{0, &v};
    std::optional<async::Semaphore::Permit> permit;
    if (prefetch_permit && prefetch_permit->count() == v.info.padded_bytes) {
      permit = std::move(prefetch_permit);
      prefetch_permit.reset();
    } else {
      permit = budget->semaphore().try_acquire(v.info.padded_bytes);
    }
    if (!permit) {
      COSHARD_LOG_DEBUG(zero, "prefetch unit {} ({}): waits for {} budget bytes (live {}, {} pending release)", v.index,
                        v.info.name, v.info.padded_bytes, logical_live, budget->pending());
      return Awaiting{v.info.padded_bytes, nullptr};  // free once released units' last uses pass
    }
    COSHARD_TRY(issue_gather(v, std::move(*permit), true));
    v.prefetched = true;
    prefetched_bytes += v.info.padded_bytes;
    stats.peak_prefetched_bytes = std::max(stats.peak_prefetched_bytes, prefetched_bytes);
  }
  return Awaiting{};
}

bool Engine::State::keep_after_use(const FetchUnit& u) const {
  if (u.info.persistent) return true;
  if ((o.max_reuse_distance == 0 && o.max_reuse_distance_elements == 0) || !trace.following()) return false;
  const auto order = trace.order();
  const std::size_t pos = trace.pos();
  bool soon = false;
  std::size_t elements = 0;
  for (std::size_t i = pos; i < order.size() && !soon; ++i) {
    const FetchUnit& next = *units[order[i]];
    const bool by_count = i - pos < o.max_reuse_distance;
    const bool by_elements = elements < o.max_reuse_distance_elements;
    if (!by_count && !by_elements) break;
    soon = next.index == u.index;
    elements += static_cast<std::size_t>(next.info.numel);
  }
  return soon && o.max_live_bytes - logical_live >= largest_unit_bytes;
}

async::Task<Result<std::vector<double>>> Engine::State::all_reduce_values(std::span<const double> values,
                                                                          ReduceOp op, std::string_view purpose) {
  auto bytes = encode_values(values, DataType::f32);
  COSHARD_CO_TRY_ASSIGN(Tensor t, ctx->upload(bytes, Shape{static_cast<std::int64_t>(values.size())}, DataType::f32));
  COSHARD_CO_TRY(order(ctx->stream(), comm->stream()));
  COSHARD_CO_TRY(comm->all_reduce(t.data(), t.data(), values.size(), DataType::f32, op, purpose));
  COSHARD_CO_TRY(order(comm->stream(), ctx->stream()));
  COSHARD_CO_TRY_ASSIGN(auto reduced, co_await ctx->read(t));
  co_return std::vector<double>(reduced.begin(), reduced.end());
}

async::Task<Result<void>> Engine::State::agree_on_measurements() {
  if (!o.adaptive_prefetch) co_return Result<void>{};
  auto& positions = timeline.compute_ms[trace.phase()];
  std::vector<double> mine(timeline.gather_ms);
  mine.insert(mine.end(), positions.begin(), positions.end());
  COSHARD_CO_TRY_ASSIGN(auto agreed, co_await all_reduce_values(mine, ReduceOp::avg, "the prefetch's measurements"));
  std::copy(agreed.begin(), agreed.begin() + static_cast<std::ptrdiff_t>(timeline.gather_ms.size()), timeline.gather_ms.begin());
  std::copy(agreed.begin() + static_cast<std::ptrdiff_t>(timeline.gather_ms.size()), agreed.end(), positions.begin());
  co_return Result<void>{};
}

}  // namespace coshard::zero
