#include "mpi_channel.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "coshard/async/detail/cpu_relax.hpp"
#include "reduce.hpp"

namespace coshard::collectives::detail {
namespace {

using Clock = std::chrono::steady_clock;

// FNV-1a over what every rank must agree on (CollectiveOp::same_signature).
std::uint64_t signature_hash(std::span<const CollectiveOp> ops) {
  std::uint64_t h = 1469598103934665603ULL;
  auto mix = [&](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ULL;
    }
  };
  mix(ops.size());
  for (const CollectiveOp& op : ops) {
    mix(static_cast<std::uint64_t>(op.kind));
    mix(op.count);
    mix(static_cast<std::uint64_t>(op.dtype));
    if (op.kind == CollectiveKind::reduce_scatter || op.kind == CollectiveKind::all_reduce) mix(static_cast<std::uint64_t>(op.op));
    if (op.kind == CollectiveKind::broadcast) mix(static_cast<std::uint64_t>(op.root));
  }
  return h;
}

// Elements [begin, end) of all_reduce's slice for rank q (as the Local backend splits them).
std::size_t slice_begin(std::size_t count, int q, int size) {
  return count * static_cast<std::size_t>(q) / static_cast<std::size_t>(size);
}

}  // namespace

MpiChannel::MpiChannel(std::shared_ptr<MpiProcess> process, MPI_Comm comm, int rank, int size, MpiOptions options)
    : process_(std::move(process)),
      comm_(comm),
      rank_(rank),
      size_(size),
      options_(options),
      reached_(static_cast<std::size_t>(size), -1) {
  auto lock = process_->lock();
  MPI_Irecv(abort_notice_.data(), static_cast<int>(abort_notice_.size()), MPI_CHAR, MPI_ANY_SOURCE, kMpiAbortTag, comm_,
            &abort_receive_);
}

MpiChannel::~MpiChannel() {
  auto lock = process_->lock();
  if (abort_receive_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&abort_receive_);
    MPI_Request_free(&abort_receive_);
  }
  // Not freed here: Open MPI reuses a freed communicator's context id, and a message still in
  // flight on it (a cancelled group's data, a late abort notice) would match a receive of
  // the next communicator. Communicators are few; they go at MPI_Finalize.
  process_->retire(comm_);
}


Result<void> MpiChannel::status() const {
  if (!failed_.load(std::memory_order_acquire)) return {};
  std::lock_guard lock(state_mutex_);
  return fail(Error(failure_code_, failure_));
}

bool MpiChannel::abort(const std::string& reason) {
  {
    std::lock_guard lock(state_mutex_);
    if (aborted_here_) return false;
    aborted_here_ = true;
    if (!failed_.load()) set_failed(ErrorCode::closed, "MPI communicator rank " + std::to_string(rank_) + "/" +
                                                           std::to_string(size_) + " aborted: this rank failed: " + reason);
  }
  auto notice = std::make_shared<const std::string>(reason.substr(0, kMpiAbortNoticeBytes - 1));
  auto lock = process_->lock();
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(notice->data(), static_cast<int>(notice->size()), MPI_CHAR, q, kMpiAbortTag, comm_, &request) ==
        MPI_SUCCESS) {
      process_->keep_until_finalize(notice, request);
    }
  }
  return true;
}

