// The collective flight recorder: each communicator keeps a ring of its last collectives
// (sequence number, ops, stream, enqueue / start / end times, state), so a hang or a mismatch can
// be read after the fact: which rank is behind, at which sequence number, in which op.
//
// - Every backend records: a launch is `enqueued`; `started` when its stream reaches it (the
//   Local backend; NCCL records no start: its kernel's start is not observed without a sync);
//   `completed` or `failed` when known (Local: when it returns; NCCL: when the watchdog sees its
//   event pass, or the communicator fail).
// - Dumps: with a folder set (set_flight_recorder_dir, coshard-train --flight-recorder DIR), a
//   communicator writes its ring as rank<R>-of<N>.json there (rank<R>-of<N>.<label>.json for a
//   group split from a world and labelled: a mesh's data<t> and tensor<d> groups, shard groups,
//   so that no group's file replaces another's) the first time one of its
//   collectives times out or finds a mismatch, or when it is aborted (a rank failed), and logs
//   the last entries at error level. write_flight_record() dumps on demand (SIGUSR1 in
//   coshard-train).
// - diagnose() reads every rank's dump and says who is behind. A rank with no dump (stopped,
//   killed, stuck outside a collective) is placed from its peers': every collective needs every
//   rank, so a peer's completed #k means the silent rank took part in #k too.
//
// Times are microseconds of the system clock (comparable between the processes of a machine).
// The ring costs one short lock per launch and per state change, never per element; a launch's
// ops are kept as the backend's shared list and described only when the ring is read (formatting
// them at each launch cost 0.3 us of a stage-3 fetch's 1.4 us of host time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/result.hpp"
#include "coshard/collectives/communicator.hpp"

namespace coshard::collectives {

enum class CollectiveState : std::uint8_t { enqueued, started, completed, failed };
std::string_view to_string(CollectiveState state) noexcept;

struct CollectiveRecord {
  std::uint64_t seq = 0;
  std::string ops;     // describe(group): "[all_gather(count=1024, f32)]"
  std::string stream;  // the communication stream's name
  std::int64_t enqueued_us = 0;
  std::int64_t started_us = -1;  // -1: not observed
  std::int64_t ended_us = -1;
  CollectiveState state = CollectiveState::enqueued;
};

// One rank's dump.
struct FlightRecord {
  int rank = 0;
  int size = 1;
  std::string backend;
  std::string reason;  // why it was written ("SIGUSR1", the error that broke the communicator, ...)
  std::int64_t written_us = 0;
  std::uint64_t launched = 0;              // every launch so far (the ring keeps the last ones)
  std::vector<CollectiveRecord> entries;   // oldest first
  // Which communicator (FlightRecorder::set_label): empty for a world, else a group split from
  // one ("tensor0": rank/size are within it). The file is rank<R>-of<N>[.<label>].json.
  std::string label;
  // The highest sequence number completed (-1: none in the ring).
  std::int64_t last_completed() const noexcept;
  // The first entry not completed (enqueued, started or failed), if any.
  const CollectiveRecord* first_open() const noexcept;
};

class FlightRecorder {
 public:
  using Ops = std::shared_ptr<const std::vector<CollectiveOp>>;
  static constexpr std::size_t kDefaultCapacity = 256;
  // `stream`: the name of the communication stream every entry is on.
  explicit FlightRecorder(std::string stream, std::size_t capacity = kDefaultCapacity);

  void enqueued(std::uint64_t seq, Ops ops);
  void started(std::uint64_t seq);
  void ended(std::uint64_t seq, bool ok);
  // Every entry not yet ended is failed (the communicator broke).
  void fail_open();
  std::vector<CollectiveRecord> snapshot() const;
  std::uint64_t launched() const;

  // Writes the ring once, on the first failure, when a dump folder is set; later calls do
  // nothing. Safe from any thread.
  void dump_on_failure(int rank, int size, std::string_view backend, std::string_view reason);

  // Names the communicator in its records and their files (Communicator::set_flight_label): 1 to
  // 64 of a-z, 0-9, '_' and '-'; the same on every rank of it, unlike any other's of the process
  // (a mesh's "data<t>" and "tensor<d>"), so that no group's dump replaces another's.
  Result<void> set_label(std::string_view label);
  std::string label() const;
  static Result<void> check_label(std::string_view label);

 private:
  struct Slot {
    std::uint64_t seq = 0;
    Ops ops;
    std::int64_t enqueued_us = 0, started_us = -1, ended_us = -1;
    CollectiveState state = CollectiveState::enqueued;
  };
  Slot* find(std::uint64_t seq);  // under mutex_

  const std::string stream_;
  mutable std::mutex mutex_;
  std::vector<Slot> ring_;
  std::size_t capacity_;
  std::size_t next_ = 0;  // the slot the next launch takes
  std::uint64_t launched_ = 0;
  bool dumped_ = false;
  std::string label_;
};

// The folder automatic dumps go to (empty, the default: none). Process-wide.
void set_flight_recorder_dir(const std::filesystem::path& dir);
std::filesystem::path flight_recorder_dir();

// Writes `comm`'s ring into `dir` (created if missing) as rank<R>-of<N>.json, atomically
// (a file beside it, then renamed), and logs its last entries; the file's path.
Result<std::filesystem::path> write_flight_record(const Communicator& comm, std::string_view reason,
                                                  const std::filesystem::path& dir);
Result<std::filesystem::path> write_flight_record(const FlightRecord& record, const std::filesystem::path& dir);
// Every rank<R>-of<N>.json in `dir`, by rank; a file that is not a dump is an error naming it.
Result<std::vector<FlightRecord>> read_flight_records(const std::filesystem::path& dir);
// One dump's text, and back (`name` goes into the errors).
std::string flight_record_json(const FlightRecord& record);
Result<FlightRecord> parse_flight_record(std::string_view text, std::string_view name);
// Who is behind, at which sequence number, in which op; ranks of `world_size` with no record
// are named too. Then the same for each labelled group's records, its ranks numbered within it. Several lines of text, ending in a newline.
std::string diagnose(std::span<const FlightRecord> records, int world_size);

}  // namespace coshard::collectives
