// The log: nothing is computed or formatted at a level that is off, levels per component, specs
// refused by name, and each line naming its rank and thread (inherited by a Runtime's reactor and
// a CPU stream's worker).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <mutex>
#include <string>
#include <vector>

#include "coshard/async/log.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/stream.hpp"

namespace {

int g_formatted = 0;  // formatter calls of Costly
int g_computed = 0;   // calls of costly_value()

struct Costly {};
int costly_value() { return ++g_computed; }

}  // namespace

template <>
struct fmt::formatter<Costly> : fmt::formatter<std::string_view> {
  auto format(const Costly&, fmt::format_context& ctx) const {
    ++g_formatted;
    return fmt::formatter<std::string_view>::format("costly", ctx);
  }
};

namespace coshard::log {
namespace {

// Captures the lines for one test and restores stderr and the levels after.
class Captured {
 public:
  Captured() {
    set_sink([this](Level, std::string_view line) {
      std::lock_guard lock(mutex_);
      lines_.emplace_back(line);
    });
  }
  ~Captured() {
    set_sink({});
    (void)configure("");
  }
  std::vector<std::string> lines() {
    std::lock_guard lock(mutex_);
    return lines_;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

TEST(Log, NothingIsComputedOrFormattedAtALevelThatIsOff) {
  Captured captured;
  ASSERT_TRUE(configure("warn"));
  g_formatted = g_computed = 0;
  COSHARD_LOG_DEBUG(zero, "{} {}", Costly{}, costly_value());
  COSHARD_LOG_TRACE(collectives, "{} {}", Costly{}, costly_value());
  COSHARD_LOG_INFO(offload, "{} {}", Costly{}, costly_value());
  EXPECT_EQ(g_formatted, 0);
  EXPECT_EQ(g_computed, 0);
  EXPECT_TRUE(captured.lines().empty());

  ASSERT_TRUE(configure("debug"));
  COSHARD_LOG_DEBUG(zero, "{} {}", Costly{}, costly_value());
  EXPECT_EQ(g_formatted, 1);
  EXPECT_EQ(g_computed, 1);
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find(" D zero [main] costly 1"), std::string::npos) << lines[0];
}

TEST(Log, LevelsArePerComponent) {
  Captured captured;
  ASSERT_TRUE(configure("error,zero=debug,collectives=info"));
  EXPECT_EQ(level(Component::zero), Level::debug);
  EXPECT_EQ(level(Component::collectives), Level::info);
  EXPECT_EQ(level(Component::offload), Level::error);  // the spec's default
  EXPECT_TRUE(enabled(Component::zero, Level::debug));
  EXPECT_FALSE(enabled(Component::zero, Level::trace));
  EXPECT_FALSE(enabled(Component::collectives, Level::debug));
  EXPECT_TRUE(enabled(Component::collectives, Level::warn));
  EXPECT_FALSE(enabled(Component::offload, Level::warn));
  COSHARD_LOG_DEBUG(zero, "zero at debug");
  COSHARD_LOG_DEBUG(collectives, "collectives at debug");
  COSHARD_LOG_INFO(collectives, "collectives at info");
  COSHARD_LOG_WARN(offload, "offload at warn");
  COSHARD_LOG_ERROR(offload, "offload at error");
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_NE(lines[0].find("zero at debug"), std::string::npos);
  EXPECT_NE(lines[1].find(" I collectives [main] collectives at info"), std::string::npos) << lines[1];
  EXPECT_NE(lines[2].find(" E offload [main] offload at error"), std::string::npos) << lines[2];

  // A spec names the whole state: what it leaves out goes back to the default.
  ASSERT_TRUE(configure("zero=trace"));
  EXPECT_EQ(level(Component::zero), Level::trace);
  EXPECT_EQ(level(Component::collectives), kDefaultLevel);
  ASSERT_TRUE(configure(""));
  for (std::size_t c = 0; c < kComponents; ++c) EXPECT_EQ(level(static_cast<Component>(c)), kDefaultLevel);
}

TEST(Log, ABadSpecChangesNothingAndNamesTheItem) {
  ASSERT_TRUE(configure("zero=debug"));
  auto loud = configure("zero=loud");
  ASSERT_FALSE(loud);
  EXPECT_NE(loud.error().message().find("level 'loud' is not one of trace, debug, info, warn, error, off"),
            std::string::npos)
      << loud.error().message();
  auto gpu = configure("info,gpu=debug");
  ASSERT_FALSE(gpu);
  EXPECT_NE(gpu.error().message().find("component 'gpu' is not one of async, collectives"), std::string::npos)
      << gpu.error().message();
  auto empty_item = configure("info,,zero=debug");
  ASSERT_FALSE(empty_item);
  EXPECT_NE(empty_item.error().message().find("an empty item"), std::string::npos) << empty_item.error().message();
  EXPECT_EQ(level(Component::zero), Level::debug);  // unchanged by the refused specs
  EXPECT_EQ(level(Component::trainer), kDefaultLevel);
  ASSERT_TRUE(configure(" info , zero = trace "));  // blanks around items are fine
  EXPECT_EQ(level(Component::zero), Level::trace);
  EXPECT_EQ(level(Component::trainer), Level::info);
  ASSERT_TRUE(configure(""));
}

TEST(Log, EachLineNamesItsRankAndThread) {
  Captured captured;
  ASSERT_TRUE(configure("app=debug"));
  {
    ScopedRank rank(3);
    COSHARD_LOG_DEBUG(app, "from the test thread");
    // Created on a thread of rank 3: the reactor and the stream's worker write as rank 3.
    async::Runtime rt;
    auto stream = async::Stream::create(async::Device::cpu(), {.name = "compute"});
    ASSERT_TRUE(stream);
    ASSERT_TRUE(stream->launch([] { COSHARD_LOG_DEBUG(app, "from the stream"); }));
    ASSERT_TRUE(stream->synchronize());
    rt.block_on([]() -> async::Task<void> {
      COSHARD_LOG_DEBUG(app, "from the reactor");
      co_return;
    }());
  }
  COSHARD_LOG_DEBUG(app, "after the scope");
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_NE(lines[0].find("app [rank 3 main] from the test thread"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("app [rank 3 compute] from the stream"), std::string::npos) << lines[1];
  EXPECT_NE(lines[2].find("app [rank 3 reactor] from the reactor"), std::string::npos) << lines[2];
  EXPECT_NE(lines[3].find("app [main] after the scope"), std::string::npos) << lines[3];
  EXPECT_EQ(thread_rank(), -1);
}

TEST(Log, NamesOfLevelsAndComponents) {
  EXPECT_EQ(to_string(Level::warn), "warn");
  EXPECT_EQ(to_string(Component::collectives), "collectives");
  EXPECT_EQ(to_string(static_cast<Level>(42)), "unknown-level");
}

}  // namespace
}  // namespace coshard::log
