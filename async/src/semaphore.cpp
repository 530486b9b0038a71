#include "coshard/async/semaphore.hpp"

#include <cassert>

#include "coshard/async/runtime.hpp"

namespace coshard::async {

Semaphore::~Semaphore() {
  std::lock_guard lock(mutex_);
  while (detail::Waiter* w = queue_.pop_front()) {
    auto* a = static_cast<AcquireAwaiter*>(w->context);
    a->state_ = AcquireAwaiter::State::closed;
    a->sem_ = nullptr;
    detail::wake(*w);
  }
}

bool Semaphore::AcquireAwaiter::await_suspend(std::coroutine_handle<> awaiting) {
  std::lock_guard lock(sem_->mutex_);
  if (sem_->closed_) {
    state_ = State::closed;
    return false;
  }
  if (n_ > sem_->capacity_) {
    state_ = State::too_large;
    return false;
  }
  if (sem_->queue_.empty() && sem_->available_ >= n_) {
    sem_->available_ -= n_;
    state_ = State::granted;
    return false;
  }
  waiter_.handle = awaiting;
  waiter_.runtime = Runtime::current();
  assert(waiter_.runtime != nullptr && "Semaphore::acquire awaited outside a runtime");
  waiter_.context = this;
  sem_->queue_.push_back(waiter_);
  ++sem_->waiting_;
  state_ = State::waiting;
  suspended_ = true;
  return true;
}

Result<Semaphore::Permit> Semaphore::AcquireAwaiter::await_resume() {
  // After a suspension, state_ was written under the mutex by the thread that woke us; the
  // hand-off through the runtime's queue orders that write before this read.
  suspended_ = false;
  const State s = std::exchange(state_, State::init);
  switch (s) {
    case State::granted:
      return Permit(sem_, n_);
    case State::too_large:
      return fail(ErrorCode::invalid_argument, "Semaphore::acquire(n=", n_,
                  "): more than the semaphore's capacity (", sem_->capacity_, "); it could never be granted");
    case State::closed:
      return fail(ErrorCode::closed, "Semaphore::acquire(n=", n_, "): the semaphore is closed");
    default:
      return fail(ErrorCode::internal, "Semaphore::acquire: resumed in state ", static_cast<int>(s));
  }
}

Semaphore::AcquireAwaiter::~AcquireAwaiter() {
  // Only an awaiter destroyed while suspended (runtime shutdown) still has business here.
  // suspended_ is the owner's own flag; state_ may be written by a granting thread, so it is
  // read under the mutex only.
  if (!suspended_ || sem_ == nullptr) return;
  std::lock_guard lock(sem_->mutex_);
  if (waiter_.linked) {
    sem_->queue_.remove(waiter_);
    --sem_->waiting_;
    sem_->grant_locked();  // the head may have changed: later waiters may fit now
  } else if (state_ == State::granted) {
    sem_->available_ += n_;  // granted but never resumed: give the permits back
    sem_->grant_locked();
  }
}

std::optional<Semaphore::Permit> Semaphore::try_acquire(std::size_t n) {
  std::lock_guard lock(mutex_);
  if (closed_ || !queue_.empty() || available_ < n) return std::nullopt;
  available_ -= n;
  return Permit(this, n);
}

void Semaphore::release(std::size_t n) {
  std::lock_guard lock(mutex_);
  available_ += n;
  assert(available_ <= capacity_ && "Semaphore::release: more permits returned than were taken");
  grant_locked();
}

void Semaphore::close() {
  std::lock_guard lock(mutex_);
  closed_ = true;
  while (detail::Waiter* w = queue_.pop_front()) {
    --waiting_;
    static_cast<AcquireAwaiter*>(w->context)->state_ = AcquireAwaiter::State::closed;
    detail::wake(*w);
  }
}

std::size_t Semaphore::available() const {
  std::lock_guard lock(mutex_);
  return available_;
}

std::size_t Semaphore::waiters() const {
  std::lock_guard lock(mutex_);
  return waiting_;
}

void Semaphore::grant_locked() {
  while (detail::Waiter* w = queue_.front()) {
    auto* a = static_cast<AcquireAwaiter*>(w->context);
    if (a->n_ > available_) break;  // FIFO: the head blocks everyone behind it
    available_ -= a->n_;
    queue_.pop_front();
    --waiting_;
    a->state_ = AcquireAwaiter::State::granted;
    detail::wake(*w);  // under the lock: the frame cannot be destroyed between grant and wake
  }
}

}  // namespace coshard::async
