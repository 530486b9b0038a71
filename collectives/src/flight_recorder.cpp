// The flight recorder's ring, its dumps and the diagnosis (rules at the top of
// coshard/collectives/flight_recorder.hpp).
#include "coshard/collectives/flight_recorder.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string_view>

#include "coshard/async/files.hpp"
#include "coshard/async/log.hpp"
#include "coshard/async/json_limits.hpp"
#include "coshard/async/replacing_file.hpp"

namespace coshard::collectives {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::mutex g_dir_mutex;
fs::path g_dir;

bool is_label_char(char ch) { return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '-'; }
constexpr std::size_t kMaxLabel = 64;

std::string file_name(int rank, int size, const std::string& label) {
  return "rank" + std::to_string(rank) + "-of" + std::to_string(size) + (label.empty() ? "" : "." + label) + ".json";
}

// Whether `name` has the form file_name gives: rank<digits>-of<digits>[.<label>].json.
bool is_record_name(std::string_view name) {
  auto take_digits = [&name] {
    std::size_t n = 0;
    while (n < name.size() && name[n] >= '0' && name[n] <= '9') ++n;
    name.remove_prefix(n);
    return n > 0;
  };
  auto take = [&name](std::string_view word) {
    if (!name.starts_with(word)) return false;
    name.remove_prefix(word.size());
    return true;
  };
  if (!(take("rank") && take_digits() && take("-of") && take_digits())) return false;
  if (name == ".json") return true;
  if (!take(".") || !name.ends_with(".json")) return false;
  name.remove_suffix(5);
  return !name.empty() && name.size() <= kMaxLabel && std::all_of(name.begin(), name.end(), is_label_char);
}

std::string describe_entry(const CollectiveRecord& e) {
  return "#" + std::to_string(e.seq) + " " + e.ops + " " + std::string(to_string(e.state));
}

// "0, 2, 5"; a long list is cut after 16 (a record of a huge world must not print millions).
std::string rank_names(const std::vector<int>& ranks) {
  constexpr std::size_t kShown = 16;
  std::string s;
  for (std::size_t i = 0; i < ranks.size() && i < kShown; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kShown) s += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return s;
}

}  // namespace

std::string_view to_string(CollectiveState state) noexcept {
  switch (state) {
    case CollectiveState::enqueued: return "enqueued";
    case CollectiveState::started: return "started";
    case CollectiveState::completed: return "completed";
    case CollectiveState::failed: return "failed";
  }
  return "unknown-state";
}

std::int64_t FlightRecord::last_completed() const noexcept {
  std::int64_t last = -1;
  for (const auto& e : entries)
    if (e.state == CollectiveState::completed) last = std::max(last, static_cast<std::int64_t>(e.seq));
  return last;
}

const CollectiveRecord* FlightRecord::first_open() const noexcept {
  for (const auto& e : entries)
    if (e.state != CollectiveState::completed) return &e;
  return nullptr;
}

FlightRecorder::FlightRecorder(std::string stream, std::size_t capacity)
    : stream_(std::move(stream)), capacity_(std::max<std::size_t>(capacity, 1)) {
  ring_.reserve(capacity_);
}

void FlightRecorder::enqueued(std::uint64_t seq, Ops ops) {
  Slot entry{seq, std::move(ops), now_us(), -1, -1, CollectiveState::enqueued};
  std::lock_guard lock(mutex_);
  if (ring_.size() < capacity_) {
    ring_.push_back(std::move(entry));
  } else {
    ring_[next_] = std::move(entry);
  }
  next_ = (next_ + 1) % capacity_;
  ++launched_;
}

FlightRecorder::Slot* FlightRecorder::find(std::uint64_t seq) {
  // Recent entries are near the slot before next_: look backwards from there.
  for (std::size_t k = 1; k <= ring_.size(); ++k) {
    auto& e = ring_[(next_ + capacity_ - k) % capacity_ % ring_.size()];
    if (e.seq == seq) return &e;
  }
  return nullptr;
}

void FlightRecorder::started(std::uint64_t seq) {
  const auto t = now_us();
  std::lock_guard lock(mutex_);
  if (auto* e = find(seq); e && e->state == CollectiveState::enqueued) {
    e->started_us = t;
    e->state = CollectiveState::started;
  }
}

