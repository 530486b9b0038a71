// The reactor loop, remote wake-ups, the root-task registry and shutdown. The rules are written
// at the top of runtime.hpp; the memory-order comments below say which side each atomic orders.
#include "coshard/async/runtime.hpp"

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <asio/thread_pool.hpp>
#include <sys/eventfd.h>

#include <atomic>
#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "coshard/async/detail/wait_list.hpp"
#include "coshard/async/log.hpp"
#include "coshard/async/detail/cpu_relax.hpp"
#include "coshard/async/detail/spin_lock.hpp"

namespace coshard::async {
namespace {
thread_local Runtime* t_current = nullptr;
}

namespace detail {

class RuntimeImpl {
 public:
  explicit RuntimeImpl(RuntimeOptions opts) : options(opts) {
    const int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
    wake.assign(fd);
    local.reserve(kQueueCapacity);
    remote.queue.reserve(kQueueCapacity);
  }

  // Both queues hold this many handles without allocating (they swap, keeping their capacity):
  // a wake-up from another thread never allocates unless more are pending at once.
  static constexpr std::size_t kQueueCapacity = 1024;

  RuntimeOptions options;
  asio::io_context io{1};  // declared first: destroyed last, after every frame that uses it
  // Remote wake-ups of a parked reactor: an eventfd write, which cannot fail for memory (a posted
  // handler is allocated, and a std::bad_alloc thrown on a stream's worker ended the process).
  asio::posix::stream_descriptor wake{io};
  bool wake_armed = false;  // reactor thread only: an async_wait on `wake` is pending

  // Reactor-thread-only state.
  std::vector<std::coroutine_handle<>> local;
  std::size_t local_head = 0;
  std::vector<Poller*> pollers;
  std::vector<std::pair<std::type_index, std::unique_ptr<Poller>>> owned_pollers;

  // Remote wake-ups. pending and sleeping form a Dekker pair (both seq_cst): a producer stores
  // pending then loads sleeping; the reactor stores sleeping then loads pending, so at least one
  // of them sees the other and no wake-up is lost.
  // All on one cache line: a remote wake-up moves one line to the reactor, not three.
  struct alignas(64) Remote {
    SpinLock lock;
    std::atomic<bool> pending{false};
    std::atomic<bool> sleeping{false};
    std::vector<std::coroutine_handle<>> queue;
  } remote;

  std::atomic<bool> stopping{false};  // set once; seen by spawn (relaxed is enough: advisory)
  std::atomic<bool> stop{false};      // release/acquire: tells the loop to exit

  std::mutex registry_mutex;
  RootPromise* roots = nullptr;
  std::atomic<std::size_t> live{0};  // relaxed: a statistic

  std::once_flag pool_once;
  std::unique_ptr<asio::thread_pool> pool;

  std::thread thread;

