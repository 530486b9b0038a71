// coshard's log: levelled lines through spdlog, one level per component, each line naming the
// rank and the thread (a stream's worker, a rank's reactor) it was written on.
//
//   COSHARD_LOG=warn                          every component at warn (the default)
//   COSHARD_LOG=zero=debug,collectives=info   per component; the others stay at the default
//   COSHARD_LOG=info,offload=trace            a default first, then exceptions
//
// Levels: trace, debug, info, warn, error, off. Components: async, collectives, offload,
// modules, zero, trainer, app (the user's own code). The variable is read once, at start-up;
// coshard-train's --log-level and configure() set the same thing from code.
//
// Lazy: COSHARD_LOG_DEBUG(component, "fetch unit {} ({} bytes)", id, bytes) checks the level
// first (one relaxed atomic load) and only then evaluates its arguments and formats: at a level
// that is off nothing is computed, so a line may name a value that costs something (a norm, a
// signature) without costing anything when it is off. DeepSpeed built its debug strings, even a
// tensor norm, before it checked the level.
//
// A line: "2026-11-24 12:00:01.234 D zero [rank 1 reactor] fetch unit 3 ...". The rank and the
// thread come from the writing thread's context: set_thread_rank() on a rank's thread (a
// Runtime and a CPU stream created there inherit it), set_thread_name() names the thread.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "coshard/async/result.hpp"

namespace coshard::log {

enum class Level : std::uint8_t { trace, debug, info, warn, error, off };
enum class Component : std::uint8_t { async, collectives, offload, modules, zero, trainer, app };
inline constexpr std::size_t kComponents = 7;
inline constexpr Level kDefaultLevel = Level::warn;

std::string_view to_string(Level level) noexcept;
std::string_view to_string(Component component) noexcept;

// Sets the levels from a spec as above. A bad spec changes nothing and its error names the
// item and what was expected. Components the spec does not name are set to its default (the
// spec's bare level, else kDefaultLevel), so a spec describes the whole state.
Result<void> configure(std::string_view spec);
// Reads COSHARD_LOG (unset: every component at kDefaultLevel). Done once at start-up; a bad
// value there is reported on stderr and ignored. This call returns the error instead.
Result<void> configure_from_env();
void set_level(Component component, Level level) noexcept;
Level level(Component component) noexcept;

// Where lines go: stderr unless a sink is set. The sink gets every line already formatted, from
// any thread (calls are serialised). An empty function restores stderr.
using Sink = std::function<void(Level, std::string_view line)>;
void set_sink(Sink sink);

// The writing thread's context, shown on each of its lines. A thread starts with the context of
// nobody ("[main]") unless it was started by coshard from a thread that had one (a Runtime's
// reactor, a CPU stream's worker, the blocking pool), which inherits the rank.
void set_thread_rank(int rank) noexcept;  // -1: no rank
int thread_rank() noexcept;
void set_thread_name(std::string_view name);  // kept to 31 characters
std::string_view thread_name() noexcept;

// Sets this thread's rank for a scope (e.g. while a rank's objects are created on the main
// thread), restoring the previous one after.
class ScopedRank {
 public:
  explicit ScopedRank(int rank) noexcept : previous_(thread_rank()) { set_thread_rank(rank); }
  ~ScopedRank() { set_thread_rank(previous_); }
  ScopedRank(const ScopedRank&) = delete;
  ScopedRank& operator=(const ScopedRank&) = delete;

 private:
  int previous_;
};

namespace detail {
// One byte per component: the lowest level written. Relaxed loads: a level change reaches
// other threads soon, not at a defined point, which is all a log needs.
extern std::array<std::atomic<std::uint8_t>, kComponents> g_levels;
void write(Component component, Level level, std::string_view message);
}  // namespace detail

inline bool enabled(Component component, Level level) noexcept {
  return static_cast<std::uint8_t>(level) >=
         detail::g_levels[static_cast<std::size_t>(component)].load(std::memory_order_relaxed);
}

}  // namespace coshard::log

// The arguments are evaluated only when the line is written. The format string is checked at
// compile time (fmt::format_string).
#define COSHARD_LOG(component, level, ...)                                                          \
  do {                                                                                              \
    if (::coshard::log::enabled(::coshard::log::Component::component, ::coshard::log::Level::level)) \
      ::coshard::log::detail::write(::coshard::log::Component::component, ::coshard::log::Level::level, \
                                    ::fmt::format(__VA_ARGS__));                                     \
  } while (false)
#define COSHARD_LOG_TRACE(component, ...) COSHARD_LOG(component, trace, __VA_ARGS__)
#define COSHARD_LOG_DEBUG(component, ...) COSHARD_LOG(component, debug, __VA_ARGS__)
#define COSHARD_LOG_INFO(component, ...) COSHARD_LOG(component, info, __VA_ARGS__)
#define COSHARD_LOG_WARN(component, ...) COSHARD_LOG(component, warn, __VA_ARGS__)
#define COSHARD_LOG_ERROR(component, ...) COSHARD_LOG(component, error, __VA_ARGS__)