Result<void> MpiChannel::run(std::uint64_t seq, const std::vector<CollectiveOp>& ops) {
  COSHARD_TRY(status());
  const auto deadline = Clock::now() + options_.timeout;
  const int tag = kMpiFirstGroupTag + static_cast<int>(seq % static_cast<std::uint64_t>(process_->tag_ub() - kMpiFirstGroupTag + 1));
  Group group{seq, tag, ops, deadline};
  MpiGroupHeader mine{seq, signature_hash(ops), {}};
  for (const CollectiveOp& op : ops)
    if (!op.purpose_text().empty()) {
      mine.purpose = op.purpose;
      break;
    }
  headers_.assign(static_cast<std::size_t>(size_), MpiGroupHeader{});
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    COSHARD_TRY(post_receive(group, &headers_[static_cast<std::size_t>(q)], sizeof(MpiGroupHeader), q, Message::Kind::header));
    COSHARD_TRY(post_send(group, &mine, sizeof(MpiGroupHeader), q));
  }
  // Scratch for the blocks this rank reduces: one per peer and reducing op, placed before
  // any receive is posted (the buffer must not move under MPI).
  std::vector<std::size_t> scratch_at(ops.size() * static_cast<std::size_t>(size_), 0);
  std::size_t scratch_bytes = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const std::size_t bytes = reduced_bytes(ops[i]);
    if (bytes == 0) continue;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      scratch_at[i * static_cast<std::size_t>(size_) + static_cast<std::size_t>(q)] = scratch_bytes;
      scratch_bytes += (bytes + 63) / 64 * 64;
    }
  }
  scratch_bytes += 64;  // a reduction's output when it would alias its input (in place)
  if (scratch_.size() < scratch_bytes) scratch_.resize(scratch_bytes);
  std::byte* scratch = scratch_.data();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    COSHARD_TRY(post_first_phase(group, ops[i], scratch, &scratch_at[i * static_cast<std::size_t>(size_)]));
  }
  COSHARD_TRY(wait(group, mine));
  bool second_phase = false;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const CollectiveOp& op = ops[i];
    if (op.kind != CollectiveKind::reduce_scatter && op.kind != CollectiveKind::all_reduce) continue;
    reduce_own_part(op, scratch, &scratch_at[i * static_cast<std::size_t>(size_)]);
    if (op.kind == CollectiveKind::all_reduce) {
      COSHARD_TRY(post_second_phase(group, op));
      second_phase = true;
    }
  }
  if (second_phase) COSHARD_TRY(wait(group, mine));
  return {};
}


std::size_t MpiChannel::reduced_bytes(const CollectiveOp& op) const {
  const std::size_t es = size_of(op.dtype);
  if (op.kind == CollectiveKind::reduce_scatter) return op.count * es;
  if (op.kind == CollectiveKind::all_reduce) {
    return (slice_begin(op.count, rank_ + 1, size_) - slice_begin(op.count, rank_, size_)) * es;
  }
  return 0;
}

Result<void> MpiChannel::post_receive(Group& g, void* buffer, std::size_t bytes, int peer, Message::Kind kind) {
  auto* at = static_cast<std::byte*>(buffer);
  for (std::size_t done = 0; done < bytes; done += kMpiMaxMessageBytes) {
    const std::size_t n = std::min(kMpiMaxMessageBytes, bytes - done);
    MPI_Request request = MPI_REQUEST_NULL;
    int r = MPI_SUCCESS;
    {
      auto lock = process_->lock();
      r = MPI_Irecv(at + done, static_cast<int>(n), MPI_BYTE, peer, g.tag, comm_, &request);
    }
    if (r != MPI_SUCCESS) return broken(g, ErrorCode::device, "MPI_Irecv from rank " + std::to_string(peer) + ": " + mpi_error_string(r));
    g.requests.push_back(request);
    g.messages.push_back({kind, peer, n});
  }
  return {};
}

Result<void> MpiChannel::post_send(Group& g, const void* buffer, std::size_t bytes, int peer) {
  const auto* at = static_cast<const std::byte*>(buffer);
  for (std::size_t done = 0; done < bytes; done += kMpiMaxMessageBytes) {
    const std::size_t n = std::min(kMpiMaxMessageBytes, bytes - done);
    MPI_Request request = MPI_REQUEST_NULL;
    int r = MPI_SUCCESS;
    {
      auto lock = process_->lock();
      r = MPI_Isend(at + done, static_cast<int>(n), MPI_BYTE, peer, g.tag, comm_, &request);
    }
    if (r != MPI_SUCCESS) return broken(g, ErrorCode::device, "MPI_Isend to rank " + std::to_string(peer) + ": " + mpi_error_string(r));
    g.requests.push_back(request);
    g.messages.push_back({Message::Kind::send, peer, n});
  }
  return {};
}

