// Runtime: one reactor thread that runs every coroutine of coshard.
//
// The reactor is an asio::io_context (timers, sockets, io_uring files) driven by a loop of our
// own that adds two things Asio lacks:
// - a local ready queue: a coroutine woken on the reactor thread is pushed there, with no lock
//   and no allocation (spawn, semaphore release, channel send between tasks);
// - remote wake-ups: other threads (CPU stream workers, the blocking pool) push onto a mutex-
//   guarded queue; the reactor spins on a flag for `spin_before_park` before it parks in
//   epoll, so a hand-off costs ~100 ns instead of a ~25 µs futex wake on these VMs. Only when the
//   reactor is parked does a remote wake-up pay for an eventfd write (asio::post).
// Pollers (Seastar's shape: "did you do work, may I sleep?") are polled every loop turn; the
// CUDA event poller is one. While any poller has pending work the reactor never parks for long.
//
// Lifetimes: every spawned task is a root coroutine registered with the runtime. Destroying the
// Runtime stops the reactor, drains the blocking pool, then destroys every unfinished root (and
// with it every frame it was awaiting); their JoinHandles complete with ErrorCode::shutdown.
// Nothing is resumed after the reactor stopped, nothing leaks, nothing hangs (except a blocking
// job that itself never returns: blocking jobs cannot be interrupted).
#pragma once

#include <chrono>
#include <concepts>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <utility>

#include "coshard/async/join_handle.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/task.hpp"

namespace asio {
class io_context;
}

namespace coshard::async {

struct RuntimeOptions {
  // How long an idle reactor spins on its wake-up flag before parking in epoll.
  std::chrono::nanoseconds spin_before_park{std::chrono::microseconds(20)};
  // Threads for spawn_blocking; started on first use.
  std::size_t blocking_threads = 2;
  // Local tasks resumed between two polls of the io_context (tokio's event_interval).
  std::size_t io_poll_interval = 61;
};

// Something the reactor polls each turn (e.g. CUDA events). Called on the reactor thread only.
class Poller {
 public:
  virtual ~Poller() = default;
  // Does available work; true if it did any.
  virtual bool poll() = 0;
  // True while it waits on something that only polling can notice.
  virtual bool pending() const = 0;
};

namespace detail {
class RootPromise;
class RuntimeImpl;
template <class F, class R>
class BlockingAwaiter;
}  // namespace detail

class Runtime {
 public:
  explicit Runtime(RuntimeOptions options = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The runtime whose reactor thread the caller is on, or null.
  static Runtime* current() noexcept;
  bool on_reactor_thread() const noexcept { return current() == this; }

  // Starts `task` on the reactor (on its next turn, never inline). Callable from any thread.
  template <class T>
  JoinHandle<T> spawn(Task<T> task);

  // Runs `task` to completion, blocking the calling thread: the entry point from plain code.
  // Refused on the reactor thread, where it would deadlock (co_await instead).
  template <class T>
  join_result_t<T> block_on(Task<T> task);

  // Runs `fn` on the blocking pool; the awaiting coroutine resumes on the reactor afterwards.
  template <class F>
  Task<join_result_t<std::invoke_result_t<F&>>> spawn_blocking(F fn);

  // Resumes `handle` on the reactor thread. Callable from any thread; never allocates from
  // another thread unless more than 1024 handles are pending at once.
  void schedule(std::coroutine_handle<> handle) noexcept;

  void add_poller(Poller* poller);     // reactor thread only
  void remove_poller(Poller* poller);  // reactor thread only

  // The poller of type P owned by this runtime, made (and added) on first use; it lives until
  // the runtime is destroyed, after every task frame. Reactor thread only.
  template <class P>
  P& owned_poller() {
    if (Poller* p = find_owned_poller(typeid(P))) return static_cast<P&>(*p);
    auto made = std::make_unique<P>();
    P& ref = *made;
    adopt_poller(typeid(P), std::move(made));
    return ref;
  }

  asio::io_context& io_context() noexcept;
  // Spawned tasks not yet finished.
  std::size_t live_tasks() const noexcept;
  const RuntimeOptions& options() const noexcept;

 private:
  friend class detail::RootPromise;
  template <class F, class R>
  friend class detail::BlockingAwaiter;
  void post_blocking(std::function<void()> job);
  Poller* find_owned_poller(const std::type_info& type) const;
  void adopt_poller(const std::type_info& type, std::unique_ptr<Poller> poller);
  void start_root(std::coroutine_handle<> root, detail::RootPromise& promise);
  bool stopping() const noexcept;

  std::unique_ptr<detail::RuntimeImpl> impl_;
};

namespace detail {

// The coroutine that owns a spawned task. It registers with its runtime, awaits the task, stores
// the result into the JoinState and destroys its own frame at the end.
class RootPromise {
 public:
  template <class T>
  RootPromise(Runtime& runtime, Task<T>&, std::shared_ptr<JoinState<T>>& join)
      : runtime_(&runtime), join_(join) {}
  ~RootPromise();

