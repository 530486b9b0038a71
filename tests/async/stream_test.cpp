#include "coshard/async/stream.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "coshard/async/memory.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/sync.hpp"
#include "coshard/async/when_all.hpp"
#include "stream_impl.hpp"  // (private: CpuStreamDrain)

namespace coshard::async {
namespace {

using namespace std::chrono_literals;

Stream make_stream(Device d, const char* name) {
  auto s = Stream::create(d, StreamOptions{.name = name});
  EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message());
  return std::move(*s);
}

TEST(CpuStream, RunsClosuresInFifoOrder) {
  Stream s = make_stream(Device::cpu(), "fifo");
  std::vector<int> seen;  // touched by the worker only, read after synchronize
  for (int i = 0; i < 10'000; ++i) ASSERT_TRUE(s.launch([&seen, i] { seen.push_back(i); }));
  ASSERT_TRUE(s.synchronize());
  ASSERT_EQ(seen.size(), 10'000u);
  for (int i = 0; i < 10'000; ++i) ASSERT_EQ(seen[static_cast<std::size_t>(i)], i);
}

// Timed events measure what the stream did between them, compare across CPU streams, and are
// read after the fact: an event not yet passed is an error, never a wait.
TEST(CpuStream, TimedEventsMeasureTheWorkBetweenThem) {
  Stream s = make_stream(Device::cpu(), "timed");
  Stream other = make_stream(Device::cpu(), "other");
  auto start = s.record_timed();
  ASSERT_TRUE(start);
  ASSERT_TRUE(s.launch([] { std::this_thread::sleep_for(20ms); }));
  auto end = s.record_timed();
  ASSERT_TRUE(end);
  auto plain = s.record();
  ASSERT_TRUE(plain);
  ASSERT_TRUE(s.synchronize());
  EXPECT_TRUE(start->timed());
  EXPECT_FALSE(plain->timed());
  auto ms = end->elapsed_ms_since(*start);
  ASSERT_TRUE(ms) << ms.error().message();
  EXPECT_GE(*ms, 19.0);
  EXPECT_LT(*ms, 5000.0);
  auto back = start->elapsed_ms_since(*end);
  ASSERT_TRUE(back);
  EXPECT_DOUBLE_EQ(*back, -*ms);

  auto not_timed = plain->elapsed_ms_since(*start);
  ASSERT_FALSE(not_timed);
  EXPECT_NE(not_timed.error().message().find("not timed"), std::string::npos);

  // Another CPU stream shares the clock.
  auto later = other.record_timed();
  ASSERT_TRUE(later);
  ASSERT_TRUE(other.synchronize());
  auto across = later->elapsed_ms_since(*end);
  ASSERT_TRUE(across) << across.error().message();
  EXPECT_GE(*across, 0.0);

  // Not passed yet: refused at once.
  std::atomic<bool> go{false};
  ASSERT_TRUE(s.launch([&go] {
    while (!go.load()) std::this_thread::sleep_for(1ms);
  }));
  auto pending = s.record_timed();
  ASSERT_TRUE(pending);
  const auto waits_before = blocking_waits();
  auto early = pending->elapsed_ms_since(*start);
  EXPECT_EQ(blocking_waits(), waits_before);
  ASSERT_FALSE(early);
  EXPECT_NE(early.error().message().find("has not passed yet"), std::string::npos);
  go = true;
  ASSERT_TRUE(s.synchronize());
  EXPECT_TRUE(pending->elapsed_ms_since(*start));
}

TEST(CpuStream, EventsOrderWorkAcrossStreamsWithoutTheHost) {
  Stream producer = make_stream(Device::cpu(), "producer");
  Stream consumer = make_stream(Device::cpu(), "consumer");
  std::mt19937 rng(7);
  constexpr int kRounds = 200;
  std::vector<int> data(kRounds, 0);
  std::vector<int> observed(kRounds, -1);
  const auto waits_before = blocking_waits();
  for (int i = 0; i < kRounds; ++i) {
    const auto delay = std::chrono::microseconds(rng() % 300);
    ASSERT_TRUE(producer.launch([&data, i, delay] {
      std::this_thread::sleep_for(delay);
      data[static_cast<std::size_t>(i)] = i + 1;
    }));
    auto e = producer.record();
    ASSERT_TRUE(e.has_value());
    ASSERT_TRUE(consumer.wait(*e));
    ASSERT_TRUE(consumer.launch([&data, &observed, i] { observed[static_cast<std::size_t>(i)] = data[static_cast<std::size_t>(i)]; }));
  }
  EXPECT_EQ(blocking_waits(), waits_before) << "enqueueing must not block the host";
  ASSERT_TRUE(consumer.synchronize());
  for (int i = 0; i < kRounds; ++i) EXPECT_EQ(observed[static_cast<std::size_t>(i)], i + 1) << "round " << i;
}

TEST(CpuStream, ManyCoroutinesAwaitingOneEventAllResumeAfterIt) {
  Runtime rt;
  Stream s = make_stream(Device::cpu(), "gate");
  std::atomic<bool> passed{false};
  ASSERT_TRUE(s.launch([&] {
    std::this_thread::sleep_for(20ms);
    passed = true;
  }));
  Event gate = *s.record();
  const auto waits_before = blocking_waits();
  auto r = rt.block_on([](Event gate, std::atomic<bool>& passed) -> Task<int> {
    std::vector<Task<bool>> waiters;
    for (int i = 0; i < 1000; ++i) {
      waiters.push_back([](Event e, std::atomic<bool>& passed) -> Task<bool> {
        auto ok = co_await e;
        co_return ok.has_value() && passed.load();
      }(gate, passed));
    }
    auto results = co_await when_all(std::move(waiters));
    int good = 0;
    for (bool b : results) good += b;
    co_return good;
  }(gate, passed));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, 1000);
  EXPECT_EQ(blocking_waits(), waits_before) << "co_await on an event must not block the host";
}

TEST(CpuStream, AwaitingEventsOfManyStreamsFromManyCoroutines) {
  Runtime rt;
  std::vector<Stream> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(make_stream(Device::cpu(), "s"));
  auto r = rt.block_on([](std::vector<Stream>& streams) -> Task<long> {
    std::atomic<long> total{0};
    std::vector<Task<void>> tasks;
    for (int t = 0; t < 64; ++t) {
      tasks.push_back([](Stream& s, std::atomic<long>& total, int t) -> Task<void> {
        for (int k = 0; k < 50; ++k) {
          (void)s.launch([&total, t] { total.fetch_add(t, std::memory_order_relaxed); });
          auto e = s.record();
          (void)co_await *e;
        }
      }(streams[static_cast<std::size_t>(t % 4)], total, t));
    }
    co_await when_all(std::move(tasks));
    co_return total.load();
  }(streams));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, 50L * (63 * 64 / 2));
}

TEST(CpuStream, AThrowingClosureFailsTheStreamAndItsLaterEvents) {
  Runtime rt;
  Stream a = make_stream(Device::cpu(), "a");
  Stream b = make_stream(Device::cpu(), "b");
  std::atomic<bool> ran_after{false};
  ASSERT_TRUE(a.launch([] { throw std::runtime_error("kernel fault"); }));
  ASSERT_TRUE(a.launch([&] { ran_after = true; }));
  Event after = *a.record();
  ASSERT_TRUE(b.wait(after));
  Event b_after = *b.record();
  auto r = rt.block_on([](Event a, Event b) -> Task<std::pair<std::string, std::string>> {
    auto ra = co_await a;
    auto rb = co_await b;
    co_return std::pair{ra ? "" : ra.error().message(), rb ? "" : rb.error().message()};
  }(after, b_after));
  ASSERT_TRUE(r.has_value());
  EXPECT_NE(r->first.find("kernel fault"), std::string::npos) << r->first;
  EXPECT_NE(r->second.find("failed stream"), std::string::npos) << r->second;
  EXPECT_FALSE(ran_after.load());
}

TEST(Event, UnrecordedEventCountsAsPassed) {
  Event e;
  EXPECT_FALSE(e.recorded());
  EXPECT_TRUE(e.ready());
  EXPECT_TRUE(e.synchronize());
}

TEST(SyncAccounting, SynchronizeIsCountedAndRefusedInStrictMode) {
  Stream s = make_stream(Device::cpu(), "sync");
  const auto before = blocking_waits();
  ASSERT_TRUE(s.synchronize());
  EXPECT_EQ(blocking_waits(), before + 1);
  {
    StrictSyncScope strict;
    auto r = s.synchronize();
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(r.error().code(), ErrorCode::strict_sync);
    EXPECT_NE(r.error().message().find("Stream::synchronize"), std::string::npos);
    auto e = s.record();
    auto re = e->synchronize();
    ASSERT_FALSE(re.has_value());
    EXPECT_EQ(re.error().code(), ErrorCode::strict_sync);
  }
  EXPECT_FALSE(strict_sync());
  ASSERT_TRUE(s.synchronize());
}

TEST(SyncAccounting, AwaitingAndStreamWaitsAreNotHostSyncsAndWorkInStrictMode) {
  Runtime rt;
  Stream a = make_stream(Device::cpu(), "a");
  Stream b = make_stream(Device::cpu(), "b");
  StrictSyncScope strict;
  const auto before = blocking_waits();
  auto r = rt.block_on([](Stream& a, Stream& b) -> Task<Result<void>> {
    for (int i = 0; i < 100; ++i) {
      COSHARD_CO_TRY(a.launch([] {}));
      COSHARD_CO_TRY_ASSIGN(Event e, a.record());
      COSHARD_CO_TRY(b.wait(e));
      COSHARD_CO_TRY_ASSIGN(Event f, b.record());
      COSHARD_CO_TRY(co_await f);
    }
    co_return Result<void>{};
  }(a, b));
  EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message());
  EXPECT_EQ(blocking_waits(), before);
}

TEST(CudaStream, CreationWithoutADeviceFailsWithAClearError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  auto s = Stream::create(Device::cuda(0));
  ASSERT_FALSE(s.has_value());
  EXPECT_EQ(s.error().code(), cuda_compiled() ? ErrorCode::device : ErrorCode::unsupported);
  EXPECT_NE(s.error().message().find("cuda:0"), std::string::npos) << s.error().message();
}

// ---- CUDA variants: run where a GPU is, skip elsewhere ----------------------------------------

#define COSHARD_REQUIRE_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"

TEST(CudaStream, HostFunctionsRunInFifoOrder) {
  COSHARD_REQUIRE_GPU();
  Stream s = make_stream(Device::cuda(0), "fifo");
  std::vector<int> seen;
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(s.launch([&seen, i] { seen.push_back(i); }));
  ASSERT_TRUE(s.synchronize());
  ASSERT_EQ(seen.size(), 1000u);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(seen[static_cast<std::size_t>(i)], i);
}

TEST(CudaStream, TimedEventsMeasureACopy) {
  COSHARD_REQUIRE_GPU();
  Stream s = make_stream(Device::cuda(0), "timed");
  auto alloc = CachingAllocator::create(Device::cuda(0));
  ASSERT_TRUE(alloc.has_value()) << alloc.error().message();
  constexpr std::size_t kBytes = 256 << 20;
  auto block = (*alloc)->allocate(2 * kBytes, s);
  ASSERT_TRUE(block.has_value()) << block.error().message();
  auto* base = static_cast<std::byte*>(block->data());
  auto start = s.record_timed();
  ASSERT_TRUE(start);
  ASSERT_TRUE(s.copy(base + kBytes, base, kBytes));
  auto end = s.record_timed();
  ASSERT_TRUE(end);
  ASSERT_TRUE(s.synchronize());
  auto ms = end->elapsed_ms_since(*start);
  ASSERT_TRUE(ms) << ms.error().message();
  EXPECT_GT(*ms, 0.0);
  EXPECT_LT(*ms, 1000.0);  // 256 MiB device-to-device: well under a second on any GPU
  EXPECT_FALSE(s.record()->elapsed_ms_since(*start));  // not timed
}

TEST(CudaStream, CopiesAreOrderedAcrossStreamsByEvents) {
  COSHARD_REQUIRE_GPU();
  Runtime rt;
  Stream a = make_stream(Device::cuda(0), "a");
  Stream b = make_stream(Device::cuda(0), "b");
  constexpr std::size_t kBytes = 64 << 20;
  std::vector<std::uint8_t> host_in(kBytes, 0x5A), host_out(kBytes, 0);
  auto alloc = CachingAllocator::create(Device::cuda(0));
  ASSERT_TRUE(alloc.has_value()) << alloc.error().message();
  auto block = (*alloc)->allocate(kBytes, a);
  ASSERT_TRUE(block.has_value()) << block.error().message();
  void* dev = block->data();
  ASSERT_TRUE(a.copy(dev, host_in.data(), kBytes));
  Event copied = *a.record();
  ASSERT_TRUE(b.wait(copied));
  ASSERT_TRUE(b.copy(host_out.data(), dev, kBytes));
  Event back = *b.record();
  const auto before = blocking_waits();
  auto r = rt.block_on([](Event e) -> Task<Result<void>> { co_return co_await e; }(back));
  EXPECT_EQ(blocking_waits(), before);
  ASSERT_TRUE(r.has_value()) << r.error().message();
  EXPECT_EQ(host_out, host_in);
  block->record_use(back);
}

}  // namespace
}  // namespace coshard::async

