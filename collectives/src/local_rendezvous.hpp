// The Local backend's meeting point (local.cpp): ranks of one process arrive, wait for each other
// with a deadline, and break the group for all with a reason. Private: not installed.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "coshard/async/detail/cpu_relax.hpp"
#include "coshard/async/result.hpp"

namespace coshard::collectives::detail {

using Clock = std::chrono::steady_clock;

inline std::string rank_list(const std::vector<bool>& present) {
  std::string s = "[";
  for (std::size_t q = 0; q < present.size(); ++q) {
    if (present[q]) continue;
    if (s.size() > 1) s += ", ";
    s += std::to_string(q);
  }
  return s + "]";
}

// A reusable barrier for `n` ranks with a deadline. Breaking it (timeout, mismatch) is final:
// every current and later arrival fails with the reason.
class Rendezvous {
 public:
  Rendezvous(int n, std::chrono::milliseconds timeout)
      : n_(n), timeout_(timeout), present_(static_cast<std::size_t>(n), false) {}

  // `complete`, when given, runs on the last rank to arrive before the others are let go (under
  // the lock, so it sees every rank's posts); its failure breaks the rendezvous.
  Result<void> arrive_and_wait(int rank, Clock::time_point deadline, std::chrono::microseconds spin,
                               const std::function<std::string()>& what,
                               const std::function<Result<void>()>& complete = {}) {
    std::unique_lock lock(mutex_);
    if (broken_) return fail(Error(code_, why_));
    const std::uint64_t generation = generation_;
    present_[static_cast<std::size_t>(rank)] = true;
    if (++arrived_ == n_) {
      if (complete) {
        if (auto done = complete(); !done) {
          break_locked(done.error().code(), done.error().message());
          return done;
        }
      }
      arrived_ = 0;
      std::fill(present_.begin(), present_.end(), false);
      ++generation_;
      published_.store(generation_, std::memory_order_release);  // for the spinners
      lock.unlock();
      cv_.notify_all();
      return {};
    }
    lock.unlock();

    // acquire: pairs with the release above, so the posts of every rank are visible.
    if (async::detail::spin_until([&] { return published_.load(std::memory_order_acquire) != generation; }, spin)) return {};

    lock.lock();
    while (generation_ == generation && !broken_) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation && !broken_) {
        break_locked(ErrorCode::timeout, what() + ": rank " + std::to_string(rank) + " timed out after " +
                                             std::to_string(timeout_.count()) + " ms waiting for ranks " +
                                             rank_list(present_));
      }
    }
    if (generation_ != generation) return {};
    return fail(Error(code_, why_));
  }

  Result<void> status() {
    std::lock_guard lock(mutex_);
    if (broken_) return fail(Error(code_, why_));
    return {};
  }

  void break_with(ErrorCode code, std::string why) {
    std::lock_guard lock(mutex_);
    if (!broken_) break_locked(code, std::move(why));
  }

 private:
  void break_locked(ErrorCode code, std::string why) {
    broken_ = true;
    code_ = code;
    why_ = std::move(why);
    cv_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  const int n_;
  const std::chrono::milliseconds timeout_;  // for messages; callers pass the deadline
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  std::atomic<std::uint64_t> published_{0};
  std::vector<bool> present_;
  bool broken_ = false;
  ErrorCode code_ = ErrorCode::timeout;
  std::string why_;
};

}  // namespace coshard::collectives::detail
