#include "coshard/async/memory.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/async/sync.hpp"

namespace coshard::async {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<CachingAllocator> make_allocator(Device d, AllocatorOptions o = {}) {
  auto a = CachingAllocator::create(d, o);
  EXPECT_TRUE(a.has_value()) << (a ? "" : a.error().message());
  return std::move(*a);
}

Stream make_stream(Device d, const char* name) {
  auto s = Stream::create(d, StreamOptions{.name = name});
  EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message());
  return std::move(*s);
}

// The last use of a block is a slow closure on its stream that checks the data it wrote is still
// intact. Meanwhile the host returns the block and allocates (and writes poison into) everything
// it is handed. A block handed out before its last-use event completed would be overwritten
// under the slow closure, which sees poison instead of its pattern.
TEST(CachingAllocator, NeverHandsOutABlockBeforeItsLastUseCompleted) {
  auto alloc = make_allocator(Device::cpu(), AllocatorOptions{.poison_on_reuse = true});
  Stream user = make_stream(Device::cpu(), "user");
  Stream other = make_stream(Device::cpu(), "other");
  constexpr std::size_t kBytes = 1 << 16;
  constexpr int kRounds = 20;

  std::atomic<int> corrupted{0};
  std::vector<void*> returned_ptrs;
  for (int round = 0; round < kRounds; ++round) {
    auto block = alloc->allocate(kBytes, user);
    ASSERT_TRUE(block.has_value());
    auto* data = static_cast<std::uint8_t*>(block->data());
    const auto pattern = static_cast<std::uint8_t>(0x10 + round);
    ASSERT_TRUE(user.fill(data, pattern, kBytes));
    ASSERT_TRUE(user.launch([data, pattern, &corrupted] {
      std::this_thread::sleep_for(5ms);
      if (std::any_of(data, data + kBytes, [&](std::uint8_t b) { return b != pattern; })) corrupted++;
    }));
    returned_ptrs.push_back(block->data());
    block->reset();  // returned while the slow closure still reads it

    // Allocate aggressively on another stream and scribble over whatever comes back.
    std::vector<Block> grabbed;
    for (int i = 0; i < 4; ++i) {
      auto b = alloc->allocate(kBytes, other);
      ASSERT_TRUE(b.has_value());
      if (b->data() == returned_ptrs.back() && !user.record()->ready()) {
        ADD_FAILURE() << "round " << round << ": block handed out before its last use completed";
      }
      std::memset(b->data(), 0xEE, kBytes);
      grabbed.push_back(std::move(*b));
    }
  }
  ASSERT_TRUE(user.synchronize());
  EXPECT_EQ(corrupted.load(), 0);
}

// A block that outlives its allocator and its stream (a tensor kept by a user's module after the
// trainer is gone) stays readable and is freed when dropped: no use of the dead allocator or
// stream (ASan and TSan check it), no leak.
TEST(CachingAllocator, ABlockOutlivesItsAllocatorAndStream) {
  Block kept;
  Block used_elsewhere;
  auto other = make_stream(Device::cpu(), "other");
  {
    auto stream = make_stream(Device::cpu(), "dies");
    auto alloc = make_allocator(Device::cpu());
    auto b = alloc->allocate(4096, stream);
    ASSERT_TRUE(b);
    std::memset(b->data(), 7, 4096);
    kept = std::move(*b);
    auto c = alloc->allocate(4096, stream);
    ASSERT_TRUE(c);
    ASSERT_TRUE(other.launch([p = c->data()] { std::memset(p, 1, 4096); }));
    auto e = other.record();
    ASSERT_TRUE(e);
    c->record_use(*e);
    used_elsewhere = std::move(*c);
    ASSERT_TRUE(stream.synchronize());
  }
  EXPECT_EQ(static_cast<unsigned char*>(kept.data())[4095], 7);
  kept.reset();
  used_elsewhere.reset();  // waits for the use on `other`, then frees
  EXPECT_FALSE(kept);
}

