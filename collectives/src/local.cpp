// The Local backend (rules at the top of local.hpp).
#include "coshard/collectives/local.hpp"

#include "coshard/async/log.hpp"
#include "coshard/collectives/flight_recorder.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "coshard/async/detail/cpu_relax.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/sync.hpp"
#include "local_device.hpp"
#include "local_rendezvous.hpp"
#include "reduce.hpp"

namespace coshard::collectives {
namespace {

using detail::Clock;
using detail::rank_list;
using detail::Rendezvous;

class LocalGroup {
 public:
  LocalGroup(int size, LocalOptions options)
      : size_(size),
        options_(options),
        rendezvous_(size, options.timeout),
        posted_(static_cast<std::size_t>(size)),
        posted_seq_(static_cast<std::size_t>(size), 0),
        ready_(static_cast<std::size_t>(size)),
        split_posts_(static_cast<std::size_t>(size)),
        split_present_(static_cast<std::size_t>(size), false),
        split_results_(static_cast<std::size_t>(size)) {}

  int size() const noexcept { return size_; }
  const LocalOptions& options() const noexcept { return options_; }
  Result<void> status() { return rendezvous_.status(); }
  void abort(int rank, const std::string& reason) {
    break_with_children("rank " + std::to_string(rank) + " of Local group of " + std::to_string(size_) + " failed: " + reason);
  }

  using Ops = std::shared_ptr<const std::vector<CollectiveOp>>;

  // Runs one launched group for `rank` (on its communication stream's worker). The posted ops
  // are shared: a rank that leaves early (mismatch, timeout) cannot free what others still read.
  Result<void> run(int rank, std::uint64_t seq, const Ops& posted) {
    const std::vector<CollectiveOp>& ops = *posted;
    const auto deadline = Clock::now() + options_.timeout;
    auto what = [&] { return "collective group #" + std::to_string(seq) + " " + describe(ops) + " on Local group of " + std::to_string(size_); };
    const auto r = static_cast<std::size_t>(rank);
    posted_[r] = posted;
    posted_seq_[r] = seq;
    if (auto a = rendezvous_.arrive_and_wait(rank, deadline, options_.spin, what); !a) return a;

    // Every rank checks every rank against rank 0, so all reach the same verdict.
    if (auto same = same_sequence(); !same) {
      rendezvous_.break_with(same.error().code(), same.error().message());
      return same;
    }

    for (std::size_t i = 0; i < ops.size(); ++i) execute(rank, i);
    return rendezvous_.arrive_and_wait(rank, deadline, options_.spin, what);
  }

  // The same group on ranks that share a GPU, from the launching thread of `rank`. The host
  // threads meet (the device is never waited for): the last to arrive checks the sequence and
  // enqueues one kernel per collective, for every rank, on its own stream after every rank's
  // `ready` point; the others order their streams after that work. Each rank's later work thus
  // follows every read and write of its buffers, and every device-side wait is on work already
  // enqueued, which CUDA can always schedule (a device-side wait for work a peer enqueues later
  // can deadlock when streams share a hardware queue).
  Result<async::Event> run_on_device(int rank, std::uint64_t seq, const Ops& posted, async::Stream& stream) {
    const std::vector<CollectiveOp>& ops = *posted;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const CollectiveOp& op = ops[i];
      const std::size_t es = size_of(op.dtype);
      const bool whole_send = op.kind == CollectiveKind::reduce_scatter || op.kind == CollectiveKind::all_to_all;
      const bool whole_recv = op.kind == CollectiveKind::all_gather || op.kind == CollectiveKind::all_to_all;
      const bool v = op.kind == CollectiveKind::all_to_allv;
      const std::size_t send_bytes = v ? op.sent_elements() * es : whole_send ? op.count * es * size_ : op.count * es;
      const std::size_t recv_bytes = v ? op.received_elements() * es : whole_recv ? op.count * es * size_ : op.count * es;
      const bool sends = op.kind != CollectiveKind::barrier && (op.kind != CollectiveKind::broadcast || op.root == rank);
      if (sends) COSHARD_TRY(detail::check_device_buffer(stream.device(), op.send, send_bytes, "send", rank, op));
      if (op.kind != CollectiveKind::barrier) {
        COSHARD_TRY(detail::check_device_buffer(stream.device(), op.recv, recv_bytes, "recv", rank, op));
      }
    }
    const auto r = static_cast<std::size_t>(rank);
    COSHARD_TRY_ASSIGN(ready_[r], stream.record());
    posted_[r] = posted;
    posted_seq_[r] = seq;
    const auto deadline = Clock::now() + options_.timeout;
    auto what = [&] {
      return "collective group #" + std::to_string(seq) + " " + describe(ops) + " on Local group of " +
             std::to_string(size_) + " (" + stream.device().to_string() + ")";
    };
    bool enqueued_here = false;
    COSHARD_TRY(rendezvous_.arrive_and_wait(rank, deadline, options_.spin, what, [&]() -> Result<void> {
      COSHARD_TRY(same_sequence());
      for (std::size_t q = 0; q < ready_.size(); ++q) {
        if (q != r) COSHARD_TRY(stream.wait(ready_[q]));
      }
      std::vector<const CollectiveOp*> per_rank(static_cast<std::size_t>(size_));
      for (std::size_t i = 0; i < ops.size(); ++i) {
        for (int q = 0; q < size_; ++q) per_rank[static_cast<std::size_t>(q)] = &op_of(q, i);
        COSHARD_TRY(detail::enqueue_on_device(stream, per_rank));
      }
      COSHARD_TRY_ASSIGN(device_done_, stream.record());
      enqueued_here = true;
      return {};
    }));
    if (enqueued_here) return device_done_;
    COSHARD_TRY(stream.wait(device_done_));
    return stream.record();
  }

