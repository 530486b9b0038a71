// Timing: timed events around the compute stream's waits on communication (exposed_comm_ms) and
// the step's timeline, read once the step's last event has passed, never by a synchronize.
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

Result<void> Engine::State::compute_waits(const async::Event& event, const std::string& what) {
  auto& compute = ctx->stream();
  if (!timing()) return compute.wait(event);
  COSHARD_TRY_ASSIGN(auto before, compute.record_timed());
  COSHARD_TRY(compute.wait(event));
  COSHARD_TRY_ASSIGN(auto after, compute.record_timed());
  span(true, "wait", what, before, after);
  waits.emplace_back(std::move(before), std::move(after));
  return {};
}

Result<void> Engine::State::streams_after_epoch() {
  COSHARD_TRY(ctx->stream().wait(epoch));
  return comm->stream().wait(epoch);
}

void Engine::State::collect_timing() {
  if (!timing()) return;
  double exposed = 0;
  bool complete = true;
  for (const auto& [before, after] : waits) {
    auto ms = after.elapsed_ms_since(before);
    if (ms) exposed += *ms;
    else complete = false;
  }
  waits.clear();
  if (complete) stats.exposed_comm_ms = exposed;
  auto& compute_of_pass = compute_ms[phase];
  compute_of_pass.resize(recording.size(), -1.0);
  for (const auto& sp : spans) {
    if (o.adaptive_prefetch) {
      if (auto d = sp.end.elapsed_ms_since(sp.start)) {
        if (sp.pos != kNone && sp.pos < compute_of_pass.size()) learn(compute_of_pass[sp.pos], *d);
        if (sp.unit != kNone) learn_gather(gather_ms[sp.unit], *d);
      }
    }
    if (!o.record_timeline) continue;
    auto a = sp.start.elapsed_ms_since(epoch);
    auto b = sp.end.elapsed_ms_since(epoch);
    if (a && b) stats.timeline.push_back({sp.compute ? "compute" : "comm", sp.category, *sp.name, *a, *b});
  }
  spans.clear();
}

Result<void> Engine::set_timeline_epoch(async::Event epoch) {
  if (!epoch.timed() || !(epoch.device() == s_->ctx->device()))
    return fail(ErrorCode::invalid_argument, "set_timeline_epoch: expected a timed event (Stream::record_timed) on ",
                s_->ctx->device().to_string());
  s_->epoch = std::move(epoch);
  return s_->streams_after_epoch();
}

}  // namespace coshard::zero
