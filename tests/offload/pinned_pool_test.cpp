// PinnedPool: exact (page) sizes, reuse, a hard budget refused with the numbers, and no reuse
// while a copy may still use a buffer.
#include "coshard/offload/pinned_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "coshard/async/stream.hpp"

namespace coshard::offload {
namespace {

TEST(PinnedPool, SizesAreExactPagesNotPowersOfTwo) {
  auto pool = PinnedPool::create({.host_memory_budget = 64 << 20}).value();
  const std::size_t odd = (5 << 20) + 123;  // a power-of-two allocator would take 8 MiB
  auto b = pool->acquire(odd);
  ASSERT_TRUE(b) << b.error().message();
  EXPECT_EQ(b->size(), odd);
  EXPECT_EQ(b->pages().size(), page_rounded(odd));
  EXPECT_LT(b->pages().size(), odd + 4096 + 1);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 4096, 0u);
  EXPECT_EQ(pool->stats().in_use_bytes, page_rounded(odd));
  b->bytes()[odd - 1] = std::byte{7};  // writable to the end
}

TEST(PinnedPool, ReusesAReturnedBufferOfThatSize) {
  auto pool = PinnedPool::create({.host_memory_budget = 16 << 20}).value();
  std::byte* first = nullptr;
  {
    auto b = pool->acquire(1 << 20).value();
    first = b.data();
  }
  auto again = pool->acquire(1 << 20).value();
  EXPECT_EQ(again.data(), first);
  const auto s = pool->stats();
  EXPECT_EQ(s.allocations, 1u);
  EXPECT_EQ(s.reuses, 1u);
}

TEST(PinnedPool, TheBudgetIsHardAndTheErrorHasTheNumbers) {
  auto pool = PinnedPool::create({.host_memory_budget = 4 << 20}).value();
  auto a = pool->acquire(3 << 20);
  ASSERT_TRUE(a);
  auto b = pool->acquire(2 << 20);
  ASSERT_FALSE(b);
  EXPECT_EQ(b.error().code(), ErrorCode::out_of_memory);
  EXPECT_NE(b.error().message().find("host_memory_budget=4194304"), std::string::npos) << b.error().message();
  EXPECT_NE(b.error().message().find("in use 3145728"), std::string::npos) << b.error().message();
  // A plan checked at build time.
  const std::size_t plan[] = {1 << 20, 1 << 20};
  auto r = pool->reserve(plan);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("2 pinned buffers need 2097152 bytes"), std::string::npos) << r.error().message();
  a->reset();
  EXPECT_TRUE(pool->reserve(plan));
  // Cached buffers of another size make room for a new one.
  EXPECT_TRUE(pool->acquire(2 << 20));
  EXPECT_FALSE(PinnedPool::create({.host_memory_budget = 0}));
}

TEST(PinnedPool, ABufferIsNotReusedWhileItsLastCopyMayRun) {
  auto pool = PinnedPool::create({.host_memory_budget = 16 << 20}).value();
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "copy"}).value();
  std::atomic<bool> go{false};
  ASSERT_TRUE(stream.launch([&go] {
    while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }));
  auto b = pool->acquire(1 << 20).value();
  std::byte* held = b.data();
  b.release_after(stream.record().value());
  EXPECT_EQ(pool->stats().pending_bytes, std::size_t{1} << 20);
  auto other = pool->acquire(1 << 20).value();
  EXPECT_NE(other.data(), held);  // the first is still pending
  other.reset();
  go = true;
  ASSERT_TRUE(stream.synchronize());
  auto c = pool->acquire(1 << 20).value();
  auto d = pool->acquire(1 << 20).value();
  EXPECT_TRUE(c.data() == held || d.data() == held);  // back once the copy passed
  EXPECT_EQ(pool->stats().pending_bytes, 0u);
}

}  // namespace
}  // namespace coshard::offload
