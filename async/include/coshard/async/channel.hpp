// Channel<T>: a bounded multi-producer, single-consumer queue of values between tasks.
//
//   auto ch = make_channel<Batch>(4);          // Result<std::pair<Sender<Batch>, Receiver<Batch>>>
//   auto [tx, rx] = std::move(*ch);
//   co_await tx.send(batch);                   // waits while 4 values are queued
//   while (auto b = co_await rx.recv()) ...    // std::nullopt once every Sender is gone and the
//                                              // queue is drained
// Rules:
// - Senders are served in arrival order when the queue is full (no barging past a waiter).
// - Values are delivered in the order their send completed. None is dropped while the Receiver
//   lives; once it is gone, send() fails with ErrorCode::closed and the value is handed back
//   inside the awaiter (take_unsent()).
// - Thread-safe: senders and the receiver may live on different threads/runtimes.
// - The stream ends when the last Sender is destroyed. A Sender passed by value into a coroutine
//   lives as long as that coroutine's frame, which outlives the body (until its Task is
//   destroyed): move it into a local scope that ends when the producer is done.
#pragma once

#include <cassert>
#include <coroutine>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "coshard/async/detail/wait_list.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/runtime.hpp"

namespace coshard::async {

template <class T>
class Sender;
template <class T>
class Receiver;

namespace detail {

template <class T>
struct ChannelState {
  explicit ChannelState(std::size_t cap) : capacity(cap) {}
  std::mutex mutex;
  std::deque<T> queue;
  const std::size_t capacity;
  std::size_t senders = 1;
  bool receiver_alive = true;
  WaitList blocked_senders;     // context -> SendAwaiter
  Waiter* receiver = nullptr;   // the receiver, when it waits on an empty queue

  // Moves the oldest blocked sender's value into the queue (caller holds mutex).
  void admit_sender_locked();
  void wake_receiver_locked() {
    if (receiver) {
      Waiter* r = std::exchange(receiver, nullptr);
      r->linked = false;
      wake(*r);
    }
  }
};

}  // namespace detail

template <class T>
class Sender {
 public:
  explicit Sender(std::shared_ptr<detail::ChannelState<T>> s) : state_(std::move(s)) {}
  Sender(const Sender& o) : state_(o.state_) {
    std::lock_guard lock(state_->mutex);
    ++state_->senders;
  }
  Sender(Sender&&) noexcept = default;
  Sender& operator=(Sender o) noexcept {
    std::swap(state_, o.state_);
    return *this;
  }
  ~Sender() {
    if (!state_) return;
    std::lock_guard lock(state_->mutex);
    if (--state_->senders == 0) state_->wake_receiver_locked();
  }

  class [[nodiscard]] SendAwaiter {
   public:
    SendAwaiter(detail::ChannelState<T>& s, T value) : state_(s), value_(std::move(value)) {}
    SendAwaiter(const SendAwaiter&) = delete;
    ~SendAwaiter() {
      if (!suspended_) return;
      std::lock_guard lock(state_.mutex);
      if (waiter_.linked) state_.blocked_senders.remove(waiter_);
    }
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> awaiting) {
      std::lock_guard lock(state_.mutex);
      if (!state_.receiver_alive) {
        outcome_ = Outcome::closed;
        return false;
      }
      if (state_.blocked_senders.empty() && state_.queue.size() < state_.capacity) {
        state_.queue.push_back(std::move(*value_));
        value_.reset();
        outcome_ = Outcome::sent;
        state_.wake_receiver_locked();
        return false;
      }
      waiter_.handle = awaiting;
      waiter_.runtime = Runtime::current();
      waiter_.context = this;
      state_.blocked_senders.push_back(waiter_);
      suspended_ = true;
      return true;
    }
    Result<void> await_resume() {
      suspended_ = false;
      if (outcome_ == Outcome::sent) return {};
      return fail(ErrorCode::closed, "Channel::send: the receiver is gone; the value was not delivered");
    }
    // The value of a failed send, handed back so that nothing is lost.
    std::optional<T> take_unsent() { return std::exchange(value_, std::nullopt); }

   private:
    friend struct detail::ChannelState<T>;
    friend class Receiver<T>;
    enum class Outcome { pending, sent, closed };
    detail::ChannelState<T>& state_;
    std::optional<T> value_;
    detail::Waiter waiter_;
    Outcome outcome_ = Outcome::pending;
    bool suspended_ = false;
  };

