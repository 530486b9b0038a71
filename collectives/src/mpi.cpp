// The MPI backend (rules at the top of mpi.hpp): the Communicator, a closure per group on its
// stream that runs the group through its channel (mpi_channel.hpp); creation and split.
#include "coshard/collectives/mpi.hpp"

#include <atomic>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "coshard/async/log.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/sync.hpp"
#include "coshard/collectives/flight_recorder.hpp"
#include "mpi_channel.hpp"
#include "mpi_process.hpp"

namespace coshard::collectives {
namespace {

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::shared_ptr<detail::MpiChannel> channel, async::Stream stream)
      : channel_(std::move(channel)), stream_(std::move(stream)) {}

  int rank() const noexcept override { return channel_->rank(); }
  int size() const noexcept override { return channel_->size(); }
  std::string_view backend() const noexcept override { return "mpi"; }
  async::Stream& stream() noexcept override { return stream_; }
  std::uint64_t launches() const noexcept override { return launches_.load(std::memory_order_relaxed); }
  Result<void> status() const override { return channel_->status(); }
  const FlightRecorder* flight_recorder() const noexcept override { return recorder_.get(); }
  Result<void> set_flight_label(std::string_view label) override { return recorder_->set_label(label); }

  void abort(const std::string& reason) override {
    if (channel_->abort(reason)) recorder_->dump_on_failure(rank(), size(), "mpi", "this rank failed: " + reason);
    // The communicators split from this one too: a peer waiting in a sub-group's collective (a
    // shard group's gather) hears of it on that group's channel, at once.
    std::vector<std::shared_ptr<detail::MpiChannel>> children;
    {
      std::lock_guard lock(children_mutex_);
      for (const auto& c : children_)
        if (auto child = c.lock()) children.push_back(std::move(child));
    }
    for (const auto& child : children) child->abort(reason);
  }

  Result<async::Event> launch(const Coalesced& group) override {
    for (const CollectiveOp& op : group.ops()) COSHARD_TRY(validate(op, rank(), size()));
    COSHARD_TRY(channel_->status());
    if (group.empty()) return stream_.record();
    auto ops = std::make_shared<const std::vector<CollectiveOp>>(group.ops().begin(), group.ops().end());
    const std::uint64_t seq = next_seq_++;
    COSHARD_LOG_DEBUG(collectives, "launch #{} on {} (mpi, rank {} of {}): {}", seq, stream_.name(), rank(), size(),
                      describe(group.ops()));
    recorder_->enqueued(seq, ops);
    COSHARD_TRY(stream_.launch_fallible([c = channel_, seq, ops = std::move(ops), rec = recorder_]() -> Result<void> {
      rec->started(seq);
      auto done = c->run(seq, *ops);
      rec->ended(seq, done.has_value());
      if (!done) {
        rec->fail_open();
        rec->dump_on_failure(c->rank(), c->size(), "mpi", done.error().message());
      }
      return done;
    }));
    launches_.fetch_add(1, std::memory_order_relaxed);
    return stream_.record();
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key) override;

  static Result<std::unique_ptr<Communicator>> wrap(std::shared_ptr<detail::MpiProcess> process, MPI_Comm comm,
                                                    const MpiOptions& options) {
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    int rank = 0, size = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    const log::ScopedRank as_rank(rank);  // the stream's worker writes its log lines as this rank
    auto channel = std::make_shared<detail::MpiChannel>(std::move(process), comm, rank, size, options);
    auto stream = async::Stream::create(async::Device::cpu(),
                                        {.name = "mpi comm rank " + std::to_string(rank) + "/" + std::to_string(size)});
    if (!stream) return fail(std::move(stream).error());
    return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(std::move(channel), std::move(*stream)));
  }

  const std::shared_ptr<detail::MpiChannel>& channel() const noexcept { return channel_; }

 private:
  std::shared_ptr<detail::MpiChannel> channel_;
  async::Stream stream_;  // destroyed first: its queued groups run (or fail) while the channel lives
  std::uint64_t next_seq_ = 0;
  std::atomic<std::uint64_t> launches_{0};
  std::shared_ptr<FlightRecorder> recorder_ = std::make_shared<FlightRecorder>(stream_.name());
  std::mutex children_mutex_;
  std::vector<std::weak_ptr<detail::MpiChannel>> children_;  // of the communicators split from this one
};

Result<std::unique_ptr<Communicator>> MpiCommunicator::split(int color, int key) {
  COSHARD_TRY(status());
  auto process = detail::MpiProcess::instance();
  if (!process) return fail(std::move(process).error());
  MPI_Comm child = MPI_COMM_NULL;
  COSHARD_TRY(async::detail::blocking_wait("Communicator::split", [&]() -> Result<void> {
    auto lock = (*process)->lock();
    if (const int r = MPI_Comm_split(channel_->comm(), color < 0 ? MPI_UNDEFINED : color, key, &child); r != MPI_SUCCESS) {
      return fail(ErrorCode::device, "MPI_Comm_split(color=", color, ", key=", key, "): ", detail::mpi_error_string(r));
    }
    return {};
  }));
  if (child == MPI_COMM_NULL) return std::unique_ptr<Communicator>();
  COSHARD_TRY_ASSIGN(auto made, wrap(std::move(*process), child, channel_->options()));
  std::lock_guard lock(children_mutex_);
  std::erase_if(children_, [](const std::weak_ptr<detail::MpiChannel>& c) { return c.expired(); });
  children_.push_back(static_cast<MpiCommunicator&>(*made).channel());
  return made;
}

}  // namespace

bool mpi_compiled() noexcept { return true; }

Result<std::unique_ptr<Communicator>> make_mpi_communicator(MpiOptions options) {
  if (options.timeout.count() <= 0) {
    return fail(ErrorCode::invalid_argument, "MpiOptions::timeout=", options.timeout.count(), " ms: must be positive");
  }
  COSHARD_TRY_ASSIGN(auto process, detail::MpiProcess::instance());
  MPI_Comm comm = MPI_COMM_NULL;
  {
    auto lock = process->lock();
    if (const int r = MPI_Comm_dup(MPI_COMM_WORLD, &comm); r != MPI_SUCCESS) {
      return fail(ErrorCode::device, "MPI_Comm_dup(MPI_COMM_WORLD): ", detail::mpi_error_string(r));
    }
  }
  return MpiCommunicator::wrap(std::move(process), comm, options);
}

Result<void> mpi_broadcast_bytes(std::span<std::byte> bytes, int root) {
  COSHARD_TRY_ASSIGN(auto process, detail::MpiProcess::instance());
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (root < 0 || root >= size) {
    return fail(ErrorCode::invalid_argument, "mpi_broadcast_bytes: root=", root, ": expected 0 <= root < ", size);
  }
  if (bytes.size() > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    return fail(ErrorCode::invalid_argument, "mpi_broadcast_bytes: ", bytes.size(), " bytes: at most ",
                std::numeric_limits<int>::max(), " in one call");
  }
  return async::detail::blocking_wait("mpi_broadcast_bytes", [&]() -> Result<void> {
    auto lock = process->lock();
    if (const int r = MPI_Bcast(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, root, MPI_COMM_WORLD); r != MPI_SUCCESS) {
      return fail(ErrorCode::device, "MPI_Bcast: ", detail::mpi_error_string(r));
    }
    return {};
  });
}

}  // namespace coshard::collectives
