// Timers on the reactor: sleep_for(d) and timeout(d, task).
//
//   co_await sleep_for(5ms);
//   auto r = co_await timeout(2s, gather(unit));   // Result: the task's, or ErrorCode::timeout
//
// timeout() spawns the task and races it against a timer. C++ coroutines cannot be cancelled
// from outside, so a task that loses the race is detached: it runs on and its result is
// discarded (tokio would drop it). Give such tasks their data by value.
#pragma once

#include <asio/steady_timer.hpp>

#include <chrono>
#include <coroutine>
#include <memory>
#include <optional>

#include "coshard/async/join_handle.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/task.hpp"

namespace coshard::async {

class [[nodiscard]] SleepAwaiter {
 public:
  explicit SleepAwaiter(std::chrono::nanoseconds duration) : duration_(duration) {}
  bool await_ready() const noexcept { return duration_ <= std::chrono::nanoseconds::zero(); }
  void await_suspend(std::coroutine_handle<> awaiting) {
    Runtime* rt = Runtime::current();
    timer_.emplace(rt->io_context(), duration_);
    // The handler runs on the reactor; a timer destroyed with its frame (shutdown) never fires.
    timer_->async_wait([awaiting](const std::error_code&) { awaiting.resume(); });
  }
  void await_resume() const noexcept {}

 private:
  std::chrono::nanoseconds duration_;
  std::optional<asio::steady_timer> timer_;
};

inline SleepAwaiter sleep_for(std::chrono::nanoseconds duration) { return SleepAwaiter(duration); }

namespace detail {

// The first of two outcomes to arrive wins; reactor-thread only.
template <class R>
class Race {
 public:
  void complete(R value) {
    if (result_) return;
    result_.emplace(std::move(value));
    if (waiter_) Runtime::current()->schedule(std::exchange(waiter_, {}));
  }
  auto wait() {
    struct Awaiter {
      Race& race;
      bool await_ready() const noexcept { return race.result_.has_value(); }
      void await_suspend(std::coroutine_handle<> h) noexcept { race.waiter_ = h; }
      void await_resume() const noexcept {}
    };
    return Awaiter{*this};
  }
  R take() { return std::move(*result_); }

 private:
  std::optional<R> result_;
  std::coroutine_handle<> waiter_;
};

template <class T>
Task<void> forward_into_race(JoinHandle<T> handle, std::shared_ptr<Race<join_result_t<T>>> race) {
  race->complete(co_await handle);
}

}  // namespace detail

template <class T>
Task<join_result_t<T>> timeout(std::chrono::nanoseconds limit, Task<T> task) {
  Runtime* rt = Runtime::current();
  auto race = std::make_shared<detail::Race<join_result_t<T>>>();
  rt->spawn(detail::forward_into_race<T>(rt->spawn(std::move(task)), race)).detach();
  asio::steady_timer timer(rt->io_context(), limit);
  timer.async_wait([race, limit](const std::error_code& ec) {
    if (ec) return;  // cancelled: the task won
    race->complete(fail(ErrorCode::timeout, "timed out after ",
                        std::chrono::duration<double, std::milli>(limit).count(), " ms"));
  });
  co_await race->wait();
  timer.cancel();
  co_return race->take();
}

}  // namespace coshard::async
