// StreamBudget: permits handed back in stream order. Each stream here is a CPU stream held at a
// gate (a closure that spins until the test opens it), so whether an event has passed is the
// test's decision, never a matter of timing.
#include "coshard/async/stream_budget.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "coshard/async/runtime.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/time.hpp"

namespace coshard::async {
namespace {

using namespace std::chrono_literals;

Stream make_stream() {
  auto s = Stream::create(Device::cpu(), StreamOptions{.name = "budget"});
  EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message());
  return std::move(*s);
}

// An event of `stream` that passes once `gate` opens.
Event event_behind(Stream& stream, const std::atomic<bool>& gate) {
  EXPECT_TRUE(stream.launch([&gate] {
    while (!gate.load()) std::this_thread::sleep_for(50us);
  }));
  auto ev = stream.record();
  EXPECT_TRUE(ev.has_value());
  return std::move(*ev);
}

TEST(StreamBudget, APermitComesBackOnlyOnceItsEventHasPassed) {
  Runtime rt;
  Stream stream = make_stream();
  std::atomic<bool> gate{false};
  auto budget = StreamBudget::create(10);
  auto r = rt.block_on([&]() -> Task<Result<void>> {
    auto permit = budget->semaphore().try_acquire(10);
    EXPECT_TRUE(permit.has_value());
    COSHARD_CO_TRY(budget->release_after(event_behind(stream, gate), std::move(*permit)));
    EXPECT_EQ(budget->pending(), 10u);
    EXPECT_EQ(budget->semaphore().available(), 0u);  // the stream is held: nothing came back
    co_await sleep_for(2ms);  // turns of the reactor in which a wrong early return would show
    EXPECT_EQ(budget->semaphore().available(), 0u);
    EXPECT_FALSE(budget->semaphore().try_acquire(1).has_value());
    gate = true;
    COSHARD_CO_TRY_ASSIGN(auto again, co_await budget->semaphore().acquire(10));  // back once it passed
    EXPECT_EQ(budget->pending(), 0u);
    EXPECT_EQ(again.count(), 10u);
    co_return Result<void>{};
  }());
  ASSERT_TRUE(r) << r.error().message();
  ASSERT_TRUE(stream.synchronize());
}

TEST(StreamBudget, ReturnsComeBackInTheOrderOfTheirEvents) {
  Runtime rt;
  Stream stream = make_stream();
  std::atomic<bool> first_gate{false}, second_gate{false};
  auto budget = StreamBudget::create(10);
  auto r = rt.block_on([&]() -> Task<Result<void>> {
    auto four = budget->semaphore().try_acquire(4);
    auto six = budget->semaphore().try_acquire(6);
    EXPECT_TRUE(four && six);
    COSHARD_CO_TRY(budget->release_after(event_behind(stream, first_gate), std::move(*four)));
    COSHARD_CO_TRY(budget->release_after(event_behind(stream, second_gate), std::move(*six)));
    EXPECT_EQ(budget->pending(), 10u);
    first_gate = true;
    COSHARD_CO_TRY_ASSIGN(auto got, co_await budget->semaphore().acquire(4));
    EXPECT_EQ(budget->pending(), 6u) << "the second return came back before its event passed";
    EXPECT_EQ(budget->semaphore().available(), 0u);
    second_gate = true;
    COSHARD_CO_TRY_ASSIGN(auto rest, co_await budget->semaphore().acquire(6));
    EXPECT_EQ(budget->pending(), 0u);
    co_return Result<void>{};
  }());
  ASSERT_TRUE(r) << r.error().message();
  ASSERT_TRUE(stream.synchronize());
}

TEST(StreamBudget, OutsideARuntimeIsAnErrorAndThePermitGoesBackAtOnce) {
  auto budget = StreamBudget::create(3);
  auto permit = budget->semaphore().try_acquire(3);
  ASSERT_TRUE(permit.has_value());
  auto r = budget->release_after(Event{}, std::move(*permit));
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("outside a coshard Runtime"), std::string::npos) << r.error().message();
  EXPECT_EQ(budget->semaphore().available(), 3u);
  EXPECT_EQ(budget->pending(), 0u);
}

TEST(StreamBudget, OutlivesItsOwnerUntilItsReturnsAreBack) {
  Runtime rt;
  Stream stream = make_stream();
  std::atomic<bool> gate{false};
  std::weak_ptr<StreamBudget> watch;
  auto r = rt.block_on([&]() -> Task<Result<void>> {
    auto budget = StreamBudget::create(8);
    watch = budget;
    auto permit = budget->semaphore().try_acquire(8);
    EXPECT_TRUE(permit.has_value());
    COSHARD_CO_TRY(budget->release_after(event_behind(stream, gate), std::move(*permit)));
    budget.reset();  // the owner is gone; the drain still holds the budget
    co_await sleep_for(2ms);  // turns of the reactor in which a wrong early return would show
    EXPECT_FALSE(watch.expired());
    gate = true;
    // The drain lets go once its return is back (no bound on when: wait for it, not a time).
    while (!watch.expired()) co_await sleep_for(1ms);
    co_return Result<void>{};
  }());
  ASSERT_TRUE(r) << r.error().message();
  ASSERT_TRUE(stream.synchronize());
}

}  // namespace
}  // namespace coshard::async