  // A failed rank breaks the groups split from this one too: a peer waiting in a sub-group's
  // collective (a shard group's gather) learns at once, not at the timeout.
  void break_with_children(const std::string& why) {
    rendezvous_.break_with(ErrorCode::closed, why);
    std::vector<std::shared_ptr<LocalGroup>> children;
    {
      std::lock_guard lock(split_mutex_);
      for (const auto& c : children_)
        if (auto child = c.lock()) children.push_back(std::move(child));
    }
    for (const auto& child : children) child->break_with_children(why);
  }

  // Host-side collective: ranks of one color form a new group. Returns (group, new rank), or
  // (null, -1) for a negative color.
  Result<std::pair<std::shared_ptr<LocalGroup>, int>> split(int rank, int color, int key) {
    std::unique_lock lock(split_mutex_);
    const std::uint64_t generation = split_generation_;
    const auto r = static_cast<std::size_t>(rank);
    split_posts_[r] = {color, key};
    split_present_[r] = true;
    if (++split_arrived_ == size_) {
      std::map<int, std::vector<std::pair<int, int>>> members;  // color -> (key, old rank)
      for (int q = 0; q < size_; ++q) {
        const auto [c, k] = split_posts_[static_cast<std::size_t>(q)];
        if (c >= 0) members[c].emplace_back(k, q);
      }
      std::fill(split_results_.begin(), split_results_.end(), std::pair<std::shared_ptr<LocalGroup>, int>{nullptr, -1});
      for (auto& [c, ranks] : members) {
        std::sort(ranks.begin(), ranks.end());
        auto group = std::make_shared<LocalGroup>(static_cast<int>(ranks.size()), options_);
        std::erase_if(children_, [](const std::weak_ptr<LocalGroup>& c) { return c.expired(); });
        children_.push_back(group);
        for (std::size_t i = 0; i < ranks.size(); ++i) {
          split_results_[static_cast<std::size_t>(ranks[i].second)] = {group, static_cast<int>(i)};
        }
      }
      split_arrived_ = 0;
      std::fill(split_present_.begin(), split_present_.end(), false);
      ++split_generation_;
      split_cv_.notify_all();
      return split_results_[r];
    }
    const auto deadline = Clock::now() + options_.timeout;
    while (split_generation_ == generation) {
      if (split_cv_.wait_until(lock, deadline) == std::cv_status::timeout && split_generation_ == generation) {
        std::string missing = rank_list(split_present_);
        --split_arrived_;
        split_present_[r] = false;
        return fail(ErrorCode::timeout, "split(color=", color, ", key=", key, ") on rank ", rank,
                    ": timed out waiting for ranks ", missing);
      }
    }
    return split_results_[r];
  }

