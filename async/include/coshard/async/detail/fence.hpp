// Fence: one recorded point in one stream — what an Event refers to. Backends implement it
// (CPU: an atomic flag completed by the stream's worker; CUDA: a timing-disabled cudaEvent_t).
#pragma once

#include <chrono>
#include <optional>

#include "coshard/async/detail/wait_list.hpp"
#include "coshard/async/device.hpp"
#include "coshard/async/result.hpp"

namespace coshard::async::detail {

class Fence {
 public:
  explicit Fence(Device device) : device_(device) {}
  virtual ~Fence() = default;
  Fence(const Fence&) = delete;
  Fence& operator=(const Fence&) = delete;

  Device device() const noexcept { return device_; }

  // Non-blocking: has the device passed this point? (An errored stream counts as passed.)
  virtual bool query() = 0;
  // After query() is true: the stream's error, if it failed before reaching this point.
  virtual Result<void> status() = 0;
  // Blocks the calling thread until passed. Callers go through detail::blocking_wait().
  virtual Result<void> wait_blocking() = 0;
  // Registers a suspended coroutine to be woken once passed; false if already passed.
  // Called on the waiter's reactor thread.
  virtual bool add_waiter(Waiter& waiter) = 0;
  // Unregisters a waiter that will not be resumed (its frame is being destroyed).
  virtual void remove_waiter(Waiter& waiter) = 0;
  // Fences of Stream::record_timed carry the time the device passed them. `start` is a timed
  // fence of the same backend and device; both have passed (Event checks all of that).
  virtual bool timed() const noexcept { return false; }
  virtual double elapsed_ms_since(Fence& start) = 0;
  // A timed fence that has passed, where the device's clock is the host's steady_clock (CPU
  // streams): the time it passed; otherwise nullopt.
  virtual std::optional<std::chrono::steady_clock::time_point> host_time() const noexcept { return std::nullopt; }

 private:
  Device device_;
};

}  // namespace coshard::async::detail
