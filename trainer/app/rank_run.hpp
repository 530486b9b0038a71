// One rank of coshard-train: its trainer built and loaded, the steps with their metrics, samples
// and checkpoints, a stop signal's stop at a step every rank agrees on, then the export and the
// closing sample. Every rank runs it, as a thread (the Local backend) or as a process.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "coshard/async/event.hpp"
#include "coshard/async/task.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/trainer/data.hpp"
#include "coshard/trainer/trace.hpp"
#include "command_line.hpp"

namespace coshard::train_app {

class FlightDumps;  // flight_dumps.hpp

// What the ranks of one process share.
struct Shared {
  // Ranks as threads agree on the step to stop at through memory: the first rank to see the
  // signal at the top of step k sets k + 1. No rank can be past the top of k + 1 then (step k's
  // collectives need this rank), so every rank runs step k and stops before k + 1.
  std::atomic<std::int64_t> stop_at{std::numeric_limits<std::int64_t>::max()};
  std::atomic<std::int64_t> stopped_after{-1};
  std::mutex mutex;
  std::vector<std::string> errors;
  trainer::TraceWriter trace;
  async::Event epoch;  // ranks as threads share one clock: their timelines line up
  FlightDumps* flight = nullptr;  // --flight-recorder: a mesh's groups are registered with it
  void error(int rank, const std::string& message) {
    std::lock_guard lock(mutex);
    errors.push_back("rank " + std::to_string(rank) + ": " + message);
  }
};

// Rank `comm.rank()`'s run; `threads`: the ranks are threads of this process (they agree on the
// step to stop at through `shared`, else through one small all-reduce a step).
async::Task<Result<void>> run_rank(const Options& o, collectives::Communicator& comm, const trainer::TokenSource& data,
                                   const trainer::TokenSource* val, Shared& shared, bool threads);

}  // namespace coshard::train_app