 private:
  // Whether every rank posted the same group as rank 0 (all ranks that check reach one verdict).
  Result<void> same_sequence() const {
    for (std::size_t q = 1; q < posted_.size(); ++q) {
      const auto& first = *posted_[0];
      const auto& other = *posted_[q];
      bool same = posted_seq_[q] == posted_seq_[0] && other.size() == first.size();
      for (std::size_t i = 0; same && i < first.size(); ++i) same = other[i].same_signature(first[i]);
      if (!same) {
        return fail(ErrorCode::invalid_argument, "collective sequence mismatch: rank 0 launched group #",
                    posted_seq_[0], " ", describe(first), " but rank ", q, " launched group #", posted_seq_[q], " ",
                    describe(other));
      }
    }
    return pairs_agree();
  }

  // all_to_allv: what each rank sends to each other rank is what that rank expects from it.
  Result<void> pairs_agree() const {
    const auto& first = *posted_[0];
    const auto n = static_cast<std::size_t>(size_);
    for (std::size_t i = 0; i < first.size(); ++i) {
      if (first[i].kind != CollectiveKind::all_to_allv) continue;
      for (std::size_t p = 0; p < n; ++p)
        for (std::size_t q = 0; q < n; ++q) {
          const std::size_t sent = (*posted_[p])[i].counts[q], expected = (*posted_[q])[i].counts[n + p];
          if (sent != expected)
            return fail(ErrorCode::invalid_argument, "collective group #", posted_seq_[0], " ",
                        describe(std::span(&first[i], 1)), ": rank ", p, " sends ", sent, " elements to rank ", q,
                        ", which expects ", expected, " from it");
        }
    }
    return {};
  }

  // Rank `rank` copies in what each rank sends it (pairs_agree checked the sizes).
  void execute_all_to_allv(int rank, const CollectiveOp& mine, std::size_t index) {
    const auto n = static_cast<std::size_t>(size_), me = static_cast<std::size_t>(rank);
    const std::size_t es = size_of(mine.dtype);
    auto* recv = static_cast<std::byte*>(mine.recv);
    std::size_t at = 0;
    for (std::size_t q = 0; q < n; ++q) {
      const CollectiveOp& theirs = op_of(static_cast<int>(q), index);
      const std::size_t from = theirs.send_offset(me);
      const std::size_t count = mine.counts[n + q];
      if (count > 0) std::memcpy(recv + at * es, static_cast<const std::byte*>(theirs.send) + from * es, count * es);
      at += count;
    }
  }

  const CollectiveOp& op_of(int rank, std::size_t index) const {
    return (*posted_[static_cast<std::size_t>(rank)])[index];
  }

  void execute(int rank, std::size_t index) {
    const CollectiveOp& mine = op_of(rank, index);
    const std::size_t es = size_of(mine.dtype);
    if (mine.kind == CollectiveKind::all_to_allv) return execute_all_to_allv(rank, mine, index);
    const std::size_t block_bytes = mine.count * es;
    if (block_bytes == 0) return;
    auto* recv = static_cast<std::byte*>(mine.recv);
    switch (mine.kind) {
      case CollectiveKind::barrier:
      case CollectiveKind::all_to_allv:  // (execute_all_to_allv)
        return;
      case CollectiveKind::broadcast: {
        const void* src = op_of(mine.root, index).send;
        if (src != recv) std::memcpy(recv, src, block_bytes);
        return;
      }
      case CollectiveKind::all_gather:
        for (int q = 0; q < size_; ++q) {
          std::byte* dst = recv + static_cast<std::size_t>(q) * block_bytes;
          const void* src = op_of(q, index).send;
          if (src != dst) std::memcpy(dst, src, block_bytes);
        }
        return;
      case CollectiveKind::all_to_all:  // (validate: never in place)
        for (int q = 0; q < size_; ++q) {
          const auto* src = static_cast<const std::byte*>(op_of(q, index).send) + static_cast<std::size_t>(rank) * block_bytes;
          std::memcpy(recv + static_cast<std::size_t>(q) * block_bytes, src, block_bytes);
        }
        return;
      case CollectiveKind::reduce_scatter: {
        const std::size_t offset = static_cast<std::size_t>(rank) * block_bytes;
        reduce_range(
            mine, index, offset, mine.count, [&](std::size_t at) { return recv + at - offset; },
            [&](std::size_t at, const std::byte* data, std::size_t bytes) {
              if (data != recv + at - offset) std::memcpy(recv + at - offset, data, bytes);
            });
        return;
      }
      case CollectiveKind::all_reduce: {
        const std::size_t begin = mine.count * static_cast<std::size_t>(rank) / static_cast<std::size_t>(size_);
        const std::size_t end = mine.count * static_cast<std::size_t>(rank + 1) / static_cast<std::size_t>(size_);
        auto recv_of = [&](int q, std::size_t at) { return static_cast<std::byte*>(op_of(q, index).recv) + at; };
        reduce_range(
            mine, index, begin * es, end - begin, [&](std::size_t at) { return recv_of(rank, at); },
            [&](std::size_t at, const std::byte* data, std::size_t bytes) {
              for (int q = 0; q < size_; ++q) {
                if (recv_of(q, at) != data) std::memcpy(recv_of(q, at), data, bytes);
              }
            });
        return;
      }
    }
  }