void FlightRecorder::ended(std::uint64_t seq, bool ok) {
  const auto t = now_us();
  std::lock_guard lock(mutex_);
  if (auto* e = find(seq); e && (e->state == CollectiveState::enqueued || e->state == CollectiveState::started)) {
    e->ended_us = t;
    e->state = ok ? CollectiveState::completed : CollectiveState::failed;
  }
}

void FlightRecorder::fail_open() {
  const auto t = now_us();
  std::lock_guard lock(mutex_);
  for (auto& e : ring_) {
    if (e.state == CollectiveState::enqueued || e.state == CollectiveState::started) {
      e.ended_us = t;
      e.state = CollectiveState::failed;
    }
  }
}

std::vector<CollectiveRecord> FlightRecorder::snapshot() const {
  std::lock_guard lock(mutex_);
  std::vector<CollectiveRecord> out;
  out.reserve(ring_.size());
  const std::size_t start = ring_.size() < capacity_ ? 0 : next_;
  for (std::size_t k = 0; k < ring_.size(); ++k) {
    const Slot& e = ring_[(start + k) % ring_.size()];
    out.push_back({e.seq, e.ops ? describe(*e.ops) : "[]", stream_, e.enqueued_us, e.started_us, e.ended_us, e.state});
  }
  return out;
}

std::uint64_t FlightRecorder::launched() const {
  std::lock_guard lock(mutex_);
  return launched_;
}

void FlightRecorder::dump_on_failure(int rank, int size, std::string_view backend, std::string_view reason) {
  const fs::path dir = flight_recorder_dir();
  {
    std::lock_guard lock(mutex_);
    if (dir.empty() || dumped_) return;
    dumped_ = true;
  }
  fail_open();
  FlightRecord record{rank, size, std::string(backend), std::string(reason), now_us(), launched(), snapshot(), label()};
  if (auto written = write_flight_record(record, dir); !written)
    COSHARD_LOG_ERROR(collectives, "flight recorder: {}", written.error().message());
}

Result<void> FlightRecorder::check_label(std::string_view label) {
  if (label.empty() || label.size() > kMaxLabel || !std::all_of(label.begin(), label.end(), is_label_char))
    return fail(ErrorCode::invalid_argument, "flight recorder label '", label.substr(0, 64),
                "': expected 1 to 64 of a-z, 0-9, '_' and '-' (it names the record's file)");
  return {};
}

Result<void> FlightRecorder::set_label(std::string_view label) {
  COSHARD_TRY(check_label(label));
  std::lock_guard lock(mutex_);
  label_ = label;
  return {};
}

std::string FlightRecorder::label() const {
  std::lock_guard lock(mutex_);
  return label_;
}

void set_flight_recorder_dir(const fs::path& dir) {
  std::lock_guard lock(g_dir_mutex);
  g_dir = dir;
}

fs::path flight_recorder_dir() {
  std::lock_guard lock(g_dir_mutex);
  return g_dir;
}

Result<fs::path> write_flight_record(const Communicator& comm, std::string_view reason, const fs::path& dir) {
  FlightRecord record{comm.rank(), comm.size(), std::string(comm.backend()), std::string(reason), now_us(), 0, {}, {}};
  if (const FlightRecorder* recorder = comm.flight_recorder()) {
    record.launched = recorder->launched();
    record.entries = recorder->snapshot();
    record.label = recorder->label();
  }
  return write_flight_record(record, dir);
}

