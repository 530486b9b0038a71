// Semaphore: a counting semaphore for byte budgets, FIFO-fair, awaitable.
//
//   auto permit = co_await budget.acquire(unit_bytes);   // Result<Semaphore::Permit>
//   if (!permit) co_return fail(permit.error());
//   ...                                                  // the permit returns on destruction
//
// Rules (tokio's batch semaphore):
// - Waiters are served strictly in arrival order. A request that does not fit blocks every later
//   one, even smaller ones that would fit: large requests are never starved.
// - Permits are never over-admitted: available() + permits held == capacity at all times.
// - acquire(n) with n > capacity fails at once (it could never succeed); acquiring from a closed
//   semaphore fails with ErrorCode::closed, and close() fails every waiter the same way.
// - Thread-safe: release() may come from any thread; a woken waiter resumes on its own runtime.
// - The Semaphore must outlive its waiters and permits (destroying it with waiters orphans them).
#pragma once

#include <coroutine>
#include <cstddef>
#include <mutex>
#include <optional>
#include <utility>

#include "coshard/async/detail/spin_lock.hpp"
#include "coshard/async/detail/wait_list.hpp"
#include "coshard/async/result.hpp"

namespace coshard::async {

class Semaphore {
 public:
  explicit Semaphore(std::size_t capacity) : capacity_(capacity), available_(capacity) {}
  ~Semaphore();
  Semaphore(const Semaphore&) = delete;
  Semaphore& operator=(const Semaphore&) = delete;

  // Holds n permits; gives them back on destruction. Move-only.
  class Permit {
   public:
    Permit() = default;
    Permit(Semaphore* sem, std::size_t n) : sem_(sem), n_(n) {}
    Permit(Permit&& o) noexcept : sem_(std::exchange(o.sem_, nullptr)), n_(std::exchange(o.n_, 0)) {}
    Permit& operator=(Permit&& o) noexcept {
      if (this != &o) {
        release();
        sem_ = std::exchange(o.sem_, nullptr);
        n_ = std::exchange(o.n_, 0);
      }
      return *this;
    }
    ~Permit() { release(); }

    std::size_t count() const noexcept { return n_; }
    void release() noexcept {
      if (sem_ && n_) sem_->release(n_);
      sem_ = nullptr;
      n_ = 0;
    }
    // Gives up ownership without returning the permits (they are gone for good).
    void forget() noexcept {
      sem_ = nullptr;
      n_ = 0;
    }

   private:
    Semaphore* sem_ = nullptr;
    std::size_t n_ = 0;
  };

  class [[nodiscard]] AcquireAwaiter {
   public:
    AcquireAwaiter(Semaphore& sem, std::size_t n) : sem_(&sem), n_(n) {}
    AcquireAwaiter(const AcquireAwaiter&) = delete;
    ~AcquireAwaiter();
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> awaiting);
    Result<Permit> await_resume();

   private:
    friend class Semaphore;
    Semaphore* sem_;
    std::size_t n_;
    detail::Waiter waiter_;
    enum class State { init, waiting, granted, closed, too_large } state_ = State::init;
    bool suspended_ = false;
  };

  AcquireAwaiter acquire(std::size_t n = 1) { return AcquireAwaiter(*this, n); }
  // Non-blocking: permits now, or nothing (also when others are queued: no barging).
  std::optional<Permit> try_acquire(std::size_t n = 1);
  // Returns n permits (normally done by ~Permit).
  void release(std::size_t n);
  // Fails all current and future acquires with ErrorCode::closed.
  void close();

  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t available() const;
  std::size_t waiters() const;

 private:
  void grant_locked();  // serves the queue head while it fits; caller holds mutex_

  mutable detail::SpinLock mutex_;  // critical sections are a few instructions
  const std::size_t capacity_;
  std::size_t available_;
  std::size_t waiting_ = 0;
  bool closed_ = false;
  detail::WaitList queue_;
};

}  // namespace coshard::async