Result<void> MpiChannel::post_first_phase(Group& g, const CollectiveOp& op, std::byte* scratch, const std::size_t* scratch_at) {
  const std::size_t es = size_of(op.dtype);
  const std::size_t block = op.count * es;
  const auto* send = static_cast<const std::byte*>(op.send);
  auto* recv = static_cast<std::byte*>(op.recv);
  switch (op.kind) {
    case CollectiveKind::barrier:
      return {};
    case CollectiveKind::broadcast:
      if (block == 0) return {};
      if (rank_ == op.root) {
        for (int q = 0; q < size_; ++q) {
          if (q != rank_) COSHARD_TRY(post_send(g, send, block, q));
        }
        if (send != recv) std::memcpy(recv, send, block);
        return {};
      }
      return post_receive(g, recv, block, op.root, Message::Kind::receive);
    case CollectiveKind::all_gather: {
      if (block == 0) return {};
      std::byte* own = recv + static_cast<std::size_t>(rank_) * block;
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        COSHARD_TRY(post_receive(g, recv + static_cast<std::size_t>(q) * block, block, q, Message::Kind::receive));
        COSHARD_TRY(post_send(g, send, block, q));
      }
      if (send != own) std::memcpy(own, send, block);
      return {};
    }
    case CollectiveKind::all_to_allv: {  // (blocks packed in rank order on each side)
      const auto n = static_cast<std::size_t>(size_), me = static_cast<std::size_t>(rank_);
      std::size_t sent = 0, received = 0, own_from = 0, own_to = 0;
      for (std::size_t q = 0; q < n; ++q) {
        const std::size_t out = op.counts[q] * es, in = op.counts[n + q] * es;
        if (q == me) {
          own_from = sent;
          own_to = received;
        } else {
          if (in > 0) COSHARD_TRY(post_receive(g, recv + received, in, static_cast<int>(q), Message::Kind::receive));
          if (out > 0) COSHARD_TRY(post_send(g, send + sent, out, static_cast<int>(q)));
        }
        sent += out;
        received += in;
      }
      if (op.counts[me] > 0) std::memcpy(recv + own_to, send + own_from, op.counts[me] * es);
      return {};
    }
    case CollectiveKind::all_to_all: {
      if (block == 0) return {};
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        COSHARD_TRY(post_receive(g, recv + static_cast<std::size_t>(q) * block, block, q, Message::Kind::receive));
        COSHARD_TRY(post_send(g, send + static_cast<std::size_t>(q) * block, block, q));
      }
      const std::size_t own = static_cast<std::size_t>(rank_) * block;
      std::memcpy(recv + own, send + own, block);  // (validate: never in place)
      return {};
    }
    case CollectiveKind::reduce_scatter:
      if (block == 0) return {};
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        COSHARD_TRY(post_receive(g, scratch + scratch_at[q], block, q, Message::Kind::receive));
        COSHARD_TRY(post_send(g, send + static_cast<std::size_t>(q) * block, block, q));
      }
      return {};
    case CollectiveKind::all_reduce: {
      const std::size_t mine = reduced_bytes(op);
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        const std::size_t begin = slice_begin(op.count, q, size_), end = slice_begin(op.count, q + 1, size_);
        if (mine > 0) COSHARD_TRY(post_receive(g, scratch + scratch_at[q], mine, q, Message::Kind::receive));
        if (end > begin) COSHARD_TRY(post_send(g, send + begin * es, (end - begin) * es, q));
      }
      return {};
    }
  }
  return {};
}

Result<void> MpiChannel::post_second_phase(Group& g, const CollectiveOp& op) {
  const std::size_t es = size_of(op.dtype);
  auto* recv = static_cast<std::byte*>(op.recv);
  const std::size_t my_begin = slice_begin(op.count, rank_, size_);
  const std::size_t mine = reduced_bytes(op);
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    const std::size_t begin = slice_begin(op.count, q, size_), end = slice_begin(op.count, q + 1, size_);
    if (end > begin) COSHARD_TRY(post_receive(g, recv + begin * es, (end - begin) * es, q, Message::Kind::receive));
    if (mine > 0) COSHARD_TRY(post_send(g, recv + my_begin * es, mine, q));
  }
  return {};
}