std::string flight_record_json(const FlightRecord& r) {
  json j;
  j["format"] = "coshard.flight_record";
  j["rank"] = r.rank;
  j["size"] = r.size;
  j["backend"] = r.backend;
  j["reason"] = r.reason;
  j["written_us"] = r.written_us;
  j["launched"] = r.launched;
  if (!r.label.empty()) j["label"] = r.label;
  json entries = json::array();
  for (const auto& e : r.entries)
    entries.push_back({{"seq", e.seq}, {"ops", e.ops}, {"stream", e.stream}, {"enqueued_us", e.enqueued_us},
                       {"started_us", e.started_us}, {"ended_us", e.ended_us}, {"state", std::string(to_string(e.state))}});
  j["entries"] = std::move(entries);
  return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

Result<fs::path> write_flight_record(const FlightRecord& r, const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fail(ErrorCode::io, "flight recorder folder ", dir.string(), ": ", ec.message());
  if (!r.label.empty()) COSHARD_TRY(FlightRecorder::check_label(r.label));
  const fs::path path = dir / file_name(r.rank, r.size, r.label);
  {
    COSHARD_TRY_ASSIGN(auto file, async::ReplacingFile::create(path, "flight recorder file"));
    COSHARD_TRY(file.write(flight_record_json(r)));
    COSHARD_TRY(file.commit());
  }
  // The last entries to the log as well: a run whose folder is lost still shows them.
  const std::size_t shown = std::min<std::size_t>(r.entries.size(), 4);
  std::string last;
  for (std::size_t i = r.entries.size() - shown; i < r.entries.size(); ++i)
    last += (last.empty() ? "" : "; ") + describe_entry(r.entries[i]);
  COSHARD_LOG_WARN(collectives, "flight recorder: rank {} of {} ({}{}) wrote {} of its {} collectives to {} ({}); last: {}",
                    r.rank, r.size, r.backend, r.label.empty() ? "" : ", group " + r.label, r.entries.size(), r.launched,
                    path.string(), r.reason,
                    last.empty() ? "none" : last);
  return path;
}

Result<FlightRecord> parse_flight_record(std::string_view text, std::string_view name) {
  if (auto nested = async::check_json_nesting(text, name); !nested)
    return fail(std::move(nested).error().with_context("flight recorder file"));
  const json j = json::parse(text, nullptr, false);
  std::string why;  // the first field that is wrong
  auto note = [&](std::string what) {
    if (why.empty()) why = std::move(what);
  };
  auto bad = [&](const std::string& what) { return fail(ErrorCode::io, "flight recorder file ", name, ": ", what); };
  // Typed reads that never convert: a number of the wrong kind or range is an error, not UB.
  auto integer = [&](const json& obj, const char* key, std::int64_t lo) -> std::optional<std::int64_t> {
    const auto it = obj.find(key);
    if (it == obj.end()) {
      note(std::string("'") + key + "' is missing");
      return std::nullopt;
    }
    std::int64_t v = 0;
    if (it->is_number_unsigned()) {
      const auto u = it->get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        note(std::string("'") + key + "' is out of range");
        return std::nullopt;
      }
      v = static_cast<std::int64_t>(u);
    } else if (it->is_number_integer()) {
      v = it->get<std::int64_t>();
    } else {
      note(std::string("'") + key + "' is " + async::bounded_echo(it->dump()) + " (expected a whole number)");
      return std::nullopt;
    }
    if (v < lo) {
      note(std::string("'") + key + "' is " + std::to_string(v) + " (expected >= " + std::to_string(lo) + ")");
      return std::nullopt;
    }
    return v;
  };
  auto string = [&](const json& obj, const char* key) -> std::optional<std::string> {
    const auto it = obj.find(key);
    if (it == obj.end() || !it->is_string()) {
      note(std::string("'") + key + "' is missing or not a string");
      return std::nullopt;
    }
    return it->get<std::string>();
  };
  if (j.is_discarded() || !j.is_object()) return bad("not JSON");
  const auto format = j.find("format");
  if (format == j.end() || !format->is_string() || format->get<std::string>() != "coshard.flight_record")
    return bad("no \"format\": \"coshard.flight_record\"");
  FlightRecord r;
  const auto rank = integer(j, "rank", 0);
  const auto size = integer(j, "size", 1);
  const auto backend = string(j, "backend");
  const auto reason = string(j, "reason");
  const auto written = integer(j, "written_us", std::numeric_limits<std::int64_t>::min());
  const auto launched = integer(j, "launched", 0);
  if (!rank || !size || !backend || !reason || !written || !launched) return bad(why);
  if (*rank >= *size || *size > (1 << 24))
    return bad("rank " + std::to_string(*rank) + " of " + std::to_string(*size) + " (expected 0 <= rank < size <= 2^24)");
  r.rank = static_cast<int>(*rank);
  r.size = static_cast<int>(*size);
  // Echoed in every diagnosis: a record's own reason is a failure message (a few lines); one of
  // megabytes is cut, saying how long it was.
  r.backend = async::bounded_echo(*backend);
  r.reason = async::bounded_echo(*reason, 4096);
  r.written_us = *written;
  r.launched = static_cast<std::uint64_t>(*launched);
  if (j.contains("label")) {  // (absent for a world's record, and in older ones)
    const auto label = string(j, "label");
    if (!label) return bad(why);
    if (auto ok = FlightRecorder::check_label(*label); !ok) return bad(ok.error().message());
    r.label = *label;
  }
  const auto entries = j.find("entries");
  if (entries == j.end() || !entries->is_array()) return bad("'entries' is missing or not an array");
  for (const auto& e : *entries) {
    if (!e.is_object()) return bad("an entry is " + async::bounded_echo(e.dump()) + " (expected an object)");
    constexpr auto kAny = std::numeric_limits<std::int64_t>::min();
    const auto seq = integer(e, "seq", 0);
    const auto ops = string(e, "ops");
    const auto stream = string(e, "stream");
    const auto enqueued = integer(e, "enqueued_us", kAny);
    const auto started = integer(e, "started_us", -1);
    const auto ended = integer(e, "ended_us", -1);
    const auto state = string(e, "state");
    if (!seq || !ops || !stream || !enqueued || !started || !ended || !state) return bad("an entry: " + why);
    CollectiveRecord c{static_cast<std::uint64_t>(*seq), *ops, *stream, *enqueued, *started, *ended,
                       CollectiveState::enqueued};
    bool known = false;
    for (auto st : {CollectiveState::enqueued, CollectiveState::started, CollectiveState::completed, CollectiveState::failed})
      if (to_string(st) == *state) {
        c.state = st;
        known = true;
      }
    if (!known) return bad("state \"" + *state + "\" (expected enqueued, started, completed or failed)");
    r.entries.push_back(std::move(c));
  }
  return r;
}