  SendAwaiter send(T value) { return SendAwaiter(*state_, std::move(value)); }

  // Queues `value` if there is room now. On failure `value` is left untouched.
  Result<void> try_send(T& value) {
    std::lock_guard lock(state_->mutex);
    if (!state_->receiver_alive) return fail(ErrorCode::closed, "Channel::try_send: the receiver is gone");
    if (!state_->blocked_senders.empty() || state_->queue.size() >= state_->capacity) {
      return fail(ErrorCode::out_of_range, "Channel::try_send: the channel is full (capacity ", state_->capacity, ")");
    }
    state_->queue.push_back(std::move(value));
    state_->wake_receiver_locked();
    return {};
  }

 private:
  std::shared_ptr<detail::ChannelState<T>> state_;
};

template <class T>
class Receiver {
 public:
  explicit Receiver(std::shared_ptr<detail::ChannelState<T>> s) : state_(std::move(s)) {}
  Receiver(Receiver&&) noexcept = default;
  Receiver& operator=(Receiver&&) noexcept = default;
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;
  ~Receiver() {
    if (!state_) return;
    std::lock_guard lock(state_->mutex);
    state_->receiver_alive = false;
    while (detail::Waiter* w = state_->blocked_senders.pop_front()) {
      static_cast<typename Sender<T>::SendAwaiter*>(w->context)->outcome_ = Sender<T>::SendAwaiter::Outcome::closed;
      detail::wake(*w);
    }
  }

  class [[nodiscard]] RecvAwaiter {
   public:
    explicit RecvAwaiter(detail::ChannelState<T>& s) : state_(s) {}
    RecvAwaiter(const RecvAwaiter&) = delete;
    ~RecvAwaiter() {
      if (!suspended_) return;
      std::lock_guard lock(state_.mutex);
      if (state_.receiver == &waiter_) state_.receiver = nullptr;
    }
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> awaiting) {
      std::lock_guard lock(state_.mutex);
      if (!state_.queue.empty() || state_.senders == 0) {
        take_locked();
        return false;
      }
      assert(state_.receiver == nullptr && "Channel: only one receive may wait at a time");
      waiter_.handle = awaiting;
      waiter_.runtime = Runtime::current();
      waiter_.linked = true;
      state_.receiver = &waiter_;
      suspended_ = true;
      return true;
    }
    std::optional<T> await_resume() {
      if (suspended_) {
        suspended_ = false;
        std::lock_guard lock(state_.mutex);
        take_locked();
      }
      return std::move(value_);
    }

   private:
    void take_locked() {
      if (state_.queue.empty()) return;  // every sender gone: end of stream
      value_.emplace(std::move(state_.queue.front()));
      state_.queue.pop_front();
      state_.admit_sender_locked();
    }
    detail::ChannelState<T>& state_;
    detail::Waiter waiter_;
    std::optional<T> value_;
    bool suspended_ = false;
  };

  RecvAwaiter recv() { return RecvAwaiter(*state_); }

  std::optional<T> try_recv() {
    std::lock_guard lock(state_->mutex);
    if (state_->queue.empty()) return std::nullopt;
    std::optional<T> v(std::move(state_->queue.front()));
    state_->queue.pop_front();
    state_->admit_sender_locked();
    return v;
  }

  std::size_t size() const {
    std::lock_guard lock(state_->mutex);
    return state_->queue.size();
  }

 private:
  std::shared_ptr<detail::ChannelState<T>> state_;
};

template <class T>
void detail::ChannelState<T>::admit_sender_locked() {
  while (queue.size() < capacity) {
    Waiter* w = blocked_senders.pop_front();
    if (!w) return;
    auto* s = static_cast<typename Sender<T>::SendAwaiter*>(w->context);
    queue.push_back(std::move(*s->value_));
    s->value_.reset();
    s->outcome_ = Sender<T>::SendAwaiter::Outcome::sent;
    wake(*w);
  }
}

template <class T>
Result<std::pair<Sender<T>, Receiver<T>>> make_channel(std::size_t capacity) {
  if (capacity == 0) {
    return fail(ErrorCode::invalid_argument, "make_channel(capacity=0): capacity must be at least 1");
  }
  auto state = std::make_shared<detail::ChannelState<T>>(capacity);
  return std::pair<Sender<T>, Receiver<T>>(Sender<T>(state), Receiver<T>(state));
}

}  // namespace coshard::async
