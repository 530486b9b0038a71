// One MPI communicator's collectives (private to the MPI backend, rules in mpi.hpp): a launched
// group's messages posted, driven to the end, checked and reduced, on the communication stream's
// worker; the failure state the communicator and its queued closures share.
#pragma once

#include <mpi.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coshard/async/result.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/mpi.hpp"
#include "mpi_process.hpp"

namespace coshard::collectives::detail {

inline constexpr int kMpiAbortTag = 1;       // abort notices (a rank that failed)
inline constexpr int kMpiFirstGroupTag = 2;  // groups: this plus their sequence number, wrapped
inline constexpr std::size_t kMpiAbortNoticeBytes = 2048;
// MPI counts are int: a larger buffer goes as several messages, split the same on both sides.
inline constexpr std::size_t kMpiMaxMessageBytes = std::size_t{1} << 30;

// The 16 bytes every rank sends every peer first in a group.
struct MpiGroupHeader {
  std::uint64_t seq = 0;
  std::uint64_t signature = 0;  // a hash of what every rank must agree on (same_signature)
  std::array<char, 48> purpose{};  // the first op's that has one: a mismatch names the peer's
};

// The state the stream's closures share with the communicator (a closure may still be queued
// when the communicator is destroyed: the stream runs it first).
class MpiChannel {
 public:
  MpiChannel(std::shared_ptr<MpiProcess> process, MPI_Comm comm, int rank, int size, MpiOptions options);
  ~MpiChannel();
  MpiChannel(const MpiChannel&) = delete;
  MpiChannel& operator=(const MpiChannel&) = delete;

  MPI_Comm comm() const noexcept { return comm_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const MpiOptions& options() const noexcept { return options_; }

  // The error that broke the communicator, if any (sticky).
  Result<void> status() const;
  // This rank failed: every peer hears it (on the abort tag) and stops at once. False when it
  // had already aborted.
  bool abort(const std::string& reason);
  // Runs one group on the stream's worker.
  Result<void> run(std::uint64_t seq, const std::vector<CollectiveOp>& ops);

 private:
  // One message of a group in flight: what it is for, to name a peer that never sends.
  struct Message {
    enum class Kind : std::uint8_t { header, receive, send } kind;
    int peer;
    std::size_t bytes;  // expected (receives)
  };
  struct Group {
    std::uint64_t seq;
    int tag;
    const std::vector<CollectiveOp>& ops;
    std::chrono::steady_clock::time_point deadline;
    std::vector<MPI_Request> requests{};
    std::vector<Message> messages{};
  };

  // Bytes of one peer's contribution that this rank reduces (0 for other kinds).
  std::size_t reduced_bytes(const CollectiveOp& op) const;
  Result<void> post_receive(Group& g, void* buffer, std::size_t bytes, int peer, Message::Kind kind);
  Result<void> post_send(Group& g, const void* buffer, std::size_t bytes, int peer);
  // The messages of one op before any reduction: blocks to every peer, and from every peer
  // either into the output (all_gather, broadcast) or into scratch (the blocks this rank reduces).
  Result<void> post_first_phase(Group& g, const CollectiveOp& op, std::byte* scratch, const std::size_t* scratch_at);
  // all_reduce, after the reduction: this rank's slice to every peer, theirs into recv.
  Result<void> post_second_phase(Group& g, const CollectiveOp& op);
  // This rank's block (reduce_scatter) or slice (all_reduce), in rank order 0..n-1, with the
  // Local backend's arithmetic: the same bits.
  void reduce_own_part(const CollectiveOp& op, std::byte* scratch, const std::size_t* scratch_at);
  // Drives MPI until every message of `g` is through: headers checked as they arrive, an abort
  // notice heard, the deadline kept. Spins a little, then sleeps in growing steps (the ranks
  // share the cores with compute).
  Result<void> wait(Group& g, const MpiGroupHeader& mine);
  Result<void> check_header(Group& g, const MpiGroupHeader& mine, int peer);
  // An abort notice from a peer that failed, if one came.
  Result<void> hear_abort(Group& g);
  Result<void> timed_out(Group& g);
  // The group cannot finish: its receives are cancelled, its sends let go, and the
  // communicator fails for good with `message`.
  Unexpected broken(Group& g, ErrorCode code, std::string message);
  void set_failed(ErrorCode code, std::string message);  // under state_mutex_

  std::shared_ptr<MpiProcess> process_;
  MPI_Comm comm_;
  const int rank_;
  const int size_;
  const MpiOptions options_;
  // The stream's worker only.
  std::vector<MpiGroupHeader> headers_;
  std::vector<std::int64_t> reached_;  // per peer: the last group whose header came here
  std::vector<std::byte> scratch_;
  std::vector<std::byte> in_place_;

  mutable std::mutex state_mutex_;  // guards what follows
  std::atomic<bool> failed_{false};
  ErrorCode failure_code_ = ErrorCode::closed;
  std::string failure_;
  bool aborted_here_ = false;
  MPI_Request abort_receive_ = MPI_REQUEST_NULL;
  std::vector<char> abort_notice_ = std::vector<char>(kMpiAbortNoticeBytes);
};

}  // namespace coshard::collectives::detail
