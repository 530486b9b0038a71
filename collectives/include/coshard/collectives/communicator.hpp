// Communicator: enqueue-only collectives on a communication stream.
//
// Every collective is enqueued on stream() and returns the Event that marks its completion: the
// host never waits. Order the inputs first (stream().wait(producer_event)) and the consumers
// after (consumer_stream.wait(returned_event)), or co_await the event.
//
//   all_gather(send[count]           -> recv[size*count], rank-major: rank q's block at q*count)
//   reduce_scatter(send[size*count]  -> recv[count], this rank's block of the reduction)
//   all_reduce(send[count]           -> recv[count])
//   broadcast(send[count] on root    -> recv[count] on every rank; non-roots may pass send=null)
//   all_to_all(send[size*count]      -> recv[size*count]: block q of send goes to rank q, and
//                                       block q of recv came from rank q; never in place)
//   all_to_allv(send, send_counts[size] -> recv, recv_counts[size]: send_counts[q] elements go
//               to rank q and recv_counts[q] come from it, each side packed in rank order;
//               rank p's send_counts[q] must be rank q's recv_counts[p]; never in place)
//   barrier()
//
// Several collectives can be issued as one Coalesced group: one launch (one NCCL group; one
// rendezvous on the Local backend), so a fetch unit or bucket costs one launch, never one per
// parameter. A single collective is a group of one.
//
// Rules, as for NCCL: every rank launches the same sequence of groups (same kinds, counts, types,
// ops, roots); in-place use is allowed where NCCL allows it (all_gather with send at this
// rank's block of recv, reduce_scatter with recv at this rank's block of send, all_reduce and
// broadcast with send == recv). A collective that cannot complete (a peer gone, a mismatched
// sequence) fails its event after the backend's timeout, and the communicator stays failed.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/event.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/collectives/dtype.hpp"

namespace coshard::collectives {

enum class CollectiveKind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier, all_to_all, all_to_allv };
std::string_view to_string(CollectiveKind kind) noexcept;

struct CollectiveOp {
  CollectiveKind kind = CollectiveKind::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;  // elements per rank (see the table above; all_to_allv: 0, or 1 where
                          // its send and receive counts differ in length, which validate refuses)
  DataType dtype = DataType::u8;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
  // What the collective is for ("the gradients of unit h.3"), for errors only: a mismatch names
  // each rank's, so ranks that took different paths (a rank-dependent branch) are named by what
  // they were doing, not only by sizes. Not part of the signature. Cut to fit; copied with the op.
  std::array<char, 48> purpose{};
  // all_to_allv: the elements sent to each rank, then those received from each (2 * size entries;
  // `count` is unused). Their sum may differ between ranks: only each pair must agree.
  std::vector<std::size_t> counts{};

  // all_to_allv: the elements this rank sends in all, and receives in all.
  std::size_t sent_elements() const noexcept;
  std::size_t received_elements() const noexcept;
  // all_to_allv: where the elements for rank `to` start in send (the counts before it).
  std::size_t send_offset(std::size_t to) const noexcept;

  void set_purpose(std::string_view text) noexcept {
    const std::size_t n = std::min(text.size(), purpose.size() - 1);
    std::copy_n(text.begin(), n, purpose.begin());
    purpose[n] = '\0';
  }
  std::string_view purpose_text() const noexcept { return purpose.data(); }

  // The part every rank must agree on ("all_gather(count=1024, f32)").
  std::string signature() const;
  bool same_signature(const CollectiveOp& other) const noexcept {
    return kind == other.kind && count == other.count && dtype == other.dtype &&
           (kind != CollectiveKind::reduce_scatter && kind != CollectiveKind::all_reduce ? true : op == other.op) &&
           (kind != CollectiveKind::broadcast || root == other.root);
  }
};

// "[all_gather(count=1024, f32) for the parameters of unit h.0, barrier()]": a group's ops, for
// errors and log lines.
std::string describe(std::span<const CollectiveOp> ops);

// Collectives to launch together. Build it, then Communicator::launch(group).
class Coalesced {
 public:
  Coalesced& all_gather(const void* send, void* recv, std::size_t count, DataType dtype);
  Coalesced& reduce_scatter(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op);
  Coalesced& all_reduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op);
  Coalesced& broadcast(const void* send, void* recv, std::size_t count, DataType dtype, int root);
  Coalesced& all_to_all(const void* send, void* recv, std::size_t count, DataType dtype);
  // send_counts and recv_counts have one entry per rank of the communicator it launches on.
  Coalesced& all_to_allv(const void* send, std::span<const std::size_t> send_counts, void* recv,
                         std::span<const std::size_t> recv_counts, DataType dtype);
  Coalesced& barrier();
  // What the op added last is for (CollectiveOp::purpose).
  Coalesced& purpose(std::string_view text) noexcept {
    if (!ops_.empty()) ops_.back().set_purpose(text);
    return *this;
  }

  std::span<const CollectiveOp> ops() const noexcept { return ops_; }
  bool empty() const noexcept { return ops_.empty(); }

 private:
  std::vector<CollectiveOp> ops_;
};

