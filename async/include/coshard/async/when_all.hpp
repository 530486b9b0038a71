// when_all: run several tasks concurrently and wait for all of them.
//
//   auto [a, b] = co_await when_all(fetch(x), fetch(y));   // tuple; void maps to std::monostate
//   auto values  = co_await when_all(std::move(tasks));    // vector<Task<T>> -> vector<T>
//
// The children start inline, one after another, each running until its first suspension; the
// parent resumes when the last one finishes (by symmetric transfer from that child). Every child
// runs to completion even if one throws; then the first exception (in argument order) is
// rethrown. The count is atomic so children may finish on different threads.
#pragma once

#include <atomic>
#include <coroutine>
#include <exception>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "coshard/async/task.hpp"

namespace coshard::async {
namespace detail {

struct WhenAllCounter {
  explicit WhenAllCounter(std::size_t children) : remaining(children + 1) {}
  // acq_rel: each child's result happens-before the parent's read of it.
  std::atomic<std::size_t> remaining;
  std::coroutine_handle<> parent;

  bool arrive() noexcept { return remaining.fetch_sub(1, std::memory_order_acq_rel) == 1; }
};

template <class T>
class WhenAllChild {
 public:
  class promise_type {
   public:
    WhenAllChild get_return_object() noexcept {
      return WhenAllChild(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() const noexcept { return {}; }
    struct FinalAwaiter {
      bool await_ready() const noexcept { return false; }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> self) const noexcept {
        WhenAllCounter* c = self.promise().counter_;
        return c->arrive() ? c->parent : std::noop_coroutine();
      }
      void await_resume() const noexcept {}
    };
    FinalAwaiter final_suspend() const noexcept { return {}; }
    void return_value(non_void_t<T> value) { result_.template emplace<1>(std::move(value)); }
    void unhandled_exception() noexcept { result_.template emplace<2>(std::current_exception()); }

    WhenAllCounter* counter_ = nullptr;
    std::variant<std::monostate, non_void_t<T>, std::exception_ptr> result_;
  };

  explicit WhenAllChild(std::coroutine_handle<promise_type> h) : handle_(h) {}
  WhenAllChild(WhenAllChild&& o) noexcept : handle_(std::exchange(o.handle_, {})) {}
  WhenAllChild& operator=(WhenAllChild&&) = delete;
  ~WhenAllChild() {
    if (handle_) handle_.destroy();
  }

  void start(WhenAllCounter& counter) {
    handle_.promise().counter_ = &counter;
    handle_.resume();
  }
  void rethrow_if_failed() const {
    if (handle_.promise().result_.index() == 2) std::rethrow_exception(std::get<2>(handle_.promise().result_));
  }
  non_void_t<T> take() { return std::move(std::get<1>(handle_.promise().result_)); }

 private:
  std::coroutine_handle<promise_type> handle_;
};

template <class T>
WhenAllChild<T> make_when_all_child(Task<T> task) {
  if constexpr (std::is_void_v<T>) {
    co_await std::move(task);
    co_return std::monostate{};
  } else {
    co_return co_await std::move(task);
  }
}

// Starts every child; suspends the parent unless they all finished synchronously.
template <class StartAll>
struct WhenAllAwaiter {
  WhenAllCounter& counter;
  StartAll start_all;
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> parent) {
    counter.parent = parent;
    start_all();
    return !counter.arrive();
  }
  void await_resume() const noexcept {}
};
template <class StartAll>
WhenAllAwaiter(WhenAllCounter&, StartAll) -> WhenAllAwaiter<StartAll>;

}  // namespace detail

template <class... Ts>
Task<std::tuple<non_void_t<Ts>...>> when_all(Task<Ts>... tasks) {
  std::tuple<detail::WhenAllChild<Ts>...> children(detail::make_when_all_child(std::move(tasks))...);
  detail::WhenAllCounter counter(sizeof...(Ts));
  co_await detail::WhenAllAwaiter{counter, [&] { std::apply([&](auto&... c) { (c.start(counter), ...); }, children); }};
  std::apply([](auto&... c) { (c.rethrow_if_failed(), ...); }, children);
  co_return std::apply([](auto&... c) { return std::tuple<non_void_t<Ts>...>(c.take()...); }, children);
}

template <class T>
auto when_all(std::vector<Task<T>> tasks) -> Task<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>> {
  std::vector<detail::WhenAllChild<T>> children;
  children.reserve(tasks.size());
  for (auto& t : tasks) children.push_back(detail::make_when_all_child(std::move(t)));
  detail::WhenAllCounter counter(children.size());
  co_await detail::WhenAllAwaiter{counter, [&] { for (auto& c : children) c.start(counter); }};
  for (auto& c : children) c.rethrow_if_failed();
  if constexpr (!std::is_void_v<T>) {
    std::vector<T> out;
    out.reserve(children.size());
    for (auto& c : children) out.push_back(c.take());
    co_return out;
  }
}

}  // namespace coshard::async
