#include "coshard/async/time.hpp"

#include <gtest/gtest.h>

#include "coshard/async/runtime.hpp"

namespace coshard::async {
namespace {

using namespace std::chrono_literals;

TEST(Time, SleepWaitsAtLeastItsDuration) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<std::chrono::nanoseconds> {
    const auto t0 = std::chrono::steady_clock::now();
    co_await sleep_for(5ms);
    co_return std::chrono::steady_clock::now() - t0;
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_GE(*r, 5ms);
}

TEST(Time, TimeoutReturnsTheResultWhenTheTaskWins) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<Result<int>> {
    co_return co_await timeout(1s, []() -> Task<int> {
      co_await sleep_for(1ms);
      co_return 3;
    }());
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, 3);
}

TEST(Time, TimeoutFailsWithTimeoutWhenTheTaskIsTooSlow) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<Result<int>> {
    co_return co_await timeout(2ms, []() -> Task<int> {
      co_await sleep_for(10s);
      co_return 3;
    }());
  }());
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::timeout);
  EXPECT_NE(r.error().message().find("2 ms"), std::string::npos);
}

}  // namespace
}  // namespace coshard::async
