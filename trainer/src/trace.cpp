#include "coshard/trainer/trace.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <set>

namespace coshard::trainer {

void TraceWriter::add(int rank, std::int64_t step, std::span<const modules::TimelineSpan> spans) {
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
  auto tid_of = [](const std::string& track) { return track == "compute" ? 1 : 2; };
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
                      {"args", {{"name", track + " stream"}}}});
  }
  for (int rank : ranks)
    events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  nlohmann::json doc;
  doc["traceEvents"] = std::move(events);
  doc["displayTimeUnit"] = "ms";
  return doc.dump();
}

Result<void> TraceWriter::write(const std::filesystem::path& path) const {
  const std::string text = json();
  const std::filesystem::path tmp = path.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail(ErrorCode::io, "trace ", tmp.string(), ": cannot create (", std::strerror(errno), ")");
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return fail(ErrorCode::io, "trace ", tmp.string(), ": write failed after ", done, " of ", text.size(),
                  " bytes (", std::strerror(err), ")");
    }
    done += static_cast<std::size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) return fail(ErrorCode::io, "trace ", tmp.string(), ": fsync failed");
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return fail(ErrorCode::io, "trace: renaming ", tmp.string(), " to ", path.string(), " failed (", std::strerror(errno), ")");
  return {};
}

}  // namespace coshard::trainer