void MpiChannel::reduce_own_part(const CollectiveOp& op, std::byte* scratch, const std::size_t* scratch_at) {
  const std::size_t es = size_of(op.dtype);
  const std::size_t bytes = reduced_bytes(op);
  if (bytes == 0) return;
  const std::size_t offset = op.kind == CollectiveKind::reduce_scatter ? static_cast<std::size_t>(rank_) * bytes
                                                                       : slice_begin(op.count, rank_, size_) * es;
  const std::byte* own = static_cast<const std::byte*>(op.send) + offset;
  std::byte* out = static_cast<std::byte*>(op.recv) + (op.kind == CollectiveKind::all_reduce ? offset : 0);
  std::vector<const void*> inputs(static_cast<std::size_t>(size_));
  for (int q = 0; q < size_; ++q) inputs[static_cast<std::size_t>(q)] = q == rank_ ? own : scratch + scratch_at[q];
  const bool aliases = out < own + bytes && own < out + bytes;
  if (!aliases) {
    detail::reduce(op.dtype, op.op, out, inputs, bytes / es, size_);
    return;
  }
  if (in_place_.size() < bytes) in_place_.resize(bytes);
  detail::reduce(op.dtype, op.op, in_place_.data(), inputs, bytes / es, size_);
  std::memcpy(out, in_place_.data(), bytes);
}

Result<void> MpiChannel::wait(Group& g, const MpiGroupHeader& mine) {
  std::vector<int> indices(g.requests.size());
  std::vector<MPI_Status> statuses(g.requests.size());
  std::size_t open = static_cast<std::size_t>(std::count_if(g.requests.begin(), g.requests.end(),
                                                            [](MPI_Request r) { return r != MPI_REQUEST_NULL; }));
  const auto spin_until = Clock::now() + std::chrono::microseconds(50);
  auto nap = std::chrono::microseconds(5);
  while (open > 0) {
    int completed = 0;
    int r = MPI_SUCCESS;
    {
      auto lock = process_->lock();
      r = MPI_Testsome(static_cast<int>(g.requests.size()), g.requests.data(), &completed, indices.data(),
                       statuses.data());
    }
    if (r != MPI_SUCCESS && r != MPI_ERR_IN_STATUS) {
      return broken(g, ErrorCode::device, "MPI_Testsome: " + mpi_error_string(r));
    }
    if (completed == MPI_UNDEFINED) completed = 0;
    // Headers first: a mismatch explains a wrong-sized message better than MPI's error does.
    for (int k = 0; k < completed; ++k) {
      const Message& m = g.messages[static_cast<std::size_t>(indices[static_cast<std::size_t>(k)])];
      if (m.kind == Message::Kind::header) COSHARD_TRY(check_header(g, mine, m.peer));
    }
    for (int k = 0; k < completed; ++k) {
      const Message& m = g.messages[static_cast<std::size_t>(indices[static_cast<std::size_t>(k)])];
      const MPI_Status& s = statuses[static_cast<std::size_t>(k)];
      if (r == MPI_ERR_IN_STATUS && s.MPI_ERROR != MPI_SUCCESS) {
        return broken(g, ErrorCode::device, std::string(m.kind == Message::Kind::send ? "sending to" : "receiving from") +
                                                " rank " + std::to_string(m.peer) + ": " + mpi_error_string(s.MPI_ERROR));
      }
      if (m.kind == Message::Kind::receive) {
        int got = 0;
        MPI_Get_count(&s, MPI_BYTE, &got);
        if (static_cast<std::size_t>(got) != m.bytes) {
          return broken(g, ErrorCode::invalid_argument, "collective sequence mismatch: rank " + std::to_string(m.peer) +
                                                            " sent " + std::to_string(got) + " bytes where this rank expected " +
                                                            std::to_string(m.bytes));
        }
      }
    }
    open -= static_cast<std::size_t>(completed);
    if (open == 0) break;
    COSHARD_TRY(hear_abort(g));
    const auto now = Clock::now();
    if (now > g.deadline) return timed_out(g);
    if (now < spin_until) {
      async::detail::cpu_relax();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::microseconds(200));
    }
  }
  g.requests.clear();
  g.messages.clear();
  return {};
}