TEST(CachingAllocator, ReusesABlockOnceItsLastUseCompleted) {
  auto alloc = make_allocator(Device::cpu(), AllocatorOptions{.poison_on_reuse = true, .poison_byte = 0xAB});
  Stream s = make_stream(Device::cpu(), "s");
  void* first = nullptr;
  {
    auto b = alloc->allocate(1000, s);
    ASSERT_TRUE(b.has_value());
    first = b->data();
    EXPECT_GE(b->size(), 1000u);
  }
  ASSERT_TRUE(s.synchronize());
  auto again = alloc->allocate(900, s);  // fits the cached block (within max_fit_ratio)
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->data(), first);
  const auto* bytes = static_cast<const std::uint8_t*>(again->data());
  EXPECT_TRUE(std::all_of(bytes, bytes + again->size(), [](std::uint8_t b) { return b == 0xAB; }))
      << "a reused block is poisoned when poison_on_reuse is on";
  const AllocatorStats st = alloc->stats();
  EXPECT_EQ(st.reuses, 1u);
  EXPECT_EQ(st.fresh_allocations, 1u);
}

TEST(CachingAllocator, UseOnAnotherStreamDelaysReuseUntilThatUseCompletes) {
  auto alloc = make_allocator(Device::cpu());
  Stream home = make_stream(Device::cpu(), "home");
  Stream guest = make_stream(Device::cpu(), "guest");
  std::atomic<bool> release_guest{false};
  void* ptr = nullptr;
  {
    auto b = alloc->allocate(4096, home);
    ASSERT_TRUE(b.has_value());
    ptr = b->data();
    ASSERT_TRUE(guest.launch([&] {
      while (!release_guest.load()) std::this_thread::sleep_for(100us);
    }));
    b->record_use(*guest.record());
  }
  ASSERT_TRUE(home.synchronize());  // the home stream is done; the guest is not
  {
    auto b = alloc->allocate(4096, home);
    ASSERT_TRUE(b.has_value());
    EXPECT_NE(b->data(), ptr) << "reused while another stream still used it";
  }
  release_guest = true;
  ASSERT_TRUE(guest.synchronize());
  ASSERT_TRUE(home.synchronize());
  // Both returned blocks are reusable now: the first is among the next two handed out.
  auto b1 = alloc->allocate(4096, home);
  auto b2 = alloc->allocate(4096, home);
  ASSERT_TRUE(b1 && b2);
  EXPECT_TRUE(b1->data() == ptr || b2->data() == ptr);
  EXPECT_EQ(alloc->stats().fresh_allocations, 2u);
}

// A request served by a larger cached block: the block's bytes are in use, the request's bytes
// are what the program asked for (the same whichever block the device's timing made free).
TEST(CachingAllocator, RequestedBytesFollowTheProgramNotTheBlockThatServedIt) {
  auto alloc = make_allocator(Device::cpu());
  Stream s = make_stream(Device::cpu(), "s");
  { auto big = alloc->allocate(8192, s); }
  ASSERT_TRUE(s.synchronize());
  auto small = alloc->allocate(5000, s);  // within max_fit_ratio 2: the cached 8 KiB block
  ASSERT_TRUE(small);
  EXPECT_EQ(small->size(), 8192u);
  EXPECT_EQ(alloc->stats().in_use_bytes, 8192u);
  EXPECT_EQ(alloc->stats().requested_in_use_bytes, 5120u);  // 5000 rounded to the 256-byte alignment
  EXPECT_EQ(alloc->stats().peak_requested_bytes, 8192u);     // the first request's
  small->reset();
  EXPECT_EQ(alloc->stats().requested_in_use_bytes, 0u);
  EXPECT_EQ(alloc->stats().in_use_bytes, 0u);
}

TEST(CachingAllocator, TracksInUseAndPeakBytes) {
  auto alloc = make_allocator(Device::cpu());
  Stream s = make_stream(Device::cpu(), "s");
  {
    auto a = alloc->allocate(1024, s);
    auto b = alloc->allocate(2048, s);
    ASSERT_TRUE(a && b);
    EXPECT_EQ(alloc->stats().in_use_bytes, 3072u);
  }
  EXPECT_EQ(alloc->stats().in_use_bytes, 0u);
  EXPECT_EQ(alloc->stats().peak_in_use_bytes, 3072u);
  ASSERT_TRUE(s.synchronize());
  alloc->trim();
  EXPECT_EQ(alloc->stats().cached_bytes, 0u);
  EXPECT_EQ(alloc->stats().pending_bytes, 0u);
}

