// The NCCL backend (rules in nccl.hpp). Host code against the CUDA runtime and NCCL, whose
// library is opened at run time (nccl_library.hpp).
#include "coshard/collectives/nccl.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "coshard/async/log.hpp"
#include "coshard/collectives/flight_recorder.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/sync.hpp"
#include "nccl_library.hpp"

namespace coshard::collectives {
namespace {

using Clock = std::chrono::steady_clock;
using detail::nccl::Library;

Unexpected nccl_error(const Library& nccl, ncclResult_t r, std::string_view what, ncclComm_t comm = nullptr) {
  std::string detail = nccl.error_string(r);
  if (comm != nullptr) {
    if (const char* last = nccl.last_error(comm); last != nullptr && *last) detail += std::string(": ") + last;
  }
  return fail(ErrorCode::device, what, ": ", detail);
}

Result<ncclDataType_t> nccl_type(DataType t) {
  switch (t) {
    case DataType::f32: return ncclFloat32;
    case DataType::f64: return ncclFloat64;
    case DataType::f16: return ncclFloat16;
    case DataType::bf16: return ncclBfloat16;
    case DataType::i32: return ncclInt32;
    case DataType::u8: return ncclUint8;
  }
  return fail(ErrorCode::invalid_argument, "NCCL: unknown data type ", static_cast<int>(t));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

class NcclCommunicator;
// How a communicator split from another is reached by its parent's abort while it lives (the
// engine owns it; the parent may outlive it, or not).
struct AbortTarget {
  explicit AbortTarget(NcclCommunicator* c) : comm(c) {}
  std::mutex mutex;
  NcclCommunicator* comm;  // null once it is gone
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const Library& nccl, ncclComm_t comm, int rank, int size, async::Device device, async::Stream stream,
                   void* barrier_word, NcclOptions options)
      : nccl_(nccl),
        comm_(comm),
        rank_(rank),
        size_(size),
        device_(device),
        stream_(std::move(stream)),
        barrier_word_(barrier_word),
        options_(std::move(options)) {
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard lock(self_->mutex);
      self_->comm = nullptr;
    }
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    if (!aborted_.load()) {
      (void)nccl_.comm_destroy(comm_);  // waits for its work to finish
    }
    (void)cudaFree(barrier_word_);
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  std::string_view backend() const noexcept override { return "nccl"; }
  const FlightRecorder* flight_recorder() const noexcept override { return &recorder_; }
  Result<void> set_flight_label(std::string_view label) override { return recorder_.set_label(label); }
  async::Stream& stream() noexcept override { return stream_; }
  std::uint64_t launches() const noexcept override { return launches_.load(std::memory_order_relaxed); }

  Result<void> status() const override {
    std::lock_guard lock(mutex_);
    if (!abort_reason_.empty()) return fail(ErrorCode::closed, abort_reason_);
    return {};
  }

  void abort(const std::string& reason) override {
    {
      std::lock_guard lock(mutex_);
      if (aborted_.load()) return;
      abort_reason_ = "NCCL communicator rank " + std::to_string(rank_) + "/" + std::to_string(size_) +
                      " aborted: this rank failed: " + reason;
      aborted_.store(true);
      outstanding_.clear();
    }
    (void)nccl_.comm_abort(comm_);  // its kernels exit; the peers' watchdogs find this rank gone
    recorder_.dump_on_failure(rank_, size_, "nccl", "this rank failed: " + reason);
    // The communicators split from this one too (a shard group's): their peers' watchdogs then
    // find this rank gone there as well, instead of a collective left waiting in a sub-group.
    std::vector<std::shared_ptr<AbortTarget>> children;
    {
      std::lock_guard lock(mutex_);
      for (const auto& c : children_)
        if (auto child = c.lock()) children.push_back(std::move(child));
    }
    for (const auto& child : children) {
      std::lock_guard lock(child->mutex);
      if (child->comm) child->comm->abort(reason);
    }
  }

  Result<async::Event> launch(const Coalesced& group) override {
    for (const CollectiveOp& op : group.ops()) COSHARD_TRY(validate(op, rank_, size_));
    COSHARD_TRY(status());
    if (auto e = cudaSetDevice(device_.index()); e != cudaSuccess) {
      return fail(ErrorCode::device, "cudaSetDevice(", device_.index(), "): ", cudaGetErrorString(e));
    }
    auto* s = static_cast<cudaStream_t>(stream_.native_handle());
    if (auto r = nccl_.group_start(); r != ncclSuccess) return nccl_error(nccl_, r, "ncclGroupStart", comm_);
    Result<void> issued = issue(group, s);
    const ncclResult_t ended = nccl_.group_end();  // always close the group
    COSHARD_TRY(issued);
    if (ended != ncclSuccess) return nccl_error(nccl_, ended, "ncclGroupEnd", comm_);
    COSHARD_TRY_ASSIGN(async::Event done, stream_.record());
    const std::uint64_t seq = launches_.fetch_add(1, std::memory_order_relaxed);
    COSHARD_LOG_DEBUG(collectives, "launch #{} on {} (nccl, rank {} of {}): {}", seq, stream_.name(), rank_, size_,
                      describe(group.ops()));
    recorder_.enqueued(seq, std::make_shared<const std::vector<CollectiveOp>>(group.ops().begin(), group.ops().end()));
    {
      std::lock_guard lock(mutex_);
      // Launches that have passed are marked here too (an event query each, no wait), so the
      // flight record is current between the watchdog's rounds.
      mark_passed();
      outstanding_.push_back({done, Clock::now() + options_.timeout, seq});
    }
    return done;
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key) override {
    COSHARD_TRY(status());
    ncclComm_t child = nullptr;
    COSHARD_TRY(async::detail::blocking_wait("Communicator::split", [&]() -> Result<void> {
      if (auto r = nccl_.comm_split(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr);
          r != ncclSuccess) {
        return nccl_error(nccl_, r, "ncclCommSplit", comm_);
      }
      return {};
    }));
    if (child == nullptr) return std::unique_ptr<Communicator>();
    COSHARD_TRY_ASSIGN(auto made, wrap(nccl_, child, device_, options_));
    std::lock_guard lock(mutex_);
    std::erase_if(children_, [](const std::weak_ptr<AbortTarget>& c) { return c.expired(); });
    children_.push_back(static_cast<NcclCommunicator&>(*made).self_);
    return made;
  }

  // Wraps a fresh NCCL communicator: its rank and size, a stream, the barrier scratch word.
  static Result<std::unique_ptr<Communicator>> wrap(const Library& nccl, ncclComm_t comm, async::Device device,
                                                    NcclOptions options) {
    int rank = 0, size = 0;
    if (auto r = nccl.comm_user_rank(comm, &rank); r != ncclSuccess)
      return nccl_error(nccl, r, "ncclCommUserRank", comm);
    if (auto r = nccl.comm_count(comm, &size); r != ncclSuccess) return nccl_error(nccl, r, "ncclCommCount", comm);
    const log::ScopedRank as_rank(rank);  // the stream's worker writes its log lines as this rank
    auto stream = async::Stream::create(device, {.name = "nccl comm rank " + std::to_string(rank) + "/" + std::to_string(size)});
    if (!stream) return fail(std::move(stream).error());
    void* word = nullptr;
    if (auto e = cudaMalloc(&word, sizeof(float)); e != cudaSuccess) {
      return fail(ErrorCode::out_of_memory, "cudaMalloc(barrier word): ", cudaGetErrorString(e));
    }
    return std::unique_ptr<Communicator>(
        std::make_unique<NcclCommunicator>(nccl, comm, rank, size, device, std::move(*stream), word, std::move(options)));
  }

 private:
  Result<void> issue(const Coalesced& group, cudaStream_t s) {
    for (const CollectiveOp& op : group.ops()) {
      COSHARD_TRY_ASSIGN(const ncclDataType_t type, nccl_type(op.dtype));
      ncclResult_t r = ncclSuccess;
      switch (op.kind) {
        case CollectiveKind::all_gather:
          r = nccl_.all_gather(op.send, op.recv, op.count, type, comm_, s);
          break;
        case CollectiveKind::reduce_scatter:
          r = nccl_.reduce_scatter(op.send, op.recv, op.count, type, nccl_op(op.op), comm_, s);
          break;
        case CollectiveKind::all_reduce:
          r = nccl_.all_reduce(op.send, op.recv, op.count, type, nccl_op(op.op), comm_, s);
          break;
        case CollectiveKind::broadcast:
          r = nccl_.broadcast(op.send, op.recv, op.count, type, op.root, comm_, s);
          break;
        case CollectiveKind::barrier:
          r = nccl_.all_reduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, s);
          break;
        case CollectiveKind::all_to_allv: {  // (as all_to_all: the pairs' sends and receives in one group)
          const auto n = static_cast<std::size_t>(size_);
          const std::size_t es = size_of(op.dtype);
          std::size_t sent = 0, received = 0;
          for (std::size_t q = 0; q < n && r == ncclSuccess; ++q) {
            if (op.counts[q] > 0)
              r = nccl_.send(static_cast<const std::byte*>(op.send) + sent * es, op.counts[q], type, static_cast<int>(q),
                             comm_, s);
            if (r == ncclSuccess && op.counts[n + q] > 0)
              r = nccl_.recv(static_cast<std::byte*>(op.recv) + received * es, op.counts[n + q], type,
                             static_cast<int>(q), comm_, s);
            sent += op.counts[q];
            received += op.counts[n + q];
          }
          break;
        }
        case CollectiveKind::all_to_all: {  // (within the launch's group: one kernel for all the pairs)
          const std::size_t block = op.count * size_of(op.dtype);
          for (int q = 0; q < size_ && r == ncclSuccess; ++q) {
            r = nccl_.send(static_cast<const std::byte*>(op.send) + static_cast<std::size_t>(q) * block, op.count, type, q,
                           comm_, s);
            if (r == ncclSuccess)
              r = nccl_.recv(static_cast<std::byte*>(op.recv) + static_cast<std::size_t>(q) * block, op.count, type, q,
                             comm_, s);
          }
          break;
        }
      }
      if (r != ncclSuccess) return nccl_error(nccl_, r, op.signature(), comm_);
    }
    return {};
  }

