#include "coshard/async/when_all.hpp"

#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/async/time.hpp"

namespace coshard::async {
namespace {

using namespace std::chrono_literals;

Task<int> after(std::chrono::milliseconds d, int v, std::vector<int>* order) {
  co_await sleep_for(d);
  if (order) order->push_back(v);
  co_return v;
}

Task<void> nothing() { co_return; }

TEST(WhenAll, TupleGathersValuesAndMapsVoidToMonostate) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<bool> {
    auto [a, b, c] = co_await when_all(after(2ms, 1, nullptr), nothing(), after(1ms, 3, nullptr));
    static_assert(std::is_same_v<decltype(b), std::monostate>);
    co_return a == 1 && c == 3;
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(*r);
}

TEST(WhenAll, ChildrenRunConcurrentlyNotOneAfterAnother) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<std::vector<int>> {
    std::vector<int> order;
    std::vector<Task<int>> tasks;
    tasks.push_back(after(30ms, 1, &order));
    tasks.push_back(after(1ms, 2, &order));
    tasks.push_back(after(15ms, 3, &order));
    auto values = co_await when_all(std::move(tasks));
    EXPECT_EQ(values, (std::vector<int>{1, 2, 3}));  // results in argument order
    co_return order;                                  // completions in time order
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, (std::vector<int>{2, 3, 1}));
}

TEST(WhenAll, AllSynchronousChildrenDoNotSuspendTheParent) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<int> {
    std::vector<Task<void>> tasks;
    for (int i = 0; i < 1000; ++i) tasks.push_back(nothing());
    co_await when_all(std::move(tasks));
    std::vector<Task<int>> none;
    auto empty = co_await when_all(std::move(none));
    co_return static_cast<int>(empty.size());
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, 0);
}

Task<int> throws_after(std::chrono::milliseconds d) {
  co_await sleep_for(d);
  throw std::runtime_error("child failed");
}

TEST(WhenAll, EveryChildFinishesBeforeTheFirstExceptionIsRethrown) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<int> {
    std::vector<int> order;
    try {
      co_await when_all(throws_after(1ms), after(10ms, 9, &order));
    } catch (const std::runtime_error&) {
      co_return static_cast<int>(order.size());
    }
    co_return -1;
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, 1);
}

}  // namespace
}  // namespace coshard::async
