// Timing: timed events around the compute stream's waits on communication (exposed_comm_ms) and
// the step's timeline, read once the step's last event has passed, never by a synchronize.
#include "step_timeline.hpp"

#include <algorithm>

namespace coshard::zero::detail {

Result<void> StepTimeline::wait(async::Stream& compute, const async::Event& event, const std::string& what) {
  if (!timing()) return compute.wait(event);
  COSHARD_TRY_ASSIGN(auto before, compute.record_timed());
  COSHARD_TRY(compute.wait(event));
  COSHARD_TRY_ASSIGN(auto after, compute.record_timed());
  span(true, "wait", what, before, after);
  waits_.emplace_back(std::move(before), std::move(after));
  return {};
}

Result<void> StepTimeline::set_epoch(async::Event epoch, async::Stream& compute, async::Stream& comm) {
  epoch_ = std::move(epoch);
  host_epoch_ = std::chrono::steady_clock::now();
  COSHARD_TRY(compute.wait(epoch_));
  return comm.wait(epoch_);
}

Result<void> StepTimeline::start(async::Stream& compute, async::Stream& comm) {
  if (!timing()) return {};
  COSHARD_TRY_ASSIGN(auto epoch, compute.record_timed());
  return set_epoch(std::move(epoch), compute, comm);
}

void StepTimeline::collect(EngineStepStats& stats, const std::string& phase, std::size_t positions) {
  if (!timing()) return;
  double exposed = 0;
  bool complete = true;
  for (const auto& [before, after] : waits_) {
    auto ms = after.elapsed_ms_since(before);
    if (ms) exposed += *ms;
    else complete = false;
  }
  waits_.clear();
  if (complete) stats.exposed_comm_ms = exposed;
  auto& compute_of_pass = compute_ms[phase];
  compute_of_pass.resize(positions, -1.0);
  for (const auto& sp : spans_) {
    if (adaptive_) {
      if (auto d = sp.end.elapsed_ms_since(sp.start)) {
        if (sp.pos != kNone && sp.pos < compute_of_pass.size()) learn(compute_of_pass[sp.pos], *d);
        if (sp.unit != kNone && sp.unit < gather_ms.size()) learn_gather(gather_ms[sp.unit], *d);
      }
    }
    if (!record_) continue;
    auto a = sp.start.elapsed_ms_since(epoch_);
    auto b = sp.end.elapsed_ms_since(epoch_);
    if (a && b) stats.timeline.push_back({sp.compute ? "compute" : "comm", sp.category, *sp.name, *a, *b});
  }
  spans_.clear();
}

void StepTimeline::add_nvme_spans(EngineStepStats& stats, std::vector<offload::NvmeTransferSpan> spans) const {
  if (!record_) return;
  std::optional<std::chrono::steady_clock::time_point> passed;
  if (epoch_.fence()) passed = epoch_.fence()->host_time();
  const auto epoch = passed.value_or(host_epoch_);
  auto ms = [epoch](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(t - epoch).count();
  };
  for (auto& sp : spans)
    stats.timeline.push_back({sp.writing ? "nvme write" : "nvme read", sp.writing ? "write" : "read", std::move(sp.file),
                              ms(sp.start), ms(sp.end)});
}

}  // namespace coshard::zero::detail
