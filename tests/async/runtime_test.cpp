#include "coshard/async/runtime.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "coshard/async/channel.hpp"
#include "coshard/async/semaphore.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/time.hpp"
#include "support/lifetime_counter.hpp"

namespace coshard::async {
namespace {

using namespace std::chrono_literals;
using coshard::testing::LifetimeCounter;

Task<int> value(int v) { co_return v; }

TEST(Runtime, BlockOnRunsTheTaskOnTheReactorThread) {
  Runtime rt;
  auto r = rt.block_on([](Runtime* expected) -> Task<bool> { co_return Runtime::current() == expected; }(&rt));
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(*r);
  EXPECT_EQ(Runtime::current(), nullptr);
}

// A coroutine's by-value parameters live in its frame until the frame goes. block_on must not
// hand back the result before then: the caller may destroy what they refer to at once.
struct SlowToDestroy {
  std::atomic<bool>* destroyed;
  explicit SlowToDestroy(std::atomic<bool>* d) : destroyed(d) {}
  SlowToDestroy(SlowToDestroy&& o) noexcept : destroyed(std::exchange(o.destroyed, nullptr)) {}
  ~SlowToDestroy() {
    if (!destroyed) return;
    std::this_thread::sleep_for(20ms);
    destroyed->store(true);
  }
};

Task<int> takes_by_value(SlowToDestroy guard) {
  (void)guard;
  co_return 7;
}

TEST(Runtime, BlockOnReturnsOnlyAfterTheTasksParametersAreDestroyed) {
  Runtime rt;
  for (int i = 0; i < 3; ++i) {
    std::atomic<bool> destroyed{false};
    auto r = rt.block_on(takes_by_value(SlowToDestroy(&destroyed)));
    ASSERT_TRUE(r);
    EXPECT_EQ(*r, 7);
    EXPECT_TRUE(destroyed.load()) << "block_on returned while the task's frame still held its parameters";
  }
}

TEST(Runtime, HundredThousandSpawnedTasksAreAllJoined) {
  Runtime rt;
  constexpr int kTasks = 100'000;
  auto r = rt.block_on([](Runtime& rt) -> Task<long> {
    std::vector<JoinHandle<int>> handles;
    handles.reserve(kTasks);
    for (int i = 0; i < kTasks; ++i) handles.push_back(rt.spawn(value(i)));
    long sum = 0;
    for (auto& h : handles) {
      auto v = co_await h;
      if (!v) co_return -1;
      sum += *v;
    }
    co_return sum;
  }(rt));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, static_cast<long>(kTasks) * (kTasks - 1) / 2);
  EXPECT_EQ(rt.live_tasks(), 0u);
}

TEST(Runtime, SpawnFromManyThreadsIsSafe) {
  Runtime rt;
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  std::vector<std::vector<JoinHandle<void>>> handles(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        handles[t].push_back(rt.spawn([](std::atomic<int>& c) -> Task<void> {
          c.fetch_add(1, std::memory_order_relaxed);
          co_return;
        }(ran)));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& hs : handles)
    for (auto& h : hs) {
      auto done = rt.block_on([](JoinHandle<void>& h) -> Task<Result<void>> { co_return co_await h; }(h));
      ASSERT_TRUE(done.has_value());
    }
  EXPECT_EQ(ran.load(), 8000);
}

TEST(Runtime, JoinHandleSurfacesTheTasksError) {
  Runtime rt;
  auto r = rt.block_on([](Runtime& rt) -> Task<Result<int>> {
    auto h = rt.spawn([]() -> Task<Result<int>> { co_return fail(ErrorCode::io, "disk on fire"); }());
    co_return co_await h;
  }(rt));
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::io);
  EXPECT_EQ(r.error().message(), "disk on fire");
}

TEST(Runtime, DetachedTaskRunsToCompletion) {
  Runtime rt;
  std::atomic<bool> ran{false};
  rt.spawn([](std::atomic<bool>& ran) -> Task<void> {
      co_await sleep_for(1ms);
      ran = true;
    }(ran)).detach();
  auto r = rt.block_on([](std::atomic<bool>& ran) -> Task<bool> {
    for (int i = 0; i < 5000 && !ran; ++i) co_await sleep_for(1ms);
    co_return ran.load();
  }(ran));
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(*r);
}

TEST(Runtime, BlockOnFromTheReactorThreadIsRefusedNotDeadlocked) {
  Runtime rt;
  auto r = rt.block_on([](Runtime& rt) -> Task<ErrorCode> {
    auto inner = rt.block_on(value(1));
    co_return inner ? ErrorCode::internal : inner.error().code();
  }(rt));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, ErrorCode::invalid_argument);
}

TEST(Runtime, SpawnBlockingRunsOffTheReactorAndResumesOnIt) {
  Runtime rt;
  auto r = rt.block_on([](Runtime& rt) -> Task<Result<bool>> {
    auto reactor = std::this_thread::get_id();
    auto off = co_await rt.spawn_blocking([reactor] { return std::this_thread::get_id() != reactor; });
    if (!off) co_return fail(off.error());
    co_return *off && Runtime::current() == &rt;
  }(rt));
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(*r);
}

