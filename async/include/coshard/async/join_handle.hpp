// JoinHandle<T>: the awaitable result of Runtime::spawn.
//
// `co_await handle` gives join_result_t<T>: Result<T>, or the task's own Result<U> when T already
// is one (errors are not nested). A task that ended with an exception surfaces as an Error with
// code task_failed; one destroyed by runtime shutdown before finishing, as code shutdown.
// Dropping a JoinHandle (or calling detach()) detaches: the task runs on, its result discarded.
//
// Threading: the task completes on its runtime's reactor thread; the handle may be awaited from
// a coroutine on any runtime (it is resumed on its own runtime) or waited on by
// Runtime::block_on from a plain thread. The three-state atomic below orders the two sides.
#pragma once

#include <atomic>
#include <coroutine>
#include <memory>
#include <optional>
#include <utility>

#include "coshard/async/result.hpp"

namespace coshard::async {

class Runtime;

template <class T>
struct join_result {
  using type = Result<T>;
};
template <class U>
struct join_result<Result<U>> {
  using type = Result<U>;
};
template <class T>
using join_result_t = typename join_result<T>::type;

namespace detail {

Runtime* current_runtime() noexcept;  // Runtime::current(), without including runtime.hpp

class JoinStateBase {
 public:
  virtual ~JoinStateBase() = default;
  // Stores an error as the task's result (runtime shutdown destroyed the task).
  virtual void set_error(Error error) = 0;

  bool done() const noexcept { return state_.load(std::memory_order_acquire) == kDone; }

  // Registers the awaiting coroutine. False when the task is already done: do not suspend.
  bool set_waiter(std::coroutine_handle<> waiter, Runtime* waiter_runtime) noexcept {
    waiter_ = waiter;
    waiter_runtime_ = waiter_runtime;
    int expected = kPending;
    // acq_rel: publishes waiter_ to finish(); acquires the result if finish() won.
    return state_.compare_exchange_strong(expected, kWaiting, std::memory_order_acq_rel,
                                          std::memory_order_acquire);
  }

  // Called once, by the task's root coroutine after the result is stored. Returns the coroutine
  // to transfer into (the waiter, when it awaits on the same runtime) or noop.
  std::coroutine_handle<> finish(Runtime* self, bool resume_waiter) noexcept;

  // Blocks the calling (non-reactor) thread until done. Used by Runtime::block_on only.
  void wait_blocking() const noexcept;

 protected:
  static constexpr int kPending = 0;
  static constexpr int kWaiting = 1;
  static constexpr int kDone = 2;

  std::atomic<int> state_{kPending};
  std::coroutine_handle<> waiter_;
  Runtime* waiter_runtime_ = nullptr;
};

template <class T>
class JoinState final : public JoinStateBase {
 public:
  template <class R>
  void set_result(R&& result) {
    result_.emplace(std::forward<R>(result));
  }
  bool has_result() const noexcept { return result_.has_value(); }
  void set_error(Error error) override { result_.emplace(fail(std::move(error))); }

  join_result_t<T> take() {
    if (!result_) {
      return fail(ErrorCode::internal, "JoinHandle: result already taken (awaited twice?)");
    }
    join_result_t<T> out = std::move(*result_);
    result_.reset();
    return out;
  }

 private:
  std::optional<join_result_t<T>> result_;
};

}  // namespace detail

template <class T>
class [[nodiscard]] JoinHandle {
 public:
  JoinHandle() = default;
  explicit JoinHandle(std::shared_ptr<detail::JoinState<T>> state) : state_(std::move(state)) {}
  JoinHandle(JoinHandle&&) noexcept = default;
  JoinHandle& operator=(JoinHandle&&) noexcept = default;
  JoinHandle(const JoinHandle&) = delete;
  JoinHandle& operator=(const JoinHandle&) = delete;

  bool valid() const noexcept { return static_cast<bool>(state_); }
  bool done() const noexcept { return state_ && state_->done(); }

  // Lets the task run on with nobody to receive its result.
  void detach() noexcept { state_.reset(); }

  class Awaiter {
   public:
    explicit Awaiter(detail::JoinState<T>* state) : state_(state) {}
    bool await_ready() const noexcept { return state_ == nullptr || state_->done(); }
    bool await_suspend(std::coroutine_handle<> awaiting) noexcept {
      return state_->set_waiter(awaiting, detail::current_runtime());
    }
    join_result_t<T> await_resume() {
      if (state_ == nullptr) return fail(ErrorCode::invalid_argument, "JoinHandle: awaited an empty handle");
      return state_->take();
    }

   private:
    detail::JoinState<T>* state_;
  };
  Awaiter operator co_await() noexcept { return Awaiter(state_.get()); }

  // For Runtime::block_on.
  detail::JoinState<T>* state() const noexcept { return state_.get(); }

 private:
  std::shared_ptr<detail::JoinState<T>> state_;
};

}  // namespace coshard::async