  // Under mutex_: the launches at the front whose events passed are completed.
  void mark_passed() {
    while (!outstanding_.empty() && outstanding_.front().done.ready()) {
      recorder_.ended(outstanding_.front().number, true);
      outstanding_.pop_front();
    }
  }

  void watch() {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      if (stop_ || aborted_.load()) continue;
      mark_passed();
      std::string reason;
      ncclResult_t async_error = ncclSuccess;
      if (nccl_.comm_get_async_error(comm_, &async_error) == ncclSuccess && async_error != ncclSuccess &&
          async_error != ncclInProgress) {
        reason = std::string("NCCL reported an asynchronous error: ") + nccl_.error_string(async_error);
      } else if (!outstanding_.empty() && Clock::now() > outstanding_.front().deadline) {
        reason = "collective launch #" + std::to_string(outstanding_.front().number) + " did not complete within " +
                 std::to_string(options_.timeout.count()) + " ms (a peer gone?)";
      }
      if (!reason.empty()) {
        abort_reason_ = "NCCL communicator rank " + std::to_string(rank_) + "/" + std::to_string(size_) +
                        " aborted: " + reason;
        aborted_.store(true);
        lock.unlock();
        (void)nccl_.comm_abort(comm_);  // makes its kernels exit; the communicator is gone
        recorder_.fail_open();
        recorder_.dump_on_failure(rank_, size_, "nccl", reason);
        lock.lock();
        outstanding_.clear();
      }
    }
  }

