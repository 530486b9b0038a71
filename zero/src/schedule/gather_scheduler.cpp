// Stage 3's gathers (gather_scheduler.hpp): fetch, gather ahead along the trace, release, keep.
#include "schedule/gather_scheduler.hpp"

#include <algorithm>
#include <limits>

#include "coshard/async/log.hpp"
#include "schedule/prefetch_horizon.hpp"

namespace coshard::zero::detail {

// (prefetch_horizon.hpp)
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

using modules::Shape;

GatherScheduler::GatherScheduler(Wiring w) : w_(std::move(w)), budget_(async::StreamBudget::create(w_.o.max_live_bytes)) {}

void GatherScheduler::begin_pass(std::string_view name) {
  trace_.begin(name);
  prefetched_bytes_ = 0;
  // (the shards may have changed since the last pass: a step, a load; an inference pass has no
  // later gathers to save)
  keep_secondaries_ = name == "train";
  for (auto& u : w_.units) u->secondary_holds = false;
  announced_.clear();
}

bool GatherScheduler::end_pass() { return trace_.end(); }

void GatherScheduler::settle_prefetch(FetchUnit& u) {
  if (!u.prefetched) return;
  prefetched_bytes_ -= u.info.padded_bytes;
  u.prefetched = false;
}

Result<async::Event> GatherScheduler::gather_unit(FetchUnit& u, const Tensor& whole, Exactness exactness) {
  const bool for_compute = exactness == Exactness::as_configured;
  // (from the secondary slices: the shard is not read, nor made ready for it)
  if (for_compute && u.secondary_holds) return u.gather_secondary_into(w_.io, w_.o.fetch_mode, whole);
  COSHARD_TRY_ASSIGN(const void* source, w_.shards.source(u));
  Result<async::Event> done = fail(ErrorCode::internal, "gather of unit ", u.info.name, " not issued");
  if (u.weight_blocks.block > 0 && for_compute) {
    // The int8 pieces live on the communication stream until their dequantization has run there.
    auto& cs = w_.io.world.stream();
    COSHARD_TRY_ASSIGN(auto pieces, w_.io.ctx.allocator().allocate(u.weight_blocks.gather_bytes(u.info.shard_ranks), cs));
    done = u.gather_int8_into(w_.io, whole, source, w_.shards.on_device(u), pieces.data());
  } else {
    done = u.gather_into(w_.io, w_.o.fetch_mode, whole, source, w_.shards.on_device(u));
  }
  if (done) COSHARD_TRY(w_.shards.gathered(u, *done));
  // A training step's first gather of the unit: its slice kept for the step's later gathers.
  if (done && for_compute && u.secondary && keep_secondaries_) COSHARD_TRY(u.keep_secondary(w_.io, whole));
  return done;
}

Result<void> GatherScheduler::issue_gather(FetchUnit& u, async::Semaphore::Permit permit, bool ahead) {
  auto& cs = w_.io.world.stream();
  async::Event started;
  if (w_.timeline.spans_on()) {
    COSHARD_TRY_ASSIGN(started, cs.record_timed());
  }
  // Allocated for the compute stream (its last user); the gather's own use is recorded below,
  // so returning the block needs no record on the communication stream.
  COSHARD_TRY_ASSIGN(u.gathered_block, w_.io.ctx.allocator().allocate(u.info.padded_bytes, w_.io.ctx.stream()));
  u.gathered = Tensor(u.gathered_block.data(), Shape{u.info.padded}, w_.io.dtype, w_.io.ctx.device());
  const bool within_secondary = u.secondary_holds;
  auto done = gather_unit(u, u.gathered, Exactness::as_configured);
  if (!done) return fail(std::move(done).error().with_context("gathering unit " + u.info.name));
  u.gathered_event = std::move(*done);
  if (w_.timeline.spans_on()) {
    COSHARD_TRY_ASSIGN(auto finished, cs.record_timed());
    w_.timeline.span(false, ahead ? "prefetch" : "fetch", u.info.name, std::move(started), std::move(finished), StepTimeline::kNone, u.index);
  }
  u.gathered_block.record_use(u.gathered_event);
  u.gather = Gather::in_flight;
  u.permit = std::move(permit);
  logical_live_ += u.info.padded_bytes;
  COSHARD_LOG_DEBUG(zero, "{} unit {} ({}): gather of {} bytes issued on {}; live {} of max_live_bytes {}",
                    ahead ? "prefetch" : "fetch", u.index, u.info.name, u.info.padded_bytes, cs.name(), logical_live_,
                    w_.o.max_live_bytes);
  // (held: what the host has gathered, and released bytes whose last use has not passed yet)
  w_.stats.peak_live_bytes = std::max(w_.stats.peak_live_bytes, logical_live_ + budget_->pending());
  ++w_.stats.gathers;
  if (within_secondary) {
    ++w_.stats.secondary_gathers;
    w_.stats.secondary_gathered_bytes += u.info.padded_bytes;
  } else {
    w_.stats.gathered_bytes += u.weight_blocks.carried_bytes(u.info);
  }
  return {};
}

Result<void> GatherScheduler::release(FetchUnit& u) {
  if (u.gather == Gather::released) return {};
  COSHARD_TRY_ASSIGN(auto last_use, w_.timeline.span_mark(w_.io.ctx.stream()));
  w_.timeline.span(true, "release", u.info.name, last_use, last_use);
  // The block's uses: the gather (recorded at issue, so a stale prefetch's memory still waits
  // for it) and the compute stream up to `last_use`.
  u.gathered_block.reset_after(last_use);
  u.gathered = {};
  for (auto& p : u.params) p.parameter->unbind();
  settle_prefetch(u);
  u.gather = Gather::released;
  logical_live_ -= u.info.padded_bytes;
  COSHARD_LOG_DEBUG(zero, "release unit {} ({}): {} bytes back once {} passes its last use; live {} of max_live_bytes {}",
                    u.index, u.info.name, u.info.padded_bytes, w_.io.ctx.stream().name(), logical_live_, w_.o.max_live_bytes);
  auto permit = std::move(*u.permit);
  u.permit.reset();
  return budget_->release_after(std::move(last_use), std::move(permit));
}

async::Task<Result<void>> GatherScheduler::fetch(FetchUnit& u) {
  ++w_.stats.fetches;
  if (u.info.routed) {  // (off the trace: where it runs follows the routing)
    u.fetch_pos = StepTimeline::kNone;
    std::erase(announced_, &u);
  } else {
    bool on_trace = true;
    u.fetch_pos = trace_.record(u.index, on_trace);
    if (!on_trace) COSHARD_CO_TRY(abandon_trace());
  }
  if (u.gather != Gather::released) ++w_.stats.prefetch_hits;
  COSHARD_LOG_DEBUG(zero, "fetch unit {} ({}) in {}: {}", u.index, u.info.name, trace_.phase(),
                    u.gather == Gather::released ? "not resident, gathering now" : "resident (prefetched or kept)");
  settle_prefetch(u);
  if (u.gather == Gather::released) {
    const ShardWiring wiring = w_.shard_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
    if (!u.secondary_holds) {
      COSHARD_CO_TRY(co_await w_.shards.make_ready(wiring, u));
    }
    COSHARD_CO_TRY_ASSIGN(auto permit, co_await budget_->semaphore().acquire(u.info.padded_bytes));
    COSHARD_CO_TRY(issue_gather(u, std::move(permit), false));
  }
  // Issued before this unit's wait.
  for (;;) {
    COSHARD_CO_TRY_ASSIGN(const Awaiting need, prefetch_ahead());
    if (need.done()) break;
    if (need.read) {
      const ShardWiring wiring = w_.shard_wiring();
      COSHARD_CO_TRY(co_await w_.shards.make_ready(wiring, *need.read));
      continue;
    }
    COSHARD_CO_TRY_ASSIGN(auto permit, co_await budget_->semaphore().acquire(need.bytes));
    prefetch_permit_ = std::move(permit);
  }
  prefetch_permit_.reset();  // not used after all (the trace moved on): back to the budget
  COSHARD_CO_TRY(w_.shards.read_ahead(w_.shard_wiring()));
  if (u.gather == Gather::in_flight) {
    COSHARD_CO_TRY(w_.timeline.wait(w_.io.ctx.stream(), u.gathered_event, u.info.name));
    u.gather = Gather::ready;
  }
  co_return u.bind(u.gathered);
}

Result<void> GatherScheduler::abandon_trace() {
  COSHARD_LOG_DEBUG(zero, "{}: the fetch order left the recorded trace at position {} of {}; prefetched units released",
                    trace_.phase(), trace_.pos(), trace_.order().size());
  trace_.abandon();
  w_.stats.trace_changed = true;
  for (auto& u : w_.units)
    if (u->prefetched) COSHARD_TRY(release(*u));
  return {};
}

Result<GatherScheduler::Awaiting> GatherScheduler::prefetch_ahead() {
  if (w_.o.prefetch_bucket_bytes == 0 && !w_.o.adaptive_prefetch) return Awaiting{};
  const std::size_t cap = w_.o.prefetch_bucket_bytes == 0 ? std::numeric_limits<std::size_t>::max() : w_.o.prefetch_bucket_bytes;
  Awaiting need;
  // The experts a layer announced run next: first in line.
  for (FetchUnit* v : announced_) {
    COSHARD_TRY_ASSIGN(const Ahead a, gather_ahead(*v, cap, need));
    if (a == Ahead::wait) return need;
    if (a == Ahead::stop) return Awaiting{};
  }
  if (!trace_.following()) return Awaiting{};
  const auto order = trace_.order();
  // Adaptive: as far ahead as the measured gathers and compute need (prefetch_horizon.hpp).
  // Measured one step behind; before there are measurements, the bucket alone decides.
  const auto measured = w_.timeline.compute_ms.find(trace_.phase());
  const bool adaptive = w_.o.adaptive_prefetch && measured != w_.timeline.compute_ms.end() &&
                        measured->second.size() >= order.size() && !w_.timeline.gather_ms.empty();
  const std::size_t end = adaptive ? prefetch_horizon(order, trace_.pos(), w_.timeline.gather_ms, measured->second) : order.size();
  for (std::size_t i = trace_.pos(); i < end; ++i) {
    COSHARD_TRY_ASSIGN(const Ahead a, gather_ahead(*w_.units[order[i]], cap, need));
    if (a == Ahead::wait) return need;
    if (a == Ahead::stop) break;
  }
  return Awaiting{};
}

Result<GatherScheduler::Ahead> GatherScheduler::gather_ahead(FetchUnit& v, std::size_t cap, Awaiting& need) {
  if (v.gather != Gather::released) return Ahead::issued;
  if (prefetched_bytes_ + v.info.padded_bytes > cap) return Ahead::stop;
  if (logical_live_ + v.info.padded_bytes > w_.o.max_live_bytes) return Ahead::stop;
  if (!v.secondary_holds && !w_.shards.ready(v)) {
    need = Awaiting{0, &v};
    return Ahead::wait;
  }
  std::optional<async::Semaphore::Permit> permit;
  if (prefetch_permit_ && prefetch_permit_->count() == v.info.padded_bytes) {
    permit = std::move(prefetch_permit_);
    prefetch_permit_.reset();
  } else {
    permit = budget_->semaphore().try_acquire(v.info.padded_bytes);
  }
  if (!permit) {
    COSHARD_LOG_DEBUG(zero, "prefetch unit {} ({}): waits for {} budget bytes (live {}, {} pending release)", v.index,
                      v.info.name, v.info.padded_bytes, logical_live_, budget_->pending());
    need = Awaiting{v.info.padded_bytes, nullptr};  // free once released units' last uses pass
    return Ahead::wait;
  }
  COSHARD_TRY(issue_gather(v, std::move(*permit), true));
  v.prefetched = true;
  prefetched_bytes_ += v.info.padded_bytes;
  w_.stats.peak_prefetched_bytes = std::max(w_.stats.peak_prefetched_bytes, prefetched_bytes_);
  return Ahead::issued;
}

bool GatherScheduler::keep_after_use(const FetchUnit& u) const {
  if (u.info.persistent) return true;
  const bool room = w_.o.max_live_bytes - logical_live_ >= w_.largest_unit_bytes;
  if (u.info.frozen && w_.o.keep_frozen_gathered) return room;  // (the same values until the step's end)
  if ((w_.o.max_reuse_distance == 0 && w_.o.max_reuse_distance_elements == 0) || !trace_.following()) return false;
  const auto order = trace_.order();
  const std::size_t pos = trace_.pos();
  bool soon = false;
  std::size_t elements = 0;
  for (std::size_t i = pos; i < order.size() && !soon; ++i) {
    const FetchUnit& next = *w_.units[order[i]];
    const bool by_count = i - pos < w_.o.max_reuse_distance;
    const bool by_elements = elements < w_.o.max_reuse_distance_elements;
    if (!by_count && !by_elements) break;
    soon = next.index == u.index;
    elements += static_cast<std::size_t>(next.info.numel);
  }
  return soon && room;
}

}  // namespace coshard::zero::detail
