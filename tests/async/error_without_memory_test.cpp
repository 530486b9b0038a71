// An Error is made, copied and given context without throwing when memory runs out: a stream's
// worker thread copies a failed stream's error into every later event, and a std::bad_alloc
// there ended the process (std::terminate) under `ulimit -v` (HardeningThree's address-space
// sweep, about 1 run in 15). So are the runtime's other paths that must not throw: a remote
// wake-up, a block's release. Its own binary: it replaces the global operator new.
#include <gtest/gtest.h>

#include "support/sanitizers.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <new>
#include <thread>

#include "coshard/async/memory.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/task.hpp"

namespace {
// Allocations on this thread fail while set (the test's thread only: gtest and the stream's
// worker allocate as usual).
thread_local bool g_out_of_memory = false;
}  // namespace

#if !defined(COSHARD_TEST_ASAN) && !defined(COSHARD_TEST_TSAN)
void* operator new(std::size_t n) {
  if (g_out_of_memory) throw std::bad_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// Asio allocates its handlers with aligned_alloc (this definition takes the place of libc's for
// the whole process).
extern "C" void* aligned_alloc(std::size_t alignment, std::size_t size) noexcept {
  if (g_out_of_memory) return nullptr;
  void* p = nullptr;
  return posix_memalign(&p, std::max(alignment, sizeof(void*)), size) == 0 ? p : nullptr;
}
#define COSHARD_OOM_TESTABLE 1
#endif

namespace coshard {
namespace {

struct OutOfMemory {
  OutOfMemory() { g_out_of_memory = true; }
  ~OutOfMemory() { g_out_of_memory = false; }
};

TEST(ErrorWithoutMemory, IsMadeCopiedAndGivenContextWithoutThrowing) {
#ifndef COSHARD_OOM_TESTABLE
  GTEST_SKIP() << "the sanitizers own operator new";
#else
  Error made(ErrorCode::io, "reading shard 3 of unit fc1: short read");
  bool threw = false;
  {
    OutOfMemory oom;
    try {
      Error copy = made;  // shares the message
      Error lost(ErrorCode::out_of_memory, std::string());  // (an empty string allocates nothing)
      Error with_context = Error(made).with_context("while stepping");
      Result<int> r = fail(copy);
      EXPECT_EQ(copy.message(), made.message());
      EXPECT_EQ(with_context.message(), made.message());  // no memory for the longer one: as it was
      EXPECT_EQ(r.error().code(), ErrorCode::io);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  }
  EXPECT_FALSE(threw);
  // With memory again, context is added.
  EXPECT_EQ(Error(made).with_context("while stepping").message(), "while stepping: " + made.message());
#endif
}

TEST(ErrorWithoutMemory, AMessageThatCannotBeKeptIsReplacedByOneThatSaysSo) {
#ifndef COSHARD_OOM_TESTABLE
  GTEST_SKIP() << "the sanitizers own operator new";
#else
  std::string long_message(200, 'x');  // made before memory runs out
  std::optional<Error> e;
  {
    OutOfMemory oom;
    e.emplace(ErrorCode::device, std::move(long_message));
  }
  EXPECT_EQ(e->code(), ErrorCode::device);
  EXPECT_NE(e->message().find("out of host memory"), std::string::npos) << e->message();
#endif
}

TEST(ErrorWithoutMemory, AFailedStreamsEventsReportItsErrorWithoutMemory) {
#ifndef COSHARD_OOM_TESTABLE
  GTEST_SKIP() << "the sanitizers own operator new";
#else
  auto stream = async::Stream::create(async::Device::cpu(), async::StreamOptions{.name = "oom"});
  ASSERT_TRUE(stream);
  ASSERT_TRUE(stream->launch_fallible([]() -> Result<void> { return fail(ErrorCode::out_of_memory, "no room"); }));
  auto event = stream->record();
  ASSERT_TRUE(event);
  ASSERT_FALSE(stream->synchronize());  // the error is in; now read it again without memory
  bool threw = false;
  Result<void> seen{};
  {
    OutOfMemory oom;
    try {
      seen = event->synchronize();
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  }
  EXPECT_FALSE(threw);
  ASSERT_FALSE(seen);
  EXPECT_NE(seen.error().message().find("no room"), std::string::npos) << seen.error().message();
#endif
}

// Another thread (a stream's worker completing an event) wakes the parked reactor: the wake-up
// used to post an Asio handler (allocated), and a std::bad_alloc there ended the process under
// `ulimit -v` (the address-space sweep, about 1 run in 6 at 1100 MiB).
TEST(ErrorWithoutMemory, AnotherThreadWakesAParkedReactorWithoutAllocating) {
#ifndef COSHARD_OOM_TESTABLE
  GTEST_SKIP() << "the sanitizers own operator new";
#else
  async::Runtime rt;
  std::thread waker;
  struct HandOff {
    async::Runtime& rt;
    std::thread& waker;
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) {
      waker = std::thread([this, h] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the reactor has parked
        OutOfMemory oom;
        rt.schedule(h);
      });
    }
    void await_resume() const noexcept {}
  };
  auto resumed = rt.block_on([](HandOff hand_off) -> async::Task<int> {
    co_await hand_off;
    co_return 7;
  }(HandOff{rt, waker}));
  waker.join();
  ASSERT_TRUE(resumed);
  EXPECT_EQ(*resumed, 7);
#endif
}

// A block returned while no memory is left (its destructor) is neither thrown out of nor lost:
// with no room to queue it behind its last use, it waits for that use and goes back to the system.
TEST(ErrorWithoutMemory, ABlockReleasedWithoutMemoryGoesBackToTheSystem) {
#ifndef COSHARD_OOM_TESTABLE
  GTEST_SKIP() << "the sanitizers own operator new";
#else
  auto stream = async::Stream::create(async::Device::cpu(), async::StreamOptions{.name = "oom release"});
  ASSERT_TRUE(stream);
  auto allocator = async::CachingAllocator::create(async::Device::cpu());
  ASSERT_TRUE(allocator);
  auto block = (*allocator)->allocate(1 << 20, *stream);
  ASSERT_TRUE(block);
  auto last_use = stream->record();
  ASSERT_TRUE(last_use);
  bool threw = false;
  {
    OutOfMemory oom;
    try {
      block->reset_after(std::move(*last_use));
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  }
  EXPECT_FALSE(threw);
  const auto stats = (*allocator)->stats();
  EXPECT_EQ(stats.in_use_bytes, 0u);
  EXPECT_EQ(stats.pending_bytes + stats.cached_bytes, 0u);  // freed, not kept
  // And with no event to learn its last use from (recording one needs memory), it is refused
  // for reuse, never thrown out of a destructor.
  auto second = (*allocator)->allocate(1 << 20, *stream);
  ASSERT_TRUE(second);
  {
    OutOfMemory oom;
    try {
      second->reset();
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  }
  EXPECT_FALSE(threw);
  EXPECT_EQ((*allocator)->stats().in_use_bytes, 0u);
  EXPECT_TRUE(stream->synchronize());
#endif
}

TEST(ErrorWithoutMemory, MovedFromErrorsStillHaveAMessage) {
  Error a(ErrorCode::io, "x");
  Error b = std::move(a);
  EXPECT_EQ(b.message(), "x");
  EXPECT_TRUE(a.message().empty());  // NOLINT(bugprone-use-after-move): valid, if unspecified
}

}  // namespace
}  // namespace coshard