  // Reduces `count` elements starting at byte `offset` of every rank's send buffer, block by
  // block, then hands each block to `emit(at, data, bytes)`. A block is reduced straight into
  // `direct(at)` when that destination overlaps no input of the block (one pass less), else into
  // a scratch buffer (so in-place use stays correct); `emit` skips the copy onto itself.
  template <class Direct, class Emit>
  void reduce_range(const CollectiveOp& mine, std::size_t index, std::size_t offset, std::size_t count, Direct direct,
                    Emit emit) {
    const std::size_t es = size_of(mine.dtype);
    if (size_ == 1) {  // one rank's reduction is its own values, bit for bit, whatever the op
      emit(offset, static_cast<const std::byte*>(op_of(0, index).send) + offset, count * es);
      return;
    }
    constexpr std::size_t kBlockBytes = 64 * 1024;
    const std::size_t block = std::max<std::size_t>(1, kBlockBytes / es);
    thread_local std::vector<std::byte> scratch;
    scratch.resize(block * es);
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    for (std::size_t done = 0; done < count; done += block) {
      const std::size_t n = std::min(block, count - done);
      const std::size_t at = offset + done * es;
      const std::size_t bytes = n * es;
      std::byte* out = direct(at);
      for (int q = 0; q < size_; ++q) {
        const auto* in = static_cast<const std::byte*>(op_of(q, index).send) + at;
        inputs[static_cast<std::size_t>(q)] = in;
        if (out < in + bytes && in < out + bytes) out = scratch.data();
      }
      detail::reduce(mine.dtype, mine.op, out, inputs, n, size_);
      emit(at, out, bytes);
    }
  }

  const int size_;
  const LocalOptions options_;
  Rendezvous rendezvous_;
  // Written by each rank before the first rendezvous, read by all between the two.
  std::vector<Ops> posted_;
  std::vector<std::uint64_t> posted_seq_;
  // On a GPU: each rank's stream position when it launched, and the work of the last group (set
  // by the last rank to arrive, read by the others before any of them can arrive again).
  std::vector<async::Event> ready_;
  async::Event device_done_;