  // The reactor loop's steps (reactor thread only; Runtime::Runtime runs them).
  void take_remote();                            // the other threads' wake-ups, into `local`
  std::size_t resume_local(std::size_t budget);  // at most `budget` tasks resumed; their count
  bool park(bool poller_pending);                // asleep until woken; false: a wake-up came first
};

void RuntimeImpl::take_remote() {
  if (!remote.pending.load(std::memory_order_acquire)) return;
  std::lock_guard lock(remote.lock);
  if (local_head == local.size()) {  // the usual case: a swap, nothing allocated
    local.clear();
    local_head = 0;
    std::swap(local, remote.queue);
    remote.pending.store(false, std::memory_order_relaxed);
  } else {
    try {
      local.insert(local.end(), remote.queue.begin(), remote.queue.end());
      remote.queue.clear();
      remote.pending.store(false, std::memory_order_relaxed);
    } catch (const std::bad_alloc&) {
      // Left pending: swapped in once the local queue has run dry.
    }
  }
}

std::size_t RuntimeImpl::resume_local(std::size_t budget) {
  std::size_t resumed = 0;
  while (local_head < local.size() && resumed < budget) {
    std::coroutine_handle<> h = local[local_head++];
    h.resume();
    ++resumed;
  }
  if (local_head == local.size()) {
    local.clear();
    local_head = 0;
  } else if (local_head > 4096 && local_head * 2 > local.size()) {
    local.erase(local.begin(), local.begin() + static_cast<std::ptrdiff_t>(local_head));
    local_head = 0;
  }
  return resumed;
}

bool RuntimeImpl::park(bool poller_pending) {
  remote.sleeping.store(true, std::memory_order_seq_cst);
  if (remote.pending.load(std::memory_order_seq_cst) || stop.load(std::memory_order_acquire)) {
    remote.sleeping.store(false, std::memory_order_relaxed);
    return false;
  }
  if (!wake_armed) {
    try {
      wake.async_wait(asio::posix::stream_descriptor::wait_read, [this](const std::error_code& ec) {
        wake_armed = false;
        eventfd_t count = 0;
        if (!ec) (void)::eventfd_read(wake.native_handle(), &count);
      });
      wake_armed = true;
    } catch (const std::bad_alloc&) {
      // No memory to arm it: park in short naps instead.
    }
  }
  if (poller_pending || !wake_armed) {
    io.run_one_for(std::chrono::microseconds(50));
  } else {
    io.run_one();
  }
  remote.sleeping.store(false, std::memory_order_relaxed);
  return true;
}

}  // namespace detail

Runtime::Runtime(RuntimeOptions options) : impl_(std::make_unique<detail::RuntimeImpl>(options)) {
  // The reactor writes log lines as the creating thread's rank.
  impl_->thread = std::thread([this, rank = log::thread_rank()] {
    t_current = this;
    log::set_thread_rank(rank);
    log::set_thread_name("reactor");
    auto& s = *impl_;
    auto work = asio::make_work_guard(s.io);
    const std::size_t budget = s.options.io_poll_interval == 0 ? 1 : s.options.io_poll_interval;
    bool spinning = false;
    std::chrono::steady_clock::time_point spin_start;

    // The io_context is polled (one epoll_wait syscall) after `budget` resumed tasks, or while
    // idle at most every kIdleIoPollPeriod, and always before parking; not on every turn.
    constexpr auto kIdleIoPollPeriod = std::chrono::microseconds(5);
    std::size_t resumed_since_io = 0;
    auto last_io_poll = std::chrono::steady_clock::now();

    while (!s.stop.load(std::memory_order_acquire)) {
      bool did_work = false;

      s.take_remote();
      const std::size_t resumed = s.resume_local(budget);
      did_work |= resumed > 0;
      resumed_since_io += resumed;

      const bool local_empty = s.local_head == s.local.size();
      const auto now = std::chrono::steady_clock::now();
      if (resumed_since_io >= budget || (local_empty && now - last_io_poll >= kIdleIoPollPeriod)) {
        did_work |= s.io.poll() > 0;
        resumed_since_io = 0;
        last_io_poll = now;
      }
      bool poller_pending = false;
      for (Poller* p : s.pollers) {
        did_work |= p->poll();
        poller_pending |= p->pending();
      }

      if (did_work || !local_empty) {
        spinning = false;
        continue;
      }

      // Idle: spin on the remote flag a while (cheap hand-offs), then park.
      if (!spinning) {
        spinning = true;
        spin_start = now;
      }
      if (now - spin_start < s.options.spin_before_park) {
        for (int i = 0; i < 64 && !s.remote.pending.load(std::memory_order_relaxed); ++i) {
          detail::cpu_relax();
        }
        continue;
      }

      if (!s.park(poller_pending)) continue;
      last_io_poll = std::chrono::steady_clock::now();
      spinning = false;
    }
    t_current = nullptr;
  });
}

Runtime::~Runtime() {
  auto& s = *impl_;
  assert(!on_reactor_thread() && "a Runtime cannot be destroyed from its own reactor thread");
  s.stopping.store(true, std::memory_order_relaxed);
  s.stop.store(true, std::memory_order_release);
  (void)::eventfd_write(s.wake.native_handle(), 1);  // wakes a parked reactor
  s.thread.join();

  // Blocking jobs write into awaiters that live in task frames: finish them before the frames go.
  if (s.pool) {
    s.pool->stop();
    s.pool->join();
  }

  // Destroy every unfinished task. A frame's destructors may wake others (a dropped permit
  // releases a semaphore): those wake-ups land in queues that are never run again.
  for (;;) {
    detail::RootPromise* root = nullptr;
    {
      std::lock_guard lock(s.registry_mutex);
      root = s.roots;
      if (root == nullptr) break;
      s.roots = root->next;
      if (s.roots) s.roots->prev = nullptr;
      root->registered = false;
      root->next = root->prev = nullptr;
      s.live.fetch_sub(1, std::memory_order_relaxed);
    }
    std::coroutine_handle<detail::RootPromise>::from_promise(*root).destroy();
  }
  s.local.clear();
  std::lock_guard lock(s.remote.lock);
  s.remote.queue.clear();
}

Runtime* Runtime::current() noexcept { return t_current; }

void Runtime::schedule(std::coroutine_handle<> handle) noexcept {
  auto& s = *impl_;
  if (t_current == this) {
    try {
      s.local.push_back(handle);
      return;
    } catch (const std::bad_alloc&) {
      // Past the reserved capacity with no memory to grow: the remote queue may have room.
    }
    std::lock_guard lock(s.remote.lock);
    try {
      s.remote.queue.push_back(handle);
      s.remote.pending.store(true, std::memory_order_seq_cst);
      return;
    } catch (const std::bad_alloc&) {
      // Neither queue can take it and nothing else can drain them: losing it would hang the run.
      std::fputs("coshard: out of host memory in the scheduler (more than 1024 tasks ready at once)\n", stderr);
      std::abort();
    }
  }
  // Everything, the eventfd wake-up included, happens inside the critical section: the reactor
  // drains under the same lock, so `handle` cannot run (and finish, and let its Runtime be
  // destroyed) while this thread still touches the runtime. TSan caught the post racing with
  // ~Runtime when it came after the unlock.
  for (;;) {
    {
      std::lock_guard lock(s.remote.lock);
      bool queued = false;
      try {
        s.remote.queue.push_back(handle);
        queued = true;
      } catch (const std::bad_alloc&) {
        // The queue is full and cannot grow: wake the reactor to drain it (a swap, which
        // allocates nothing), then try again.
      }
      s.remote.pending.store(true, std::memory_order_seq_cst);
      if (s.remote.sleeping.load(std::memory_order_seq_cst)) (void)::eventfd_write(s.wake.native_handle(), 1);
      if (queued) return;
    }
    std::this_thread::yield();
  }
}

void Runtime::add_poller(Poller* poller) {
  assert(on_reactor_thread());
  impl_->pollers.push_back(poller);
}

void Runtime::remove_poller(Poller* poller) {
  assert(on_reactor_thread());
  std::erase(impl_->pollers, poller);
}

Poller* Runtime::find_owned_poller(const std::type_info& type) const {
  for (const auto& [t, p] : impl_->owned_pollers)
    if (t == std::type_index(type)) return p.get();
  return nullptr;
}

void Runtime::adopt_poller(const std::type_info& type, std::unique_ptr<Poller> poller) {
  add_poller(poller.get());
  impl_->owned_pollers.emplace_back(std::type_index(type), std::move(poller));
}

asio::io_context& Runtime::io_context() noexcept { return impl_->io; }

std::size_t Runtime::live_tasks() const noexcept {
  return impl_->live.load(std::memory_order_relaxed);
}

const RuntimeOptions& Runtime::options() const noexcept { return impl_->options; }

bool Runtime::stopping() const noexcept {
  return impl_->stopping.load(std::memory_order_relaxed);
}

void Runtime::post_blocking(std::function<void()> job) {
  auto& s = *impl_;
  std::call_once(s.pool_once, [&] {
    s.pool = std::make_unique<asio::thread_pool>(s.options.blocking_threads == 0 ? 1 : s.options.blocking_threads);
  });
  // A blocking job writes log lines as the posting thread's rank.
  asio::post(*s.pool, [job = std::move(job), rank = log::thread_rank()] {
    log::set_thread_rank(rank);
    log::set_thread_name("blocking");
    job();
  });
}

void Runtime::start_root(std::coroutine_handle<> root, detail::RootPromise& promise) {
  auto& s = *impl_;
  {
    std::lock_guard lock(s.registry_mutex);
    promise.next = s.roots;
    promise.prev = nullptr;
    if (s.roots) s.roots->prev = &promise;
    s.roots = &promise;
    promise.registered = true;
    s.live.fetch_add(1, std::memory_order_relaxed);
  }
  schedule(root);
}

namespace detail {

Runtime* current_runtime() noexcept { return t_current; }

void wake(Waiter& waiter) {
  if (waiter.runtime) {
    waiter.runtime->schedule(waiter.handle);
  } else {
    waiter.handle.resume();
  }
}

std::coroutine_handle<> JoinStateBase::finish(Runtime* self, bool resume_waiter) noexcept {
  // acq_rel: publishes the result to the waiter; acquires waiter_ from set_waiter().
  const int previous = state_.exchange(kDone, std::memory_order_acq_rel);
  state_.notify_all();
  if (previous == kWaiting && resume_waiter) {
    if (waiter_runtime_ == nullptr || waiter_runtime_ == self) return waiter_;
    waiter_runtime_->schedule(waiter_);
  }
  return std::noop_coroutine();
}

void JoinStateBase::wait_blocking() const noexcept {
  if (spin_until([this] { return state_.load(std::memory_order_acquire) == kDone; }, std::chrono::microseconds(20))) return;
  for (int s = state_.load(std::memory_order_acquire); s != kDone;
       s = state_.load(std::memory_order_acquire)) {
    state_.wait(s, std::memory_order_acquire);
  }
}

void RootPromise::unregister() noexcept {
  auto& s = *runtime_->impl_;
  std::lock_guard lock(s.registry_mutex);
  if (!registered) return;
  if (prev) prev->next = next; else s.roots = next;
  if (next) next->prev = prev;
  prev = next = nullptr;
  registered = false;
  s.live.fetch_sub(1, std::memory_order_relaxed);
}

RootPromise::~RootPromise() {
  if (finished_) return;
  // Destroyed before finishing: runtime shutdown. Unregister (if still listed) and tell the
  // JoinHandle, without resuming any waiter: the reactor is gone.
  unregister();
  join_->set_error(Error(ErrorCode::shutdown, "the task was destroyed by runtime shutdown before it finished"));
  join_->finish(runtime_, false);
}

std::coroutine_handle<> RootPromise::FinalAwaiter::await_suspend(
    std::coroutine_handle<RootPromise> self) const noexcept {
  RootPromise& p = self.promise();
  p.finished_ = true;
  p.unregister();
  std::coroutine_handle<> next = p.join_->finish(p.runtime_, true);
  self.destroy();
  return next;
}

}  // namespace detail

}  // namespace coshard::async

namespace coshard {
namespace detail {
namespace {
// Made during static initialisation, while there is memory.
const std::shared_ptr<const std::string> kMessageLost = std::make_shared<const std::string>(
    "out of host memory: there was not enough left to keep this error's message");
const std::string kEmptyMessage;
}  // namespace
const std::shared_ptr<const std::string>& message_lost_for_memory() noexcept { return kMessageLost; }
const std::string& empty_message() noexcept { return kEmptyMessage; }
}  // namespace detail

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::out_of_range: return "out_of_range";
    case ErrorCode::out_of_memory: return "out_of_memory";
    case ErrorCode::timeout: return "timeout";
    case ErrorCode::closed: return "closed";
    case ErrorCode::shutdown: return "shutdown";
    case ErrorCode::strict_sync: return "strict_sync";
    case ErrorCode::task_failed: return "task_failed";
    case ErrorCode::device: return "device";
    case ErrorCode::io: return "io";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::internal: return "internal";
  }
  return "unknown";
}

}  // namespace coshard