  struct Outstanding {
    async::Event done;
    Clock::time_point deadline;
    std::uint64_t number;
  };

  const Library& nccl_;
  ncclComm_t comm_;
  const int rank_;
  const int size_;
  const async::Device device_;
  async::Stream stream_;
  void* barrier_word_;
  const NcclOptions options_;
  std::atomic<std::uint64_t> launches_{0};
  FlightRecorder recorder_{stream_.name()};  // locks its own mutex (declared after stream_: named from it)

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  std::deque<Outstanding> outstanding_;
  std::string abort_reason_;
  std::atomic<bool> aborted_{false};
  bool stop_ = false;
  std::vector<std::weak_ptr<AbortTarget>> children_;  // split from this one
  std::shared_ptr<AbortTarget> self_ = std::make_shared<AbortTarget>(this);
  std::thread watchdog_;
};

}  // namespace

namespace {

struct NcclSetup {
  async::Runtime* runtime;
  const Library* nccl;
};

// What both entry points check before any exchange: the rank, the device, NCCL's library (opened
// here on first use), the runtime.
Result<NcclSetup> check_nccl_rank(int rank, int world, async::Device device) {
  if (world < 1 || rank < 0 || rank >= world) {
    return fail(ErrorCode::invalid_argument, "make_nccl_communicator: rank=", rank, " world=", world,
                ": expected 0 <= rank < world");
  }
  if (!device.is_cuda() || device.index() >= async::cuda_device_count()) {
    return fail(ErrorCode::device, "make_nccl_communicator: ", device.to_string(), " is not a visible CUDA device (",
                async::cuda_device_count(), " visible)");
  }
  auto nccl = detail::nccl::library();
  if (!nccl) return fail(std::move(nccl).error().with_context("make_nccl_communicator"));
  async::Runtime* rt = async::Runtime::current();
  if (rt == nullptr) return fail(ErrorCode::invalid_argument, "make_nccl_communicator: must be awaited on a Runtime");
  return NcclSetup{rt, *nccl};
}

}  // namespace

