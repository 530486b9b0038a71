// SpinLock: a one-byte lock for critical sections of a few instructions (push_back/swap of a
// queue) that two threads hand back and forth. std::mutex is 40 bytes; this lets a queue's lock,
// its vector and its wake-up flag share one cache line, so a cross-core hand-off moves one line
// instead of three. Spins with a pause hint, yields after a while (these VMs may preempt the
// holder). Satisfies Lockable, so std::lock_guard works.
#pragma once

#include <atomic>
#include <thread>

#include "coshard/async/detail/cpu_relax.hpp"

namespace coshard::async::detail {

class SpinLock {
 public:
  void lock() noexcept {
    // acquire: the critical section sees everything written before the last unlock.
    while (locked_.exchange(true, std::memory_order_acquire)) {
      int spins = 0;
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins < 256) {
          cpu_relax();
        } else {
          std::this_thread::yield();
        }
      }
    }
  }
  bool try_lock() noexcept { return !locked_.exchange(true, std::memory_order_acquire); }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace coshard::async::detail
