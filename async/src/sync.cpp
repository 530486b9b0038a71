#include "coshard/async/sync.hpp"

namespace coshard::async {
namespace {
std::atomic<std::uint64_t> g_blocking_waits{0};
std::atomic<bool> g_strict{false};
}  // namespace

std::uint64_t blocking_waits() noexcept { return g_blocking_waits.load(std::memory_order_relaxed); }
bool strict_sync() noexcept { return g_strict.load(std::memory_order_relaxed); }
void set_strict_sync(bool on) noexcept { g_strict.store(on, std::memory_order_relaxed); }

namespace detail {
void count_blocking_wait() noexcept { g_blocking_waits.fetch_add(1, std::memory_order_relaxed); }

Unexpected strict_sync_error(std::string_view what) {
  return fail(ErrorCode::strict_sync, "host-blocking wait '", what,
              "' attempted while strict sync mode is on (blocking_waits() counts it)");
}
}  // namespace detail
}  // namespace coshard::async
