// Event: a point recorded in a Stream; cheap to copy (a shared handle to the recorded fence).
//
//   Event done = *stream.record();
//   other.wait(done);              // device-side order: no host involvement
//   co_await done;                 // suspends this coroutine until the device passes the point
//
// A default-constructed Event was never recorded and counts as passed (as a fresh cudaEvent_t).
// `co_await event` gives Result<void>: the error of a stream that failed before the point (a CPU
// closure that threw, a CUDA fault). synchronize() blocks the host and is counted (sync.hpp).
#pragma once

#include <coroutine>
#include <memory>
#include <utility>

#include "coshard/async/detail/fence.hpp"
#include "coshard/async/detail/wait_list.hpp"
#include "coshard/async/result.hpp"

namespace coshard::async {

class Event {
 public:
  Event() = default;
  explicit Event(std::shared_ptr<detail::Fence> fence) : fence_(std::move(fence)) {}

  bool recorded() const noexcept { return fence_ != nullptr; }
  bool ready() const { return !fence_ || fence_->query(); }
  Device device() const noexcept { return fence_ ? fence_->device() : Device::cpu(); }

  // Host-blocking wait; counted, and refused in strict mode.
  Result<void> synchronize() const;

  // Timing, for events from Stream::record_timed: milliseconds from `start` to this event, read
  // once both have passed (never waited for: an event not yet passed is an error). CPU events
  // compare across every CPU stream; CUDA events across the streams of one device.
  bool timed() const noexcept { return fence_ && fence_->timed(); }
  Result<double> elapsed_ms_since(const Event& start) const;

  class [[nodiscard]] Awaiter {
   public:
    explicit Awaiter(std::shared_ptr<detail::Fence> fence) : fence_(std::move(fence)) {}
    Awaiter(const Awaiter&) = delete;
    ~Awaiter() {
      if (suspended_) fence_->remove_waiter(waiter_);
    }
    bool await_ready() const { return !fence_ || fence_->query(); }
    bool await_suspend(std::coroutine_handle<> awaiting);
    Result<void> await_resume() {
      suspended_ = false;
      return fence_ ? fence_->status() : Result<void>{};
    }

   private:
    std::shared_ptr<detail::Fence> fence_;
    detail::Waiter waiter_;
    bool suspended_ = false;
  };
  Awaiter operator co_await() const { return Awaiter(fence_); }

  const std::shared_ptr<detail::Fence>& fence() const noexcept { return fence_; }

 private:
  std::shared_ptr<detail::Fence> fence_;
};

}  // namespace coshard::async