class FlightRecorder;  // flight_recorder.hpp

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual std::string_view backend() const noexcept = 0;
  // The communication stream every collective of this communicator is enqueued on.
  virtual async::Stream& stream() noexcept = 0;

  // Enqueues the group as one launch; the event marks the completion of all of it.
  virtual Result<async::Event> launch(const Coalesced& group) = 0;

  // Collective over all ranks (each calls it, from its own thread): ranks with the same color
  // form a new communicator, ranked by (key, old rank). A negative color takes no part and gets
  // a null communicator. Blocks the calling thread until every rank called (counted, as setup).
  virtual Result<std::unique_ptr<Communicator>> split(int color, int key) = 0;

  // Groups launched so far (a coalesced group counts once).
  virtual std::uint64_t launches() const noexcept = 0;

  // Whether the communicator still works: the error that broke it (a timed-out or mismatched
  // collective, an aborted NCCL communicator), if any. On the Local backend the failed event
  // carries the same error; an aborted NCCL communicator's events still complete (its kernels
  // exit early), so check status() after awaiting where the data must be trusted.
  virtual Result<void> status() const = 0;

  // This rank has failed and stops: every rank's current and later collectives fail at once
  // with an error naming this rank and `reason`, instead of waiting out the timeout for a
  // rank that will never arrive. Local: the group breaks for every rank. NCCL: this rank's
  // communicator is aborted (its peers' watchdogs see the missing rank at their timeout).
  // Safe from any thread, idempotent; the first reason is the one reported.
  virtual void abort(const std::string& reason) = 0;

  // The ring of this communicator's last collectives (flight_recorder.hpp); null for a backend
  // that keeps none. The Local and NCCL backends keep one.
  virtual const FlightRecorder* flight_recorder() const noexcept { return nullptr; }
  // Names a communicator split from a world in its flight records and their files
  // (FlightRecorder::set_label; a label that is no file-name word is refused by name). Nothing to
  // name for a backend that keeps no record.
  virtual Result<void> set_flight_label(std::string_view label);
  // The label set (empty: none, a world's).
  std::string flight_label() const;

  // One collective; `purpose` says what it is for in a mismatch's message (CollectiveOp::purpose).
  Result<async::Event> all_gather(const void* send, void* recv, std::size_t count, DataType dtype,
                                  std::string_view purpose = {}) {
    return launch(Coalesced{}.all_gather(send, recv, count, dtype).purpose(purpose));
  }
  Result<async::Event> reduce_scatter(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                                      std::string_view purpose = {}) {
    return launch(Coalesced{}.reduce_scatter(send, recv, count, dtype, op).purpose(purpose));
  }
  Result<async::Event> all_reduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                                  std::string_view purpose = {}) {
    return launch(Coalesced{}.all_reduce(send, recv, count, dtype, op).purpose(purpose));
  }
  Result<async::Event> broadcast(const void* send, void* recv, std::size_t count, DataType dtype, int root,
                                 std::string_view purpose = {}) {
    return launch(Coalesced{}.broadcast(send, recv, count, dtype, root).purpose(purpose));
  }
  Result<async::Event> all_to_all(const void* send, void* recv, std::size_t count, DataType dtype,
                                  std::string_view purpose = {}) {
    return launch(Coalesced{}.all_to_all(send, recv, count, dtype).purpose(purpose));
  }
  Result<async::Event> all_to_allv(const void* send, std::span<const std::size_t> send_counts, void* recv,
                                   std::span<const std::size_t> recv_counts, DataType dtype,
                                   std::string_view purpose = {}) {
    return launch(Coalesced{}.all_to_allv(send, send_counts, recv, recv_counts, dtype).purpose(purpose));
  }
  Result<async::Event> barrier() { return launch(Coalesced{}.barrier()); }
};

// Labels `child`, split from `parent`, as `name` within the parent's label ("data1" then
// "data1-shard2-0"): each group of a process's splits named apart in the flight recorder.
Result<void> label_split(const Communicator& parent, Communicator& child, std::string_view name);

// Checks one op against a communicator's rank and size: pointers, root, sizes that overflow.
// Backends call it for every op before enqueueing; the message names the value and the rule.
Result<void> validate(const CollectiveOp& op, int rank, int size);

}  // namespace coshard::collectives
