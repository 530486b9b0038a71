#include "coshard/async/task.hpp"

#include <gtest/gtest.h>

#include "support/sanitizers.hpp"

#include <stdexcept>

#include "coshard/async/runtime.hpp"
#include "support/lifetime_counter.hpp"

namespace coshard::async {
namespace {

using coshard::testing::LifetimeCounter;

Task<int> answer(bool& started) {
  started = true;
  co_return 42;
}

TEST(Task, DoesNotStartUntilAwaited) {
  Runtime rt;
  bool started = false;
  Task<int> t = answer(started);
  EXPECT_FALSE(started);
  auto r = rt.block_on(std::move(t));
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(started);
  EXPECT_EQ(*r, 42);
}

Task<int> depth(int n) {
  if (n == 0) co_return 0;
  co_return 1 + co_await depth(n - 1);
}

// Symmetric transfer is a tail call only in optimised builds; sanitizers also keep a shadow stack
// of at most 65,536 frames. There, the chain is shallower and checks correctness only.
#if defined(__OPTIMIZE__) && !defined(COSHARD_TEST_TSAN) && !defined(COSHARD_TEST_ASAN)
constexpr int kChainDepth = 1'000'000;
#else
constexpr int kChainDepth = 1'000;
#endif

TEST(Task, DeepChainsRunWithoutGrowingTheStack) {
  // A million nested awaits (each frame awaiting the next) would need ~100 MiB of stack if each
  // resumption were a nested call; with symmetric transfer they run in constant stack.
  Runtime rt;
  auto r = rt.block_on(depth(kChainDepth));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, kChainDepth);
}

Task<int> throws() {
  throw std::runtime_error("boom");
  co_return 0;
}

Task<int> catches() {
  try {
    co_return co_await throws();
  } catch (const std::runtime_error& e) {
    co_return std::string_view(e.what()) == "boom" ? 7 : -1;
  }
}

TEST(Task, ExceptionIsRethrownAtTheAwait) {
  Runtime rt;
  auto r = rt.block_on(catches());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, 7);
}

TEST(Task, ExceptionBecomesTaskFailedErrorAtTheBoundary) {
  Runtime rt;
  auto r = rt.block_on(throws());
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::task_failed);
  EXPECT_NE(r.error().message().find("boom"), std::string::npos);
}

Task<void> holds(LifetimeCounter) { co_return; }

TEST(Task, DestroyingAnUnstartedTaskFreesItsFrame) {
  LifetimeCounter::reset();
  {
    Task<void> t = holds(LifetimeCounter{});
    EXPECT_EQ(LifetimeCounter::alive(), 1);
  }
  EXPECT_EQ(LifetimeCounter::alive(), 0);
}

Task<Result<int>> may_fail(bool ok) {
  if (!ok) co_return fail(ErrorCode::invalid_argument, "ok=false: expected true");
  co_return 5;
}

Task<Result<int>> propagates(bool ok) {
  COSHARD_CO_TRY_ASSIGN(int v, co_await may_fail(ok));
  co_return v * 2;
}

TEST(Task, ResultErrorsPropagateWithCoTryAndAreNotNested) {
  Runtime rt;
  Result<int> good = rt.block_on(propagates(true));
  ASSERT_TRUE(good.has_value());
  EXPECT_EQ(*good, 10);
  Result<int> bad = rt.block_on(propagates(false));
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(bad.error().message(), "ok=false: expected true");
}

}  // namespace
}  // namespace coshard::async
