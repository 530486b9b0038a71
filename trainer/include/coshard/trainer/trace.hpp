// A Chrome-trace / Perfetto JSON timeline of training steps: one process per rank, one thread per
// stream (compute, comm), a complete event ("X") per span and an instant ("i") per release, all
// from device timestamps (zero::TimelineSpan). Open it in ui.perfetto.dev or chrome://tracing.
#pragma once

#include <cstdint>
#include <filesystem>
#include <mutex>
#include <span>
#include <vector>

#include "coshard/async/result.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::trainer {

class TraceWriter {
 public:
  // Spans of one step of one rank; thread-safe (ranks as threads add concurrently).
  void add(int rank, std::int64_t step, std::span<const zero::TimelineSpan> spans);
  std::size_t size() const;
  // The whole trace, written atomically (temporary, fsync, rename).
  Result<void> write(const std::filesystem::path& path) const;
  // The JSON text (for tests and for writers of their own).
  std::string json() const;

 private:
  struct Entry {
    int rank;
    std::int64_t step;
    zero::TimelineSpan span;
  };
  mutable std::mutex mutex_;
  std::vector<Entry> entries_;
};

}  // namespace coshard::trainer