TEST(Runtime, SpawnBlockingReportsAnExceptionAsAnError) {
  Runtime rt;
  auto r = rt.block_on([](Runtime& rt) -> Task<Result<int>> {
    co_return co_await rt.spawn_blocking([]() -> int { throw std::runtime_error("bad block"); });
  }(rt));
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::task_failed);
}

Task<void> wait_forever(Semaphore& never, LifetimeCounter) {
  auto p = co_await never.acquire(1);
  (void)p;
}

TEST(Runtime, ShutdownWithPendingWorkNeitherHangsNorLeaks) {
  LifetimeCounter::reset();
  Semaphore never(0 + 1);
  auto held = never.try_acquire(1);  // nobody will ever release: the waiters hang forever
  ASSERT_TRUE(held.has_value());
  JoinHandle<void> kept;
  {
    Runtime rt;
    for (int i = 0; i < 100; ++i) rt.spawn(wait_forever(never, LifetimeCounter{})).detach();
    kept = rt.spawn(wait_forever(never, LifetimeCounter{}));
    rt.spawn([]() -> Task<void> { co_await sleep_for(std::chrono::hours(1)); }()).detach();
    // Let them all reach their waits.
    auto ok = rt.block_on([](Semaphore& s) -> Task<bool> {
      for (int i = 0; i < 1000 && s.waiters() < 101; ++i) co_await sleep_for(1ms);
      co_return s.waiters() == 101;
    }(never));
    ASSERT_TRUE(ok.has_value() && *ok);
    EXPECT_EQ(LifetimeCounter::alive(), 101);
  }  // ~Runtime: stops the reactor and destroys the 102 pending frames
  EXPECT_EQ(LifetimeCounter::alive(), 0);
  EXPECT_EQ(never.waiters(), 0u);
  ASSERT_TRUE(kept.done());
  // The handle of a destroyed task reports the shutdown (awaiting is no longer possible, so read
  // the state directly).
  auto r = kept.state()->take();
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::shutdown);
}

TEST(Runtime, ShutdownUnlinksTasksWaitingOnEventsChannelsAndTimers) {
  // Tasks wait on an event of a stuck stream, on a channel and on a timer when the runtime is
  // destroyed. The stream is released only afterwards: its event then completes with no waiter
  // left to wake (a stale one would be a use-after-free, which ASan reports).
  LifetimeCounter::reset();
  std::atomic<bool> release{false};
  auto stream = Stream::create(Device::cpu(), {.name = "stuck"});
  ASSERT_TRUE(stream.has_value());
  // Whatever happens below, unstick the stream before it is destroyed (it drains its queue).
  struct Unstick {
    std::atomic<bool>& flag;
    ~Unstick() { flag = true; }
  } unstick{release};
  ASSERT_TRUE(stream->launch([&release] {
    while (!release.load()) std::this_thread::sleep_for(100us);
  }));
  Event stuck = *stream->record();
  auto ch = make_channel<int>(1);
  ASSERT_TRUE(ch.has_value());
  auto [tx, rx] = std::move(*ch);
  {
    Runtime rt;
    for (int i = 0; i < 10; ++i) {
      rt.spawn([](Event e, LifetimeCounter) -> Task<void> { (void)co_await e; }(stuck, LifetimeCounter{})).detach();
    }
    rt.spawn([](Receiver<int>& rx, LifetimeCounter) -> Task<void> { (void)co_await rx.recv(); }(rx, LifetimeCounter{})).detach();
    rt.spawn([](LifetimeCounter) -> Task<void> { co_await sleep_for(std::chrono::hours(1)); }(LifetimeCounter{})).detach();
    auto settled = rt.block_on([](Runtime& rt) -> Task<bool> {
      co_await sleep_for(5ms);  // let them all reach their waits
      co_return rt.live_tasks() == 12 + 1;  // + this task
    }(rt));
    ASSERT_TRUE(settled.has_value() && *settled);
  }
  EXPECT_EQ(LifetimeCounter::alive(), 0);
  release = true;
  ASSERT_TRUE(stream->synchronize());
  int v = 1;
  EXPECT_TRUE(tx.try_send(v).has_value()) << "the channel outlives the runtime and still works";
}

TEST(Runtime, AJoinHandleAwaitedFromAnotherRuntimeResumesThere) {
  Runtime producer;
  Runtime consumer;
  JoinHandle<int> handle = producer.spawn([]() -> Task<int> {
    co_await sleep_for(2ms);
    co_return 11;
  }());
  auto r = consumer.block_on([](JoinHandle<int>& h, Runtime* self) -> Task<Result<bool>> {
    auto v = co_await h;
    if (!v) co_return fail(v.error());
    co_return *v == 11 && Runtime::current() == self;
  }(handle, &consumer));
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(*r);
}

}  // namespace
}  // namespace coshard::async
