// The log's levels, its spdlog logger and the per-thread context. The rules are at the top of
// coshard/async/log.hpp.
#include "coshard/async/log.hpp"

#include "coshard/async/json_limits.hpp"

#include <spdlog/logger.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace coshard::log {

namespace detail {
// Constant-initialised (before any static constructor can log). One entry per component.
constexpr auto kDefault = static_cast<std::uint8_t>(kDefaultLevel);
static_assert(kComponents == 7);
std::array<std::atomic<std::uint8_t>, kComponents> g_levels{{{kDefault}, {kDefault}, {kDefault}, {kDefault},
                                                             {kDefault}, {kDefault}, {kDefault}}};
}  // namespace detail

namespace {

constexpr std::array<std::string_view, 6> kLevelNames{"trace", "debug", "info", "warn", "error", "off"};
constexpr std::array<std::string_view, kComponents> kComponentNames{"async",   "collectives", "offload", "modules",
                                                                     "zero",    "trainer",     "app"};

struct ThreadContext {
  int rank = -1;
  std::array<char, 32> name{};  // empty: "main"
};
thread_local ThreadContext t_context;

spdlog::level::level_enum to_spdlog(Level level) noexcept {
  switch (level) {
    case Level::trace: return spdlog::level::trace;
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::off;
}

Level from_spdlog(spdlog::level::level_enum level) noexcept {
  switch (level) {
    case spdlog::level::trace: return Level::trace;
    case spdlog::level::debug: return Level::debug;
    case spdlog::level::info: return Level::info;
    case spdlog::level::warn: return Level::warn;
    case spdlog::level::err:
    case spdlog::level::critical: return Level::error;
    default: return Level::off;
  }
}

// Formats with spdlog's pattern, then writes to stderr or hands the line to the user's sink.
// base_sink serialises sink_it_ with its mutex, so the user's sink is called one line at a time.
class LineSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  void set(Sink sink) {
    std::lock_guard lock(mutex_);
    sink_ = std::move(sink);
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    if (sink_) {
      std::string_view line(formatted.data(), formatted.size());
      if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
      sink_(from_spdlog(msg.level), line);
      return;
    }
    std::fwrite(formatted.data(), 1, formatted.size(), stderr);
  }
  void flush_() override { std::fflush(stderr); }

 private:
  Sink sink_;
};

struct Logger {
  std::shared_ptr<LineSink> sink = std::make_shared<LineSink>();
  spdlog::logger logger{"coshard", sink};
  Logger() {
    logger.set_pattern("%Y-%m-%d %H:%M:%S.%e %L %v");
    logger.set_level(spdlog::level::trace);  // the levels are coshard's, checked before this
    logger.flush_on(spdlog::level::warn);
  }
};

Logger& logger() {
  static Logger instance;  // never destroyed before a thread that still logs: see below
  return instance;
}

Result<Level> parse_level(std::string_view text, std::string_view item) {
  for (std::size_t i = 0; i < kLevelNames.size(); ++i) {
    if (kLevelNames[i] == text) return static_cast<Level>(i);
  }
  return fail(ErrorCode::invalid_argument, "COSHARD_LOG / --log-level item '", async::bounded_echo(item), "': level '",
              async::bounded_echo(text), "' is not one of trace, debug, info, warn, error, off");
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Read once at start-up; a bad value is reported and ignored (the levels stay at the default).
[[maybe_unused]] const bool g_env_read = [] {
  if (auto ok = configure_from_env(); !ok) std::fprintf(stderr, "coshard: %s (ignored)\n", ok.error().message().c_str());
  return true;
}();

}  // namespace

std::string_view to_string(Level level) noexcept {
  const auto i = static_cast<std::size_t>(level);
  return i < kLevelNames.size() ? kLevelNames[i] : "unknown-level";
}

std::string_view to_string(Component component) noexcept {
  const auto i = static_cast<std::size_t>(component);
  return i < kComponentNames.size() ? kComponentNames[i] : "unknown-component";
}

Result<void> configure(std::string_view spec) {
  Level fallback = kDefaultLevel;
  std::array<std::optional<Level>, kComponents> chosen{};
  std::string_view rest = spec;
  bool any = false;
  while (!rest.empty() || !any) {
    const auto comma = rest.find(',');
    const std::string_view item = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    any = true;
    if (item.empty()) {
      if (spec.empty() || trim(spec).empty()) break;
      return fail(ErrorCode::invalid_argument, "COSHARD_LOG / --log-level '", spec,
                  "': an empty item (expected level or component=level, separated by commas)");
    }
    const auto eq = item.find('=');
    if (eq == std::string_view::npos) {
      auto level = parse_level(item, item);
      if (!level) return fail(std::move(level).error());
      fallback = *level;
      continue;
    }
    const std::string_view name = trim(item.substr(0, eq));
    const auto it = std::find(kComponentNames.begin(), kComponentNames.end(), name);
    if (it == kComponentNames.end()) {
      return fail(ErrorCode::invalid_argument, "COSHARD_LOG / --log-level item '", async::bounded_echo(item),
                  "': component '", async::bounded_echo(name), "' is not one of async, collectives, offload, modules, zero, "
                  "trainer, app");
    }
    auto level = parse_level(trim(item.substr(eq + 1)), item);
    if (!level) return fail(std::move(level).error());
    chosen[static_cast<std::size_t>(it - kComponentNames.begin())] = *level;
  }
  for (std::size_t i = 0; i < kComponents; ++i) set_level(static_cast<Component>(i), chosen[i].value_or(fallback));
  return {};
}

Result<void> configure_from_env() {
  const char* value = std::getenv("COSHARD_LOG");
  return configure(value == nullptr ? std::string_view{} : std::string_view(value));
}

void set_level(Component component, Level level) noexcept {
  detail::g_levels[static_cast<std::size_t>(component)].store(static_cast<std::uint8_t>(level),
                                                              std::memory_order_relaxed);
}

Level level(Component component) noexcept {
  return static_cast<Level>(detail::g_levels[static_cast<std::size_t>(component)].load(std::memory_order_relaxed));
}

void set_sink(Sink sink) { logger().sink->set(std::move(sink)); }

void set_thread_rank(int rank) noexcept { t_context.rank = rank < 0 ? -1 : rank; }
int thread_rank() noexcept { return t_context.rank; }

void set_thread_name(std::string_view name) {
  const std::size_t n = std::min(name.size(), t_context.name.size() - 1);
  std::copy_n(name.data(), n, t_context.name.data());
  t_context.name[n] = '\0';
}

std::string_view thread_name() noexcept {
  return t_context.name[0] == '\0' ? std::string_view("main") : std::string_view(t_context.name.data());
}

void detail::write(Component component, Level level, std::string_view message) {
  fmt::memory_buffer line;
  if (t_context.rank >= 0) {
    fmt::format_to(std::back_inserter(line), "{} [rank {} {}] {}", to_string(component), t_context.rank,
                   thread_name(), message);
  } else {
    fmt::format_to(std::back_inserter(line), "{} [{}] {}", to_string(component), thread_name(), message);
  }
  logger().logger.log(to_spdlog(level), spdlog::string_view_t(line.data(), line.size()));
}

}  // namespace coshard::log
