// The CPU stream backend: one worker thread per stream, FIFO.
//
// Hand-off protocol: producers append to `q_.ops` under `q_.lock`, then bump `q_.wake_seq` and,
// only if the worker announced it is parking (`q_.sleeping`), notify the futex. The worker reads
// wake_seq before draining; when it finds nothing it spins until wake_seq moves, then sets
// sleeping and parks on wake_seq unless it moved. wake_seq/sleeping form a Dekker pair (seq_cst
// on both sides), so a notify is never missed and never paid while the worker spins.
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/async/detail/cpu_relax.hpp"
#include "coshard/async/detail/spin_lock.hpp"
#include "coshard/async/log.hpp"
#include "stream_impl.hpp"

namespace coshard::async::detail {
namespace {

// Spin for `spin`, then park until `flag` differs from `seen`.
template <class T>
void spin_then_wait(const std::atomic<T>& flag, T seen, std::chrono::nanoseconds spin) {
  if (spin_until([&] { return flag.load(std::memory_order_acquire) != seen; }, spin)) return;
  while (flag.load(std::memory_order_acquire) == seen) flag.wait(seen, std::memory_order_acquire);
}

class CpuFence final : public Fence {
 public:
  explicit CpuFence(bool timed = false) : Fence(Device::cpu()), timed_(timed) {}

  bool timed() const noexcept override { return timed_; }
  std::optional<std::chrono::steady_clock::time_point> host_time() const noexcept override {
    if (!timed_ || done_.load(std::memory_order_acquire) == 0) return std::nullopt;
    return at_;
  }
  double elapsed_ms_since(Fence& start) override {
    // Both passed (checked by Event): their times were written before done_ was released.
    const auto& s = static_cast<CpuFence&>(start);
    return std::chrono::duration<double, std::milli>(at_ - s.at_).count();
  }

  bool query() override { return done_.load(std::memory_order_acquire) != 0; }

  Result<void> status() override {
    if (error_) return fail(*error_);
    return {};
  }

  Result<void> wait_blocking() override {
    spin_then_wait(done_, 0u, std::chrono::microseconds(20));
    return status();
  }

  bool add_waiter(Waiter& waiter) override {
    std::lock_guard lock(lock_);
    if (done_.load(std::memory_order_relaxed)) return false;
    waiters_.push_back(waiter);
    return true;
  }

  void remove_waiter(Waiter& waiter) override {
    std::lock_guard lock(lock_);
    if (waiter.linked) waiters_.remove(waiter);
  }

  // Called by the worker that reaches this point.
  void complete(std::shared_ptr<const Error> error) {
    if (timed_) at_ = std::chrono::steady_clock::now();
    {
      std::lock_guard lock(lock_);
      error_ = std::move(error);
      done_.store(1, std::memory_order_release);  // publishes error_ with it
      while (Waiter* w = waiters_.pop_front()) wake(*w);  // under the lock: see wait_list.hpp
    }
    done_.notify_all();
  }

 private:
  // One cache line: the worker completing it and the reactor awaiting it share just this.
  std::atomic<std::uint32_t> done_{0};
  SpinLock lock_;
  WaitList waiters_;
  std::shared_ptr<const Error> error_;
  bool timed_;
  std::chrono::steady_clock::time_point at_{};
};

class CpuStream final : public StreamImpl {
 public:
  explicit CpuStream(StreamOptions options) : StreamImpl(Device::cpu(), std::move(options)) {
    // The worker writes log lines as the creating thread's rank, under the stream's name.
    worker_ = std::thread([this, rank = log::thread_rank()] {
      log::set_thread_rank(rank);
      const std::string& stream = this->options().name;
      log::set_thread_name(stream.empty() ? std::string_view("stream") : std::string_view(stream));
      run();
    });
  }

  ~CpuStream() override {
    {
      std::lock_guard lock(q_.lock);
      q_.stop = true;
    }
    poke();
    worker_.join();
  }

  Result<void> launch(detail::UniqueFunction<void()> fn) override {
    enqueue(Op{Op::Kind::run, std::move(fn), {}, nullptr, nullptr});
    return {};
  }

  Result<void> launch_fallible(detail::UniqueFunction<Result<void>()> fn) override {
    enqueue(Op{Op::Kind::run_fallible, {}, std::move(fn), nullptr, nullptr});
    return {};
  }

  Result<void> copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return {};
    return launch([dst, src, bytes] { std::memcpy(dst, src, bytes); });
  }

  Result<void> fill(void* dst, std::uint8_t value, std::size_t bytes) override {
    if (bytes == 0) return {};
    return launch([dst, value, bytes] { std::memset(dst, value, bytes); });
  }

  Result<Event> record() override { return record_fence(false); }
  Result<Event> record_timed() override { return record_fence(true); }
  Result<Event> record_fence(bool timed) {
    auto fence = std::make_shared<CpuFence>(timed);
    Event event(fence);
    enqueue(Op{Op::Kind::record, {}, {}, std::move(fence), nullptr});
    return event;
  }

  Result<void> wait(const Event& event) override {
    // Already passed without error: nothing to order. Otherwise the worker waits (and inherits
    // the error of a failed stream).
    if (!event.recorded() || (event.ready() && event.fence()->status())) return {};
    enqueue(Op{Op::Kind::wait, {}, {}, nullptr, event.fence()});
    return {};
  }

  void* native_handle() const noexcept override { return nullptr; }
  std::optional<double> busy_ms() const noexcept override {
    return static_cast<double>(busy_ns_.load(std::memory_order_relaxed)) * 1e-6;
  }