  std::mutex split_mutex_;
  std::condition_variable split_cv_;
  int split_arrived_ = 0;
  std::uint64_t split_generation_ = 0;
  std::vector<std::pair<int, int>> split_posts_;
  std::vector<bool> split_present_;
  std::vector<std::pair<std::shared_ptr<LocalGroup>, int>> split_results_;
  std::vector<std::weak_ptr<LocalGroup>> children_;  // split from this one (under split_mutex_)
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank, async::Stream stream)
      : group_(std::move(group)), rank_(rank), stream_(std::move(stream)) {}

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return group_->size(); }
  std::string_view backend() const noexcept override { return "local"; }
  async::Stream& stream() noexcept override { return stream_; }
  std::uint64_t launches() const noexcept override { return launches_.load(std::memory_order_relaxed); }
  Result<void> status() const override { return group_->status(); }
  void abort(const std::string& reason) override {
    group_->abort(rank_, reason);
    recorder_->dump_on_failure(rank_, size(), "local", "this rank failed: " + reason);
  }
  const FlightRecorder* flight_recorder() const noexcept override { return recorder_.get(); }
  Result<void> set_flight_label(std::string_view label) override { return recorder_->set_label(label); }

  Result<async::Event> launch(const Coalesced& group) override {
    for (const CollectiveOp& op : group.ops()) COSHARD_TRY(validate(op, rank_, size()));
    if (group.empty()) return stream_.record();
    auto ops = std::make_shared<const std::vector<CollectiveOp>>(group.ops().begin(), group.ops().end());
    const std::uint64_t seq = next_seq_++;
    COSHARD_LOG_DEBUG(collectives, "launch #{} on {} (local, rank {} of {}): {}", seq, stream_.name(), rank_, size(),
                      describe(group.ops()));
    recorder_->enqueued(seq, ops);
    if (stream_.device().is_cuda()) {
      // Ranks sharing a GPU meet on the host and enqueue every rank's kernels: "completed" here
      // means enqueued for every rank (nothing can hang on the device after that).
      recorder_->started(seq);
      auto done = group_->run_on_device(rank_, seq, ops, stream_);
      recorder_->ended(seq, done.has_value());
      if (!done) {
        recorder_->dump_on_failure(rank_, size(), "local", done.error().message());
        return done;
      }
      launches_.fetch_add(1, std::memory_order_relaxed);
      return done;
    }
    COSHARD_TRY(stream_.launch_fallible([g = group_, r = rank_, seq, ops = std::move(ops), rec = recorder_]() -> Result<void> {
      rec->started(seq);
      auto done = g->run(r, seq, ops);
      rec->ended(seq, done.has_value());
      if (!done) rec->dump_on_failure(r, g->size(), "local", done.error().message());
      return done;
    }));
    launches_.fetch_add(1, std::memory_order_relaxed);
    return stream_.record();
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key) override {
    std::pair<std::shared_ptr<LocalGroup>, int> joined;
    COSHARD_TRY(async::detail::blocking_wait("Communicator::split", [&]() -> Result<void> {
      auto r = group_->split(rank_, color, key);
      if (!r) return fail(std::move(r).error());
      joined = std::move(*r);
      return {};
    }));
    if (!joined.first) return std::unique_ptr<Communicator>();
    auto stream = async::Stream::create(stream_.device(),
                                        {.name = "comm rank " + std::to_string(joined.second) + "/" +
                                                 std::to_string(joined.first->size()) + " (split)"});
    if (!stream) return fail(std::move(stream).error());
    return std::unique_ptr<Communicator>(
        std::make_unique<LocalCommunicator>(std::move(joined.first), joined.second, std::move(*stream)));
  }

 private:
  std::shared_ptr<LocalGroup> group_;
  int rank_;
  async::Stream stream_;
  std::uint64_t next_seq_ = 0;
  std::atomic<std::uint64_t> launches_{0};
  // Shared with the closures on the stream: a queued collective may run after a failed launch.
  std::shared_ptr<FlightRecorder> recorder_ = std::make_shared<FlightRecorder>(stream_.name());
};

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> make_local_communicators(int world_size, LocalOptions options) {
  if (world_size < 1) {
    return fail(ErrorCode::invalid_argument, "make_local_communicators(world_size=", world_size, "): must be at least 1");
  }
  if (options.timeout.count() <= 0) {
    return fail(ErrorCode::invalid_argument, "LocalOptions::timeout=", options.timeout.count(), " ms: must be positive");
  }
  if (!options.device.is_cpu()) COSHARD_TRY(detail::check_local_device(options.device, world_size));
  auto group = std::make_shared<LocalGroup>(world_size, options);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    const log::ScopedRank as_rank(r);  // the stream's worker writes its log lines as rank r
    auto stream = async::Stream::create(
        options.device, {.name = "comm rank " + std::to_string(r) + "/" + std::to_string(world_size)});
    if (!stream) return fail(std::move(stream).error());
    comms.push_back(std::make_unique<LocalCommunicator>(group, r, std::move(*stream)));
  }
  return comms;
}

}  // namespace coshard::collectives