TEST(CachingAllocator, RejectsAStreamOfAnotherDeviceAndBadOptions) {
  auto bad = CachingAllocator::create(Device::cpu(), AllocatorOptions{.max_fit_ratio = 0.5});
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message().find("max_fit_ratio=0.5"), std::string::npos);
  if (cuda_device_count() == 0) {
    auto cuda = CachingAllocator::create(Device::cuda(0));
    ASSERT_FALSE(cuda.has_value());
    EXPECT_NE(cuda.error().message().find("cuda:0"), std::string::npos);
  }
}

TEST(PinnedBuffer, IsPageAlignedExactlySizedAndWritable) {
  auto b = PinnedBuffer::allocate(12'345);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->size(), 12'345u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 4096, 0u);
  std::memset(b->data(), 0x7F, b->size());
  EXPECT_EQ(static_cast<int>(b->data()[12'344]), 0x7F);
  if (cuda_device_count() > 0) EXPECT_TRUE(b->cuda_registered());
  PinnedBuffer moved = std::move(*b);
  EXPECT_EQ(moved.size(), 12'345u);
  EXPECT_EQ(b->data(), nullptr);
  auto empty = PinnedBuffer::allocate(0);
  ASSERT_TRUE(empty.has_value());
  EXPECT_EQ(empty->size(), 0u);
}

TEST(CachingAllocator, CudaBlocksArePoisonedInStreamOrderAndFreedAfterUses) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto alloc = make_allocator(Device::cuda(0), AllocatorOptions{.poison_on_reuse = true, .poison_byte = 0x3C});
  Stream s = make_stream(Device::cuda(0), "cuda");
  auto b = alloc->allocate(1 << 20, s);
  ASSERT_TRUE(b.has_value()) << b.error().message();
  std::vector<std::uint8_t> host(1 << 20, 0);
  ASSERT_TRUE(s.copy(host.data(), b->data(), host.size()));
  ASSERT_TRUE(s.synchronize());
  EXPECT_TRUE(std::all_of(host.begin(), host.end(), [](std::uint8_t v) { return v == 0x3C; }));
}

// The gather pattern on a GPU: a block allocated for the compute stream is filled by another
// stream. Returned while its stream still runs, its memory must not serve the next allocation
// (reuse in stream order would hand it to a writer on another stream while the compute stream
// still reads it); once its last use has passed, it is reused.
TEST(CachingAllocator, CudaMemoryStillInUseIsNotHandedOutAgain) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto alloc = make_allocator(Device::cuda(0));
  Stream compute = make_stream(Device::cuda(0), "compute");
  std::atomic<bool> go{false};
  ASSERT_TRUE(compute.launch([&go] {  // the stream stays busy until the test lets it go
    while (!go.load()) std::this_thread::sleep_for(100us);
  }));
  constexpr std::size_t kBytes = 1 << 20;
  auto a = alloc->allocate(kBytes, compute);
  ASSERT_TRUE(a.has_value()) << a.error().message();
  void* const first = a->data();
  a->reset();  // its last use (the stream's current end) has not passed
  auto b = alloc->allocate(kBytes, compute);
  ASSERT_TRUE(b.has_value()) << b.error().message();
  EXPECT_NE(b->data(), first) << "memory still in use on its stream was handed out again";
  go = true;
  ASSERT_TRUE(compute.synchronize());
  const auto reuses = alloc->stats().reuses;
  auto c = alloc->allocate(kBytes, compute);
  ASSERT_TRUE(c.has_value()) << c.error().message();
  EXPECT_EQ(c->data(), first);
  EXPECT_EQ(alloc->stats().reuses, reuses + 1);
}

}  // namespace
}  // namespace coshard::async