Result<void> MpiChannel::check_header(Group& g, const MpiGroupHeader& mine, int peer) {
  const MpiGroupHeader& theirs = headers_[static_cast<std::size_t>(peer)];
  reached_[static_cast<std::size_t>(peer)] = static_cast<std::int64_t>(theirs.seq);
  if (theirs.seq == mine.seq && theirs.signature == mine.signature) return {};
  return broken(g, ErrorCode::invalid_argument,
                "collective sequence mismatch: rank " + std::to_string(rank_) + " launched group #" +
                    std::to_string(mine.seq) + " " + describe(g.ops) + " but rank " + std::to_string(peer) +
                    " launched group #" + std::to_string(theirs.seq) +
                    (theirs.seq == mine.seq ? " with other ops (another kind, count, type, reduction or root)" : "") +
                    (theirs.purpose[0] != '\0' ? " for " + std::string(theirs.purpose.data(), strnlen(theirs.purpose.data(), theirs.purpose.size())) : ""));
}

Result<void> MpiChannel::hear_abort(Group& g) {
  std::string notice;
  int from = -1;
  {
    std::lock_guard state(state_mutex_);
    if (abort_receive_ == MPI_REQUEST_NULL) return {};
    int done = 0;
    MPI_Status s;
    {
      auto lock = process_->lock();
      MPI_Test(&abort_receive_, &done, &s);
    }
    if (!done) return {};
    int length = 0;
    MPI_Get_count(&s, MPI_CHAR, &length);
    notice.assign(abort_notice_.data(), static_cast<std::size_t>(std::max(length, 0)));
    from = s.MPI_SOURCE;
  }
  return broken(g, ErrorCode::closed, "rank " + std::to_string(from) + " of MPI world " + std::to_string(size_) + " failed: " + notice);
}

Result<void> MpiChannel::timed_out(Group& g) {
  // Per peer still owing this group something: whether it has sent all its part, and taken ours.
  std::map<int, std::pair<bool, bool>> owing;  // peer -> (a receive open, a send open)
  for (std::size_t i = 0; i < g.requests.size(); ++i) {
    if (g.requests[i] == MPI_REQUEST_NULL) continue;
    auto& [receiving, sending] = owing[g.messages[i].peer];
    (g.messages[i].kind == Message::Kind::send ? sending : receiving) = true;
  }
  std::string who;
  for (const auto& [q, open] : owing) {
    const std::int64_t reached = reached_[static_cast<std::size_t>(q)];
    who += (who.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) + " (the last group it reached here: " +
           (reached < 0 ? std::string("none") : "#" + std::to_string(reached)) +
           (open.first ? "" : "; it has not taken what this rank sent") + ")";
  }
  return broken(g, ErrorCode::timeout, "MPI collective group #" + std::to_string(g.seq) + " " + describe(g.ops) +
                                           " on rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                                           ": timed out after " + std::to_string(options_.timeout.count()) +
                                           " ms waiting for " + who);
}

Unexpected MpiChannel::broken(Group& g, ErrorCode code, std::string message) {
  {
    auto lock = process_->lock();
    for (std::size_t i = 0; i < g.requests.size(); ++i) {
      if (g.requests[i] == MPI_REQUEST_NULL) continue;
      if (g.messages[i].kind != Message::Kind::send) MPI_Cancel(&g.requests[i]);
      MPI_Request_free(&g.requests[i]);
    }
  }
  g.requests.clear();
  g.messages.clear();
  std::lock_guard state(state_mutex_);
  if (!failed_.load()) set_failed(code, message);
  return fail(Error(failure_code_, failure_));
}

void MpiChannel::set_failed(ErrorCode code, std::string message) {
  failure_code_ = code;
  failure_ = std::move(message);
  failed_.store(true, std::memory_order_release);
}

}  // namespace coshard::collectives::detail