 private:
  struct Op {
    enum class Kind : std::uint8_t { run, run_fallible, record, wait } kind;
    detail::UniqueFunction<void()> fn;
    detail::UniqueFunction<Result<void>()> fallible;
    std::shared_ptr<CpuFence> signal;
    std::shared_ptr<Fence> wait_on;
  };

  void enqueue(Op op) {
    {
      std::lock_guard lock(q_.lock);
      q_.ops.push_back(std::move(op));
      ++q_.submitted;
    }
    poke();
  }

  Result<void> drain() noexcept override {
    std::uint64_t target = 0;
    {
      std::lock_guard lock(q_.lock);
      target = q_.submitted;
    }
    draining_.fetch_add(1, std::memory_order_seq_cst);
    for (auto done = completed_.load(std::memory_order_acquire); done < target;
         done = completed_.load(std::memory_order_acquire))
      completed_.wait(done, std::memory_order_acquire);
    draining_.fetch_sub(1, std::memory_order_relaxed);
    return {};
  }

  void poke() {
    q_.wake_seq.fetch_add(1, std::memory_order_seq_cst);
    if (q_.sleeping.load(std::memory_order_seq_cst)) q_.wake_seq.notify_one();
  }

  void run() {
    std::vector<Op> batch;
    for (;;) {
      const std::uint32_t seen = q_.wake_seq.load(std::memory_order_acquire);
      bool stop = false;
      {
        std::lock_guard lock(q_.lock);
        batch.swap(q_.ops);
        stop = q_.stop && batch.empty();
      }
      if (stop) return;
      if (batch.empty()) {
        park(seen);
        continue;
      }
      for (Op& op : batch) {
        if (op.kind == Op::Kind::run || op.kind == Op::Kind::run_fallible) {
          const auto start = std::chrono::steady_clock::now();
          execute(op);
          busy_ns_.fetch_add(static_cast<std::uint64_t>((std::chrono::steady_clock::now() - start).count()),
                             std::memory_order_relaxed);
        } else {
          execute(op);
        }
        completed_.fetch_add(1, std::memory_order_release);
        if (draining_.load(std::memory_order_seq_cst) > 0) completed_.notify_all();
      }
      batch.clear();
    }
  }

  void park(std::uint32_t seen) {
    if (spin_until([&] { return q_.wake_seq.load(std::memory_order_relaxed) != seen; }, options().spin_before_park)) return;
    q_.sleeping.store(true, std::memory_order_seq_cst);
    if (q_.wake_seq.load(std::memory_order_seq_cst) == seen) q_.wake_seq.wait(seen, std::memory_order_acquire);
    q_.sleeping.store(false, std::memory_order_relaxed);
  }

  void execute(Op& op) {
    switch (op.kind) {
      case Op::Kind::run:
        if (error_) return;  // sticky: a failed stream runs nothing more
        try {
          op.fn();
        } catch (...) {
          set_error([&] {
            return std::make_shared<const Error>(
                ErrorCode::device, ::coshard::detail::concat("CPU stream '", options().name, "': a launched closure threw: ",
                                                             describe_exception(std::current_exception())));
          });
        }
        op.fn = nullptr;  // free captures now, in stream order
        return;
      case Op::Kind::run_fallible: {
        if (error_) return;
        set_error([&]() -> std::shared_ptr<const Error> {
          Result<void> r = [&]() -> Result<void> {
            try {
              return op.fallible();
            } catch (...) {
              return fail(ErrorCode::device, "a launched closure threw: ", describe_exception(std::current_exception()));
            }
          }();
          if (r) return nullptr;
          return std::make_shared<const Error>(
              std::move(r).error().with_context(::coshard::detail::concat("CPU stream '", options().name, "'")));
        });
        op.fallible = nullptr;
        return;
      }
      case Op::Kind::record:
        op.signal->complete(error_);
        op.signal.reset();
        return;
      case Op::Kind::wait: {
        // The worker is the device: its waits are not host syncs and are not counted.
        Result<void> s = op.wait_on->wait_blocking();
        if (!s && !error_) {
          set_error([&] {
            return std::make_shared<const Error>(
                ErrorCode::device, ::coshard::detail::concat("CPU stream '", options().name,
                                                             "' waited on an event of a failed stream: ", s.error().message()));
          });
        }
        op.wait_on.reset();
        return;
      }
    }
  }

  // The submission queue, on one cache line shared by producers and the worker.
  struct alignas(64) Queue {
    SpinLock lock;
    bool stop = false;
    std::atomic<bool> sleeping{false};
    std::atomic<std::uint32_t> wake_seq{0};
    std::vector<Op> ops;
    std::uint64_t submitted = 0;  // ops enqueued so far
  } q_;
  std::atomic<std::uint64_t> completed_{0};  // ops the worker has run (drain waits on it)
  std::atomic<std::uint64_t> busy_ns_{0};    // time running closures, copies and fills (busy_ms)
  std::atomic<int> draining_{0};             // drains waiting (the worker wakes them)
  // The stream's sticky error, as `make` makes it; where that runs out of memory, the one made
  // with the stream (a throw here would end the worker thread in std::terminate).
  template <class Make>
  void set_error(Make make) noexcept {
    try {
      error_ = make();
    } catch (...) {
      error_ = out_of_memory_;
    }
  }

  std::shared_ptr<const Error> error_;  // worker thread only
  const std::shared_ptr<const Error> out_of_memory_ = std::make_shared<const Error>(
      ErrorCode::out_of_memory, "CPU stream: out of host memory (and too little left to say more)");
  std::thread worker_;
};

}  // namespace

std::unique_ptr<StreamImpl> make_cpu_stream(StreamOptions options) {
  return std::make_unique<CpuStream>(std::move(options));
}

}  // namespace coshard::async::detail
