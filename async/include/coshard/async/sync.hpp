// Sync accounting: every host-blocking wait in coshard goes through detail::blocking_wait(),
// which counts it. A steady-state training step adds zero to blocking_waits(); tests prove it
// by reading the counter, or by turning on strict mode, where such a wait fails with
// ErrorCode::strict_sync instead of blocking.
//
// Counted: Stream::synchronize, Event::synchronize, teardown waits (allocator destruction).
// Not counted: Runtime::block_on (the user's own entry point, one per step by design) and waits
// on a CPU stream's worker thread (that thread is the "device", not the host).
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>
#include <utility>

#include "coshard/async/result.hpp"

namespace coshard::async {

// Host-blocking waits since process start (relaxed: a statistic).
std::uint64_t blocking_waits() noexcept;

bool strict_sync() noexcept;
void set_strict_sync(bool on) noexcept;

// Strict mode for a scope; restores the previous setting. Process-wide, not per thread.
class StrictSyncScope {
 public:
  StrictSyncScope() : previous_(strict_sync()) { set_strict_sync(true); }
  ~StrictSyncScope() { set_strict_sync(previous_); }
  StrictSyncScope(const StrictSyncScope&) = delete;
  StrictSyncScope& operator=(const StrictSyncScope&) = delete;

 private:
  bool previous_;
};

namespace detail {

void count_blocking_wait() noexcept;
Unexpected strict_sync_error(std::string_view what);

// The one door for host-blocking waits. `wait` returns Result<void>.
template <class Wait>
Result<void> blocking_wait(std::string_view what, Wait&& wait) {
  count_blocking_wait();
  if (strict_sync()) return strict_sync_error(what);
  return std::forward<Wait>(wait)();
}

}  // namespace detail
}  // namespace coshard::async
