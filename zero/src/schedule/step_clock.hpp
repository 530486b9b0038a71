// A step's time split (StepTimeSplit): the counters it is read from, taken at one step's end and
// subtracted at the next. Reading them is a load each (the streams' busy time, the NVMe store's
// bytes and busy time): no event, no wait. Private: not installed.
#pragma once

#include <chrono>
#include <optional>

#include "coshard/async/stream.hpp"
#include "coshard/offload/nvme_store.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

class StepClock {
 public:
  struct Sources {
    const async::Stream* compute = nullptr;
    const async::Stream* optimizer = nullptr;  // the host optimizer's stream (optimizer offloaded)
    const offload::NvmeStore* store = nullptr;  // parameters or optimizer state on NVMe
  };
  // Starts an interval unless one is running (the first step's begin_step).
  void start(const Sources& from) noexcept {
    if (!last_) last_ = read(from);
  }
  // The interval since the start or the last lap; the next one starts now.
  StepTimeSplit lap(const Sources& from) noexcept;

 private:
  struct Reading {
    std::chrono::steady_clock::time_point at;
    std::optional<double> compute_ms, optimizer_ms;
    std::optional<offload::NvmeStoreStats> nvme;
  };
  static Reading read(const Sources& from) noexcept;
  std::optional<Reading> last_;
};

}  // namespace coshard::zero::detail
