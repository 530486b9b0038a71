#include "coshard/async/semaphore.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/async/time.hpp"
#include "coshard/async/when_all.hpp"

namespace coshard::async {
namespace {

using namespace std::chrono_literals;

TEST(Semaphore, NeverOverAdmitsUnderContention) {
  // 400 tasks on two runtimes (two reactor threads) take random byte counts from a 1000-byte
  // budget, hold them across a yield, and release them; the sum held never passes the capacity.
  constexpr std::size_t kCapacity = 1000;
  Semaphore budget(kCapacity);
  std::atomic<long> held{0};
  std::atomic<long> peak{0};
  std::atomic<int> failures{0};

  auto worker = [&](int seed) -> Task<void> {
    std::mt19937 rng(seed);
    for (int i = 0; i < 20; ++i) {
      const std::size_t n = 1 + rng() % kCapacity;
      auto permit = co_await budget.acquire(n);
      if (!permit) {
        failures.fetch_add(1);
        co_return;
      }
      const long now = held.fetch_add(static_cast<long>(n)) + static_cast<long>(n);
      long p = peak.load();
      while (now > p && !peak.compare_exchange_weak(p, now)) {}
      co_await sleep_for(std::chrono::microseconds(rng() % 200));
      held.fetch_sub(static_cast<long>(n));
    }
  };

  Runtime a, b;
  std::vector<JoinHandle<void>> ha, hb;
  for (int i = 0; i < 200; ++i) {
    ha.push_back(a.spawn(worker(i)));
    hb.push_back(b.spawn(worker(1000 + i)));
  }
  for (auto& h : ha) ASSERT_TRUE(a.block_on([](JoinHandle<void>& h) -> Task<Result<void>> { co_return co_await h; }(h)));
  for (auto& h : hb) ASSERT_TRUE(b.block_on([](JoinHandle<void>& h) -> Task<Result<void>> { co_return co_await h; }(h)));

  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(peak.load(), static_cast<long>(kCapacity));
  EXPECT_GT(peak.load(), 0);
  EXPECT_EQ(budget.available(), kCapacity);
}

TEST(Semaphore, LargeRequestIsNotStarvedBySmallOnes) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<std::vector<int>> {
    Semaphore sem(10);
    std::vector<int> order;
    auto first = co_await sem.acquire(6);  // 4 left
    auto big = [&]() -> Task<void> {
      auto p = co_await sem.acquire(10);  // needs everything
      order.push_back(10);
    };
    auto small = [&](int id) -> Task<void> {
      auto p = co_await sem.acquire(1);  // would fit right now, but must queue behind `big`
      order.push_back(id);
    };
    auto releaser = [&]() -> Task<void> {
      co_await sleep_for(2ms);
      first->release();
    };
    co_await when_all(big(), small(1), small(2), releaser());
    co_return order;
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, (std::vector<int>{10, 1, 2}));
}

TEST(Semaphore, RequestAboveCapacityFailsAtOnceWithAClearError) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<Result<Semaphore::Permit>> {
    Semaphore sem(100);
    co_return co_await sem.acquire(101);
  }());
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::invalid_argument);
  EXPECT_NE(r.error().message().find("n=101"), std::string::npos);
  EXPECT_NE(r.error().message().find("(100)"), std::string::npos);
}

TEST(Semaphore, CloseFailsWaitersWithClosed) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<ErrorCode> {
    Semaphore sem(1);
    auto held = sem.try_acquire();
    ErrorCode code = ErrorCode::internal;
    auto waiter = [&]() -> Task<void> {
      auto p = co_await sem.acquire();
      if (!p) code = p.error().code();
    };
    auto closer = [&]() -> Task<void> {
      co_await sleep_for(1ms);
      sem.close();
    };
    co_await when_all(waiter(), closer());
    co_return code;
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, ErrorCode::closed);
}

TEST(Semaphore, TryAcquireDoesNotBargePastWaiters) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<bool> {
    Semaphore sem(2);
    auto a = sem.try_acquire(2);
    bool barged = true;
    auto waiter = [&]() -> Task<void> { auto p = co_await sem.acquire(2); };
    auto check = [&]() -> Task<void> {
      co_await sleep_for(1ms);
      a->release();  // the 2 permits go to the waiter, not to try_acquire
      barged = sem.try_acquire(1).has_value();
    };
    co_await when_all(waiter(), check());
    co_return barged;
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(*r);
}

}  // namespace
}  // namespace coshard::async