  struct RootTask {
    using promise_type = RootPromise;
    std::coroutine_handle<RootPromise> handle;
  };

  RootTask get_return_object() noexcept {
    return RootTask{std::coroutine_handle<RootPromise>::from_promise(*this)};
  }
  std::suspend_always initial_suspend() const noexcept { return {}; }
  struct FinalAwaiter {
    bool await_ready() const noexcept { return false; }
    std::coroutine_handle<> await_suspend(std::coroutine_handle<RootPromise> self) const noexcept;
    void await_resume() const noexcept {}
  };
  FinalAwaiter final_suspend() const noexcept { return {}; }
  void return_void() noexcept {}
  void unhandled_exception() noexcept { std::terminate(); }  // the body catches everything

  // Intrusive registry links, guarded by the runtime's registry mutex.
  RootPromise* prev = nullptr;
  RootPromise* next = nullptr;
  bool registered = false;

 private:
  friend class coshard::async::Runtime;
  // Leaves the runtime's registry (if still listed); takes the registry lock.
  void unregister() noexcept;
  Runtime* runtime_;
  std::shared_ptr<JoinStateBase> join_;
  bool finished_ = false;
};

inline std::string describe_exception(std::exception_ptr ex) {
  try {
    std::rethrow_exception(ex);
  } catch (const std::bad_alloc&) {
    return "out of host memory (std::bad_alloc: a host allocation failed)";
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "non-standard exception";
  }
}

}  // namespace detail
}  // namespace coshard::async

namespace coshard::async {
namespace detail {

template <class T>
RootPromise::RootTask run_root(Runtime& runtime, Task<T> task,
                               std::shared_ptr<JoinState<T>> join) {
  (void)runtime;
  std::optional<join_result_t<T>> result;
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(task);
      result.emplace(Result<void>{});
    } else if constexpr (is_result_v<T>) {
      result.emplace(co_await std::move(task));
    } else {
      result.emplace(Result<T>(co_await std::move(task)));
    }
  } catch (...) {
    try {
      result.emplace(fail(ErrorCode::task_failed,
                          "task ended with an exception: ", describe_exception(std::current_exception())));
    } catch (...) {
      // Not even the message fits (std::bad_alloc at an address-space limit): a text short
      // enough to need no allocation (the string's own buffer), never std::terminate.
      result.emplace(fail(Error(ErrorCode::out_of_memory, "out of memory")));
    }
  }
  // The finished frame still holds the task's parameters (a coroutine's by-value arguments live
  // until its frame goes): destroy it before the result is published, or a block_on caller on
  // another thread could tear down what they refer to (a stream, an allocator) first.
  { Task<T> finished = std::move(task); }
  join->set_result(std::move(*result));
}

template <class F, class R>
class BlockingAwaiter {
 public:
  BlockingAwaiter(Runtime& runtime, F& fn) : runtime_(runtime), fn_(fn) {}
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> awaiting);
  join_result_t<R> await_resume() { return std::move(*result_); }

 private:
  Runtime& runtime_;
  F& fn_;
  std::optional<join_result_t<R>> result_;
};

}  // namespace detail

template <class T>
JoinHandle<T> Runtime::spawn(Task<T> task) {
  auto join = std::make_shared<detail::JoinState<T>>();
  if (stopping()) {
    join->set_result(fail(ErrorCode::shutdown, "spawn: the runtime is shutting down"));
    join->finish(this, false);
    return JoinHandle<T>(std::move(join));
  }
  auto root = detail::run_root<T>(*this, std::move(task), join);
  start_root(root.handle, root.handle.promise());
  return JoinHandle<T>(std::move(join));
}

template <class T>
join_result_t<T> Runtime::block_on(Task<T> task) {
  if (on_reactor_thread()) {
    return fail(ErrorCode::invalid_argument,
                "block_on: called on the runtime's reactor thread, where it would deadlock; "
                "co_await the task instead");
  }
  JoinHandle<T> handle = spawn(std::move(task));
  handle.state()->wait_blocking();
  return handle.state()->take();
}

template <class F>
Task<join_result_t<std::invoke_result_t<F&>>> Runtime::spawn_blocking(F fn) {
  using R = std::invoke_result_t<F&>;
  co_return co_await detail::BlockingAwaiter<F, R>(*this, fn);
}

template <class F, class R>
void detail::BlockingAwaiter<F, R>::await_suspend(std::coroutine_handle<> awaiting) {
  runtime_.post_blocking([this, awaiting] {
    try {
      if constexpr (std::is_void_v<R>) {
        fn_();
        result_.emplace();
      } else {
        result_.emplace(fn_());
      }
    } catch (...) {
      result_.emplace(fail(ErrorCode::task_failed, "blocking job ended with an exception: ",
                           describe_exception(std::current_exception())));
    }
    runtime_.schedule(awaiting);
  });
}

}  // namespace coshard::async
