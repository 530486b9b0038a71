// StreamBudget: a counting budget (bytes, or slots) whose holders hand their permits back in
// stream order. `release_after(event, permit)` returns the permit once `event` has completed,
// with no host wait: the twin of Block::reset_after, for a budget instead of memory. The ZeRO
// engine gives a released unit's bytes back to max_live_bytes once the compute stream has passed
// the unit's last use, and an NVMe read slot once the gather that copied out of its buffer has.
//
//   auto budget = StreamBudget::create(max_live_bytes);
//   auto permit = co_await budget->semaphore().acquire(bytes);   // waits, never over-admits
//   ...                                                          // enqueue work that uses it
//   budget->release_after(*stream.record(), std::move(*permit)); // back once the stream passed
//
// Rules:
// - Returns are handed back in the order they were given (the events of one stream complete in
//   order): one task drains each burst of returns, awaiting the oldest event, then taking every
//   completed one; never one task per return.
// - An event that fails (its stream failed) still hands its permit back: the error is the
//   stream's, reported where the stream is awaited.
// - release_after is called on the thread of a coshard Runtime (it spawns the drain there), and a
//   budget is used from that one thread; its semaphore keeps its own rules (semaphore.hpp).
// - Made shared: a drain keeps its budget alive while returns are pending, so a budget may outlive
//   its owner (an engine that ends mid-step), never the runtime draining it.
#pragma once

#include <cstddef>
#include <deque>
#include <memory>

#include "coshard/async/result.hpp"
#include "coshard/async/semaphore.hpp"
#include "coshard/async/event.hpp"
#include "coshard/async/task.hpp"

namespace coshard::async {

class StreamBudget : public std::enable_shared_from_this<StreamBudget> {
  struct Key {};  // create() is the only way to make one (a budget is always shared)

 public:
  static std::shared_ptr<StreamBudget> create(std::size_t capacity) { return std::make_shared<StreamBudget>(Key{}, capacity); }
  StreamBudget(Key, std::size_t capacity) : semaphore_(capacity) {}
  StreamBudget(const StreamBudget&) = delete;
  StreamBudget& operator=(const StreamBudget&) = delete;

  Semaphore& semaphore() noexcept { return semaphore_; }
  // `permit` (of this budget's semaphore) goes back once `passed` has completed. Fails only
  // outside a coshard Runtime (the permit then goes back at once: nothing can await the event).
  Result<void> release_after(Event passed, Semaphore::Permit permit);
  // Counted in permits handed to release_after and not yet back.
  std::size_t pending() const noexcept { return pending_; }

 private:
  static Task<void> drain(std::shared_ptr<StreamBudget> self);

  struct Return {
    Event passed;
    Semaphore::Permit permit;
  };
  Semaphore semaphore_;
  std::deque<Return> returns_;  // oldest first
  std::size_t pending_ = 0;
  bool draining_ = false;
};

}  // namespace coshard::async
