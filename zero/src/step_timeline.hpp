// A step's timing, apart from the engine's state: spans of the compute and communication streams
// (the timeline), the compute stream's waits on communication (exposed_comm_ms), and the
// measurements adaptive prefetch learns from them (each unit's gather, the compute at each
// position of a pass's fetch order). Events are stamped by the streams and read once the step's
// last event has passed, never by a synchronize. Private: not installed.
#pragma once

#include <chrono>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "coshard/async/event.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/offload/nvme_store.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

// Names of the step's phases in the timeline (spans keep pointers to their names).
inline const std::string kAllUnits = "all units";
inline const std::string kGradients = "gradients";
inline const std::string kGradStats = "gradient norm";
inline const std::string kOptimizer = "optimizer";
inline const std::string kParameters = "parameters";


class StepTimeline {
 public:
  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

  // options.timing, options.record_timeline, options.adaptive_prefetch.
  StepTimeline() = default;
  StepTimeline(bool timing, bool record_timeline, bool adaptive_prefetch) noexcept
      : timing_(timing), record_(record_timeline), adaptive_(adaptive_prefetch) {}

  // Anything timed (exposed_comm_ms, or spans).
  bool timing() const noexcept { return timing_ || spans_on(); }
  // Spans are kept for the timeline, and for adaptive prefetch (its measurements).
  bool spans_on() const noexcept { return record_ || adaptive_; }
  // An event of `stream`, timed when anything is.
  Result<async::Event> mark(async::Stream& stream) const { return timing() ? stream.record_timed() : stream.record(); }
  // A span's start or end: timed only when spans are kept.
  Result<async::Event> span_mark(async::Stream& stream) const {
    return spans_on() ? stream.record_timed() : stream.record();
  }
  // `name` must outlive the step (a unit's name, or a static phase name). `pos`: compute spans
  // of stage 3, the fetch's position in the pass's order; `unit`: gathers, the unit.
  void span(bool compute, const char* category, const std::string& name, async::Event start, async::Event end,
            std::size_t pos = kNone, std::size_t unit = kNone) {
    if (spans_on()) spans_.push_back({compute, category, &name, std::move(start), std::move(end), pos, unit});
  }
  // `compute` waits for `event` of another stream; with timing, the time it stands there is
  // measured (a timed event on each side of the wait).
  Result<void> wait(async::Stream& compute, const async::Event& event, const std::string& what);
  // The same after everything enqueued on `other` so far (the communication stream's reductions).
  Result<void> wait_for(async::Stream& compute, async::Stream& other, const std::string& what) {
    COSHARD_TRY_ASSIGN(auto event, other.record());
    return wait(compute, event, what);
  }

  // The timeline's zero: spans can only be trusted to start after it if both streams are
  // ordered after it (under load a stream may stamp it later than the host recorded it).
  Result<void> set_epoch(async::Event epoch, async::Stream& compute, async::Stream& comm);
  // A timed epoch on `compute` when anything is timed (the engine's creation).
  Result<void> start(async::Stream& compute, async::Stream& comm);

  // A new pass: what an unfinished one left is dropped.
  void begin_pass() noexcept {
    spans_.clear();
    waits_.clear();
  }
  // After the pass's last event has passed: the waits' total and the timeline into `stats`, and
  // the measurements learnt (`phase` with `positions` fetches).
  void collect(EngineStepStats& stats, const std::string& phase, std::size_t positions);
  // The NVMe store's transfers on the timeline's "nvme read" and "nvme write" tracks. They are timed on the host's
  // clock: a CPU epoch carries its own time on that clock; a GPU's epoch is placed at the host's
  // time when it was set (a launch's latency apart, or more).
  void add_nvme_spans(EngineStepStats& stats, std::vector<offload::NvmeTransferSpan> spans) const;

  // Adaptive prefetch: measured milliseconds (device timestamps, a moving average over steps) of
  // each unit's gather (< 0: not measured yet), and of the compute at each position of each
  // phase's fetch order. The ranks replace them with their average (agree_on_measurements).
  std::vector<double> gather_ms;
  std::map<std::string, std::vector<double>> compute_ms;

 private:
  struct Span {
    bool compute;
    const char* category;
    const std::string* name;
    async::Event start, end;
    std::size_t pos, unit;
  };
  static void learn(double& average, double sample) { average = average < 0 ? sample : 0.5 * average + 0.5 * sample; }
  // A gather's span also holds time spent waiting for peers and for a busy host: the estimate
  // follows the fastest recent sample, rising by at most a quarter a step when the link slows.
  static void learn_gather(double& estimate, double sample) {
    estimate = estimate < 0 ? sample : std::min(sample, 1.25 * estimate);
  }
  bool timing_ = false, record_ = false, adaptive_ = false;
  std::vector<Span> spans_;
  std::vector<std::pair<async::Event, async::Event>> waits_;
  async::Event epoch_;
  std::chrono::steady_clock::time_point host_epoch_ = std::chrono::steady_clock::now();
};

}  // namespace coshard::zero::detail