bool nccl_compiled() noexcept { return true; }

Result<std::string> nccl_library() {
  COSHARD_TRY_ASSIGN(const Library* nccl, detail::nccl::library());
  return nccl->describe();
}

async::Task<Result<std::unique_ptr<Communicator>>> make_nccl_communicator(TcpStore& store, int rank, int world,
                                                                          async::Device device, NcclOptions options) {
  COSHARD_CO_TRY_ASSIGN(const NcclSetup setup, check_nccl_rank(rank, world, device));

  // 1. The unique id, through the store.
  ncclUniqueId id{};
  const std::string id_key = options.key + "/unique_id";
  if (rank == 0) {
    if (auto r = setup.nccl->get_unique_id(&id); r != ncclSuccess)
      co_return nccl_error(*setup.nccl, r, "ncclGetUniqueId");
    const auto bytes = std::as_bytes(std::span(&id, 1));
    COSHARD_CO_TRY(co_await store.set(id_key, bytes));
  } else {
    COSHARD_CO_TRY_ASSIGN(std::vector<std::byte> bytes, co_await store.get(id_key));
    if (bytes.size() != sizeof(id)) {
      co_return fail(ErrorCode::invalid_argument, "store key '", id_key, "' holds ", bytes.size(),
                     " bytes; an NCCL unique id has ", sizeof(id));
    }
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  // 2. Everyone is here (or the store's timeout names who is not).
  const std::string arrived = options.key + "/arrived/" + std::to_string(rank);
  const std::vector<std::byte> none;
  COSHARD_CO_TRY(co_await store.set(arrived, none));
  for (int q = 0; q < world; ++q) {
    COSHARD_CO_TRY(co_await store.get(options.key + "/arrived/" + std::to_string(q)));
  }
  // 3. The collective init, off the reactor.
  std::vector<std::byte> id_bytes(sizeof(id));
  std::memcpy(id_bytes.data(), &id, sizeof(id));
  co_return co_await make_nccl_communicator(std::move(id_bytes), rank, world, device, std::move(options));
}

std::size_t nccl_unique_id_bytes() noexcept { return sizeof(ncclUniqueId); }

Result<std::vector<std::byte>> make_nccl_unique_id() {
  auto nccl = detail::nccl::library();
  if (!nccl) return fail(std::move(nccl).error().with_context("make_nccl_unique_id"));
  ncclUniqueId id{};
  if (auto r = (*nccl)->get_unique_id(&id); r != ncclSuccess) return nccl_error(**nccl, r, "ncclGetUniqueId");
  std::vector<std::byte> bytes(sizeof(id));
  std::memcpy(bytes.data(), &id, sizeof(id));
  return bytes;
}

async::Task<Result<std::unique_ptr<Communicator>>> make_nccl_communicator(std::vector<std::byte> unique_id, int rank,
                                                                          int world, async::Device device,
                                                                          NcclOptions options) {
  if (unique_id.size() != sizeof(ncclUniqueId)) {
    co_return fail(ErrorCode::invalid_argument, "make_nccl_communicator: a unique id of ", unique_id.size(),
                   " bytes; NCCL's has ", sizeof(ncclUniqueId));
  }
  COSHARD_CO_TRY_ASSIGN(const NcclSetup setup, check_nccl_rank(rank, world, device));
  const Library& nccl = *setup.nccl;
  ncclUniqueId id{};
  std::memcpy(&id, unique_id.data(), sizeof(id));
  auto comm = co_await setup.runtime->spawn_blocking([&]() -> Result<ncclComm_t> {
    if (auto e = cudaSetDevice(device.index()); e != cudaSuccess) {
      return fail(ErrorCode::device, "cudaSetDevice(", device.index(), "): ", cudaGetErrorString(e));
    }
    ncclComm_t c = nullptr;
    if (auto r = nccl.comm_init_rank(&c, world, id, rank); r != ncclSuccess)
      return nccl_error(nccl, r, "ncclCommInitRank");
    return c;
  });
  if (!comm) co_return fail(std::move(comm).error());
  co_return NcclCommunicator::wrap(nccl, *comm, device, std::move(options));
}

}  // namespace coshard::collectives