// A record holds a ring of bounded entries and a reason: far below this.
constexpr std::size_t kMaxFlightRecordBytes = std::size_t{64} << 20;

Result<std::vector<FlightRecord>> read_flight_records(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return fail(ErrorCode::io, "flight recorder folder ", dir.string(), ": not a folder");
  std::vector<FlightRecord> out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (!is_record_name(entry.path().filename().string())) continue;
    // Only a regular file, of bounded size, is read: a folder or a fifo of a record's name, or a
    // link to /dev/zero, is named (it aborted, hung, or read without end).
    COSHARD_TRY_ASSIGN(const auto bytes, async::read_regular_file(entry.path(), kMaxFlightRecordBytes, "flight record"));
    const std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    COSHARD_TRY_ASSIGN(auto record, parse_flight_record(text, entry.path().string()));
    out.push_back(std::move(record));
  }
  if (ec) return fail(ErrorCode::io, "flight recorder folder ", dir.string(), ": ", ec.message());
  std::sort(out.begin(), out.end(), [](const FlightRecord& a, const FlightRecord& b) { return a.rank < b.rank; });
  return out;
}

namespace {

// One communicator's records (a world's, or a labelled group's): who is behind, in what.
std::string diagnose_group(std::span<const FlightRecord* const> records, int world_size, const std::string& label) {
  std::ostringstream s;
  std::map<int, const FlightRecord*> by_rank;
  for (const auto* r : records)
    if (r->size == world_size) by_rank[r->rank] = r;
  std::vector<int> silent;
  for (int q = 0; q < world_size; ++q)
    if (!by_rank.count(q)) silent.push_back(q);
  s << (label.empty() ? std::string("flight recorder: ") : "communicator " + label + ": ") << world_size
    << " ranks, records from " << by_rank.size();
  if (!silent.empty()) s << " (none from rank" << (silent.size() > 1 ? "s " : " ") << rank_names(silent) << ")";
  s << "\n";

  // Per rank: the last completed collective and the first one still open.
  std::int64_t most = -1;
  for (const auto& [q, r] : by_rank) {
    const std::int64_t last = r->last_completed();
    most = std::max(most, last);
    s << "  rank " << q << ": last completed #" << last;
    const CollectiveRecord* open = r->first_open();
    if (open) s << "; then #" << open->seq << " " << open->ops << " " << to_string(open->state) << " on " << open->stream;
    s << " (" << r->reason << ")\n";
  }
  // A silent rank took part in everything a peer completed.
  constexpr std::size_t kSilentShown = 8;  // one line each; the rest are counted
  if (silent.size() > kSilentShown)
    s << "  " << silent.size() - kSilentShown << " more ranks with no record than the " << kSilentShown << " below\n";
  for (std::size_t i = 0; i < silent.size() && i < kSilentShown; ++i) {
    const int q = silent[i];
    s << "  rank " << q << ": no record (stopped, killed, or stuck outside a collective); ";
    if (most < 0)
      s << "its peers completed no collective: it never finished #0\n";
    else
      s << "its peers completed #" << most << ", which every rank takes part in: it completed #" << most
        << " and never finished #" << most + 1 << "\n";
  }

  // The op the ranks ahead wait in, and whether they agree on it. A rank that completed as much
  // but never launched that collective is behind too.
  std::map<std::string, std::vector<int>> waiting_in;  // ops -> ranks in #most+1
  std::vector<int> caught_up;                          // completed #most, not in #most+1
  std::vector<int> behind = silent;
  for (const auto& [q, r] : by_rank) {
    if (r->last_completed() < most) {
      behind.push_back(q);
      continue;
    }
    bool in_next = false;
    for (const auto& e : r->entries)
      if (static_cast<std::int64_t>(e.seq) == most + 1) {
        waiting_in[e.ops].push_back(q);
        in_next = true;
      }
    if (!in_next) caught_up.push_back(q);
  }
  if (!waiting_in.empty()) behind.insert(behind.end(), caught_up.begin(), caught_up.end());
  std::sort(behind.begin(), behind.end());
  const std::string next = "#" + std::to_string(most + 1);
  auto ranks_phrase = [](const std::vector<int>& ranks, const char* one, const char* many) {
    return std::string(ranks.size() > 1 ? "ranks " : "rank ") + rank_names(ranks) + (ranks.size() > 1 ? many : one);
  };
  if (waiting_in.size() > 1) {
    s << "diagnosis: mismatch at " << next << ":";
    for (const auto& [ops, ranks] : waiting_in) s << " " << ranks_phrase(ranks, " launched ", " launched ") << ops << ";";
    s << " every rank must launch the same collectives in the same order\n";
  } else if (!behind.empty() && (!waiting_in.empty() || !silent.empty())) {
    s << "diagnosis: " << ranks_phrase(behind, " is", " are") << " behind";
    if (!waiting_in.empty()) {
      const auto& [ops, ranks] = *waiting_in.begin();
      s << ": " << ranks_phrase(ranks, " waits in ", " wait in ") << next << " " << ops;
    }
    s << "\n";
  } else if (!waiting_in.empty()) {
    s << "diagnosis: no rank is behind: every rank completed #" << most << " and is in " << next << " "
      << waiting_in.begin()->first << "\n";
  } else if (!behind.empty()) {
    // Nobody waits in a collective: the ranks were moving, each dumped at its own moment.
    s << "diagnosis: no rank waits in a collective: the run was moving when the ranks wrote their records (";
    bool first = true;
    for (const auto& [q, r] : by_rank) {
      s << (first ? "" : ", ") << "rank " << q << " at #" << r->last_completed();
      first = false;
    }
    s << "); nothing is stuck\n";
  } else {
    s << "diagnosis: no rank is behind: every rank completed #" << most << ", none is in a collective\n";
  }
  return s.str();
}

}  // namespace

std::string diagnose(std::span<const FlightRecord> records, int world_size) {
  // The world's records first; then each group split from it (a mesh's data and tensor groups,
  // shard groups), its ranks numbered within it.
  std::vector<const FlightRecord*> world;
  std::map<std::pair<std::string, int>, std::vector<const FlightRecord*>> groups;  // by label and size
  for (const auto& r : records) {
    if (!r.label.empty()) groups[{r.label, r.size}].push_back(&r);
    else if (r.size == world_size) world.push_back(&r);
  }
  std::string out = diagnose_group(world, world_size, "");
  for (const auto& [key, group] : groups) out += diagnose_group(group, key.second, key.first);
  return out;
}

}  // namespace coshard::collectives
