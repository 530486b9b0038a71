#include "coshard/async/channel.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/async/time.hpp"
#include "coshard/async/when_all.hpp"

namespace coshard::async {
namespace {

using namespace std::chrono_literals;

TEST(Channel, DeliversEveryValueInOrderThenEndsWhenSendersAreGone) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<std::vector<int>> {
    auto ch = make_channel<int>(3);
    auto [tx, rx] = std::move(*ch);
    auto producer = [](Sender<int> tx) -> Task<void> {
      for (int i = 0; i < 100; ++i) {
        auto ok = co_await tx.send(i);
        if (!ok) co_return;
      }
      // A coroutine's parameters live as long as its frame, and when_all keeps finished children
      // until all are done: drop the Sender now, or the receiver never sees the end.
      { auto done = std::move(tx); }
    };
    std::vector<int> got;
    auto consumer = [&]() -> Task<void> {
      while (auto v = co_await rx.recv()) got.push_back(*v);
    };
    co_await when_all(producer(std::move(tx)), consumer());
    co_return got;
  }());
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ((*r)[static_cast<std::size_t>(i)], i);
}

TEST(Channel, ManyProducersOnOtherRuntimesLoseNothing) {
  Runtime consumer_rt;
  auto ch = make_channel<int>(8);
  ASSERT_TRUE(ch.has_value());
  auto [tx, rx] = std::move(*ch);
  std::vector<std::unique_ptr<Runtime>> producers;
  std::vector<JoinHandle<void>> handles;
  for (int p = 0; p < 3; ++p) {
    producers.push_back(std::make_unique<Runtime>());
    handles.push_back(producers.back()->spawn([](Sender<int> tx, int p) -> Task<void> {
      for (int i = 0; i < 1000; ++i) (void)co_await tx.send(p * 1000 + i);
    }(tx, p)));
  }
  { auto drop = std::move(tx); }
  auto sum = consumer_rt.block_on([](Receiver<int>& rx) -> Task<long> {
    long s = 0;
    long n = 0;
    while (auto v = co_await rx.recv()) {
      s += *v;
      ++n;
    }
    co_return n == 3000 ? s : -1;
  }(rx));
  ASSERT_TRUE(sum.has_value());
  EXPECT_EQ(*sum, 3000L * 2999 / 2);
}

TEST(Channel, SendAfterTheReceiverIsGoneFailsAndHandsTheValueBack) {
  Runtime rt;
  auto r = rt.block_on([]() -> Task<std::string> {
    auto ch = make_channel<std::string>(1);
    auto [tx, rx] = std::move(*ch);
    { auto gone = std::move(rx); }
    auto send = tx.send("precious");
    auto ok = co_await send;
    if (ok) co_return "sent?";
    co_return send.take_unsent().value_or("lost");
  }());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, "precious");
}

TEST(Channel, ZeroCapacityIsRejected) {
  auto ch = make_channel<int>(0);
  ASSERT_FALSE(ch.has_value());
  EXPECT_EQ(ch.error().code(), ErrorCode::invalid_argument);
}

}  // namespace
}  // namespace coshard::async
