#include "coshard/trainer/trace.hpp"

#include "coshard/async/files.hpp"

#include <nlohmann/json.hpp>

#include <set>


namespace coshard::trainer {

void TraceWriter::add(int rank, std::int64_t step, std::span<const zero::TimelineSpan> spans) {
  std::lock_guard lock(mutex_);
  for (const auto& s : spans) entries_.push_back({rank, step, s});
}

std::size_t TraceWriter::size() const {
  std::lock_guard lock(mutex_);
  return entries_.size();
}

std::string TraceWriter::json() const {
  std::lock_guard lock(mutex_);
  nlohmann::json events = nlohmann::json::array();
  auto tid_of = [](const std::string& track) {
    if (track == "compute") return 1;
    if (track == "comm") return 2;
    return track == "nvme read" ? 3 : 4;  // the NVMe store's transfers
  };
  std::set<std::pair<int, std::string>> threads;
  for (const auto& e : entries_) {
    nlohmann::json ev;
    ev["name"] = e.span.category + " " + e.span.name;
    ev["cat"] = e.span.category;
    ev["pid"] = e.rank;
    ev["tid"] = tid_of(e.span.track);
    ev["ts"] = e.span.start_ms * 1e3;  // microseconds
    if (e.span.end_ms > e.span.start_ms || e.span.category != "release") {
      ev["ph"] = "X";
      ev["dur"] = (e.span.end_ms - e.span.start_ms) * 1e3;
    } else {
      ev["ph"] = "i";
      ev["s"] = "t";
    }
    ev["args"] = {{"step", e.step}, {"unit", e.span.name}};
    events.push_back(std::move(ev));
    threads.insert({e.rank, e.span.track});
  }
  std::set<int> ranks;
  for (const auto& [rank, track] : threads) {
    ranks.insert(rank);
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", rank}, {"tid", tid_of(track)},
                      {"args", {{"name", tid_of(track) <= 2 ? track + " stream" : track}}}});
  }
  for (int rank : ranks)
    events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  nlohmann::json doc;
  doc["traceEvents"] = std::move(events);
  doc["displayTimeUnit"] = "ms";
  return doc.dump();
}

Result<void> TraceWriter::write(const std::filesystem::path& path) const {
  auto written = async::write_file_atomic(path, json());
  if (!written) return fail(std::move(written).error().with_context("trace"));
  return {};
}

}  // namespace coshard::trainer
