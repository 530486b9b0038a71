// Gather and release (stage 3): a unit's fetch awaits its budget and issues one collective on the
// communication stream; the compute stream waits on its event (the host does not); a release
// hands the memory and budget back once the compute stream has passed the unit's last use.
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

Result<async::Event> Engine::State::gather_unit(FetchUnit& u, const Tensor& whole) {
  COSHARD_TRY_ASSIGN(const void* source, shard_placement->source(u));
  auto done = u.gather_into(io(), o.fetch_mode, whole, source, shard_placement->on_device(u));
  if (done) COSHARD_TRY(shard_placement->gathered(u, *done));
  return done;
}

Result<void> Engine::State::issue_gather(FetchUnit& u, async::Semaphore::Permit permit, bool ahead) {
  auto& cs = comm->stream();
  async::Event started;
  if (timeline.spans_on()) {
    COSHARD_TRY_ASSIGN(started, cs.record_timed());
  }
  // Allocated for the compute stream (its last user); the gather's own use is recorded below,
  // so returning the block needs no record on the communication stream.
  COSHARD_TRY_ASSIGN(u.gathered_block, ctx->allocator().allocate(u.info.padded_bytes, ctx->stream()));
  u.gathered = Tensor(u.gathered_block.data(), Shape{u.info.padded}, o.dtype, ctx->device());
  auto done = gather_unit(u, u.gathered);
  if (!done) return fail(std::move(done).error().with_context("gathering unit " + u.info.name));
  u.gathered_event = std::move(*done);
  if (timeline.spans_on()) {
    COSHARD_TRY_ASSIGN(auto finished, cs.record_timed());
    timeline.span(false, ahead ? "prefetch" : "fetch", u.info.name, std::move(started), std::move(finished), StepTimeline::kNone, u.index);
  }
  u.gathered_block.record_use(u.gathered_event);
  u.gather = Gather::in_flight;
  u.permit = std::move(permit);
  logical_live += u.info.padded_bytes;
  COSHARD_LOG_DEBUG(zero, "{} unit {} ({}): gather of {} bytes issued on {}; live {} of max_live_bytes {}",
                    ahead ? "prefetch" : "fetch", u.index, u.info.name, u.info.padded_bytes, cs.name(), logical_live,
                    o.max_live_bytes);
  // (held: what the host has gathered, and released bytes whose last use has not passed yet)
  stats.peak_live_bytes = std::max(stats.peak_live_bytes, logical_live + budget->pending());
  ++stats.gathers;
  stats.gathered_bytes += u.info.padded_bytes;
  return {};
}

Result<void> Engine::State::release(FetchUnit& u) {
  if (u.gather == Gather::released) return {};
  COSHARD_TRY_ASSIGN(auto last_use, timeline.span_mark(ctx->stream()));
  timeline.span(true, "release", u.info.name, last_use, last_use);
  // The block's uses: the gather (recorded at issue, so a stale prefetch's memory still waits
  // for it) and the compute stream up to `last_use`.
  u.gathered_block.reset_after(last_use);
  u.gathered = {};
  for (auto& p : u.params) p.parameter->unbind();
  settle_prefetch(u);
  u.gather = Gather::released;
  logical_live -= u.info.padded_bytes;
  COSHARD_LOG_DEBUG(zero, "release unit {} ({}): {} bytes back once {} passes its last use; live {} of max_live_bytes {}",
                    u.index, u.info.name, u.info.padded_bytes, ctx->stream().name(), logical_live, o.max_live_bytes);
  auto permit = std::move(*u.permit);
  u.permit.reset();
  return budget->release_after(std::move(last_use), std::move(permit));
}

async::Task<Result<void>> Engine::State::fetch(FetchUnit& u) {
  ++stats.fetches;
  bool on_trace = true;
  u.fetch_pos = trace.record(u.index, on_trace);
  if (!on_trace) COSHARD_CO_TRY(abandon_trace());
  if (u.gather != Gather::released) ++stats.prefetch_hits;
  COSHARD_LOG_DEBUG(zero, "fetch unit {} ({}) in {}: {}", u.index, u.info.name, trace.phase(),
                    u.gather == Gather::released ? "not resident, gathering now" : "resident (prefetched or kept)");
  settle_prefetch(u);
  if (u.gather == Gather::released) {
    COSHARD_CO_TRY(co_await shard_placement->make_ready(shard_wiring(), u));
    COSHARD_CO_TRY_ASSIGN(auto permit, co_await budget->semaphore().acquire(u.info.padded_bytes));
    COSHARD_CO_TRY(issue_gather(u, std::move(permit), false));
  }
  // Issued before this unit's wait.
  for (;;) {
    COSHARD_CO_TRY_ASSIGN(const Awaiting need, prefetch_ahead());
    if (need.done()) break;
    if (need.read) {
      COSHARD_CO_TRY(co_await shard_placement->make_ready(shard_wiring(), *need.read));
      continue;
    }
    COSHARD_CO_TRY_ASSIGN(auto permit, co_await budget->semaphore().acquire(need.bytes));
    prefetch_permit = std::move(permit);
  }
  prefetch_permit.reset();  // not used after all (the trace moved on): back to the budget
  COSHARD_CO_TRY(shard_placement->read_ahead(shard_wiring()));
  if (u.gather == Gather::in_flight) {
    COSHARD_CO_TRY(compute_waits(u.gathered_event, u.info.name));
    u.gather = Gather::ready;
  }
  co_return u.bind(u.gathered);
}

std::size_t Engine::units_in_flight() const noexcept {
  std::size_t n = 0;
  for (const auto& u : s_->units) n += u->gather == Gather::in_flight ? 1 : 0;
  return n;
}

}  // namespace coshard::zero
