// Task<T>: a lazy coroutine that produces a T.
//
// Rules:
// - A Task does not start until it is awaited (or handed to Runtime::spawn / block_on).
// - When it finishes it resumes its awaiter by symmetric transfer, so chains of any depth run in
//   constant stack.
// - A Task owns its coroutine frame: destroying an unfinished Task destroys the frame (and with
//   it every Task that frame is awaiting). This is how runtime shutdown frees pending work.
// - An exception escaping the body is stored and rethrown at the co_await. At the public
//   boundary (JoinHandle, Runtime::block_on) it becomes an Error with code task_failed.
#pragma once

#include <coroutine>
#include <exception>
#include <type_traits>
#include <utility>
#include <variant>

namespace coshard::async {

template <class T = void>
class Task;

namespace detail {

class TaskPromiseBase {
 public:
  std::suspend_always initial_suspend() const noexcept { return {}; }

  struct FinalAwaiter {
    bool await_ready() const noexcept { return false; }
    template <class Promise>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<Promise> self) const noexcept {
      return self.promise().continuation_;
    }
    void await_resume() const noexcept {}
  };
  FinalAwaiter final_suspend() const noexcept { return {}; }

  void set_continuation(std::coroutine_handle<> continuation) noexcept {
    continuation_ = continuation;
  }

 protected:
  std::coroutine_handle<> continuation_ = std::noop_coroutine();
};

template <class T>
class TaskPromise final : public TaskPromiseBase {
 public:
  Task<T> get_return_object() noexcept;

  template <class U>
    requires std::is_convertible_v<U&&, T>
  void return_value(U&& value) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
    result_.template emplace<1>(std::forward<U>(value));
  }
  void unhandled_exception() noexcept { result_.template emplace<2>(std::current_exception()); }

  T take() {
    if (result_.index() == 2) std::rethrow_exception(std::get<2>(result_));
    return std::move(std::get<1>(result_));
  }

 private:
  std::variant<std::monostate, T, std::exception_ptr> result_;
};

template <>
class TaskPromise<void> final : public TaskPromiseBase {
 public:
  Task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void unhandled_exception() noexcept { exception_ = std::current_exception(); }
  void take() {
    if (exception_) std::rethrow_exception(exception_);
  }

 private:
  std::exception_ptr exception_;
};

}  // namespace detail

template <class T>
class [[nodiscard]] Task {
 public:
  using promise_type = detail::TaskPromise<T>;
  using value_type = T;

  Task() noexcept = default;
  explicit Task(std::coroutine_handle<promise_type> handle) noexcept : handle_(handle) {}
  Task(Task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  Task& operator=(Task&& other) noexcept {
    if (this != &other) {
      if (handle_) handle_.destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
    if (handle_) handle_.destroy();
  }

  bool valid() const noexcept { return static_cast<bool>(handle_); }
  bool done() const noexcept { return handle_ && handle_.done(); }

  auto operator co_await() && noexcept {
    struct Awaiter {
      std::coroutine_handle<promise_type> handle;
      bool await_ready() const noexcept { return !handle || handle.done(); }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<> awaiting) noexcept {
        handle.promise().set_continuation(awaiting);
        return handle;
      }
      T await_resume() { return handle.promise().take(); }
    };
    return Awaiter{handle_};
  }

  // For the runtime's adapters: the raw frame, without giving up ownership.
  std::coroutine_handle<promise_type> handle() const noexcept { return handle_; }

 private:
  std::coroutine_handle<promise_type> handle_;
};

namespace detail {
template <class T>
Task<T> TaskPromise<T>::get_return_object() noexcept {
  return Task<T>{std::coroutine_handle<TaskPromise<T>>::from_promise(*this)};
}
inline Task<void> TaskPromise<void>::get_return_object() noexcept {
  return Task<void>{std::coroutine_handle<TaskPromise<void>>::from_promise(*this)};
}
}  // namespace detail

// The value a task of T gives back, with void mapped to std::monostate (for tuples and vectors).
template <class T>
using non_void_t = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

}  // namespace coshard::async