namespace coshard::async {
namespace {

TEST(CpuStream, AFailedFallibleClosureKeepsItsErrorCodeOnLaterEvents) {
  Runtime rt;
  auto s = Stream::create(Device::cpu(), {.name = "fallible"});
  ASSERT_TRUE(s.has_value());
  bool ran_after = false;
  ASSERT_TRUE(s->launch_fallible([]() -> Result<void> { return fail(ErrorCode::timeout, "peer 3 is gone"); }));
  ASSERT_TRUE(s->launch([&] { ran_after = true; }));
  Event e = *s->record();
  auto r = rt.block_on([](Event e) -> Task<Result<void>> { co_return co_await e; }(e));
  ASSERT_FALSE(r.has_value());  // block_on flattens Task<Result<void>> to Result<void>
  EXPECT_EQ(r.error().code(), ErrorCode::timeout);
  EXPECT_EQ(r.error().message(), "CPU stream 'fallible': peer 3 is gone");
  ASSERT_FALSE(s->synchronize().has_value());
  EXPECT_FALSE(ran_after);
}

}  // namespace
}  // namespace coshard::async

// synchronize's way without an event (out of memory at teardown): drain waits, allocating
// nothing, for everything enqueued before it, a slow closure and a copy behind it included.
TEST(CpuStreamDrain, WaitsForEverythingEnqueuedBefore) {
  auto stream = coshard::async::detail::make_cpu_stream({.name = "drained"});
  std::atomic<bool> ran{false};
  int source = 7, target = 0;
  ASSERT_TRUE(stream->launch([&ran] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ran.store(true);
  }));
  ASSERT_TRUE(stream->copy(&target, &source, sizeof source));
  ASSERT_TRUE(stream->drain());
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(target, 7);
  ASSERT_TRUE(stream->drain());  // nothing left: returns at once
}
