// Swapper: sub-groups round-trip bit-exact through NVMe in a bounded set of pinned buffers,
// reads run ahead of use, and failures end the pass with the store's error.
#include "coshard/offload/swapper.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "coshard/async/runtime.hpp"
#include "coshard/async/time.hpp"

namespace coshard::offload {
namespace {

namespace fs = std::filesystem;
using async::Task;

fs::path fresh_dir(const std::string& name) {
  fs::path dir = fs::current_path() / ("swapper_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::vector<SubGroup> groups_of(int n) {
  std::vector<SubGroup> g;
  for (int i = 0; i < n; ++i) g.push_back({"opt/group-" + std::to_string(i), 100'000 + 4096 * static_cast<std::size_t>(i) + 13});
  return g;
}

std::byte pattern(std::size_t group, std::size_t i, int pass) {
  return static_cast<std::byte>((group * 131 + i * 7 + static_cast<std::size_t>(pass) * 29) & 0xff);
}

TEST(Swapper, RoundTripsEveryGroupBitExactInBoundedBuffers) {
  const fs::path dir = fresh_dir("roundtrip");
  async::Runtime rt;
  auto store = NvmeStore::open({.directory = dir}).value();
  auto pool = PinnedPool::create({.host_memory_budget = 8 << 20}).value();
  auto swapper = Swapper::create(*store, pool, {.buffer_count = 3}).value();
  const auto groups = groups_of(9);
  auto r = rt.block_on([](Swapper& sw, const std::vector<SubGroup>& groups) -> Task<Result<void>> {
    COSHARD_CO_TRY(co_await sw.initialize(groups, [](std::size_t k, std::span<std::byte> b) -> Task<Result<void>> {
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = pattern(k, i, 0);
      co_return Result<void>{};
    }));
    // Each pass checks the last pass's bytes and writes the next.
    for (int pass = 1; pass <= 2; ++pass) {
      COSHARD_CO_TRY(co_await sw.for_each(groups, [pass](std::size_t k, std::span<std::byte> b) -> Task<Result<void>> {
        for (std::size_t i = 0; i < b.size(); ++i) {
          if (b[i] != pattern(k, i, pass - 1))
            co_return fail(ErrorCode::internal, "group ", k, " byte ", i, " differs in pass ", pass);
          b[i] = pattern(k, i, pass);
        }
        co_return Result<void>{};
      }));
    }
    // Read-only pass: the last written bytes, nothing written.
    const auto written = sw.stats().bytes_written;
    COSHARD_CO_TRY(co_await sw.for_each(groups, [](std::size_t k, std::span<std::byte> b) -> Task<Result<void>> {
      for (std::size_t i = 0; i < b.size(); ++i)
        if (b[i] != pattern(k, i, 2)) co_return fail(ErrorCode::internal, "group ", k, " differs after the passes");
      co_return Result<void>{};
    }, false));
    if (sw.stats().bytes_written != written) co_return fail(ErrorCode::internal, "a read-only pass wrote");
    co_return Result<void>{};
  }(*swapper, groups));
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_LE(swapper->stats().peak_buffers, 3u);
  EXPECT_GE(swapper->stats().peak_buffers, 2u);
  // Three buffers of the largest group's size, reused across passes.
  EXPECT_LE(pool->stats().peak_bytes, 3 * page_rounded(groups.back().bytes));
  EXPECT_LE(pool->stats().allocations, 3u);
  fs::remove_all(dir);
}

// Sub-groups as extents of one file (a piece of each of three arrays kept from page boundaries):
// each pass sees its own pieces and writes only them back; the whole file, read at the end, holds
// every piece where it belongs. An extent off a page boundary is refused by name.
TEST(Swapper, ExtentsOfOneFileRoundTripInPlace) {
  const fs::path dir = fresh_dir("extents");
  async::Runtime rt;
  auto store = NvmeStore::open({.directory = dir}).value();
  auto pool = PinnedPool::create({.host_memory_budget = 8 << 20}).value();
  auto swapper = Swapper::create(*store, pool, {.buffer_count = 2}).value();
  const std::size_t page = page_rounded(1), array = 5 * page;  // each array: 5 pages; pieces of 2 pages and a last of 1 + 100 bytes
  const std::size_t used = 4 * page + 100;
  std::vector<SubGroup> whole{{"state", 3 * array}};
  std::vector<SubGroup> pieces;
  for (std::size_t begin = 0; begin < used; begin += 2 * page) {
    const std::size_t len = std::min(2 * page, used - begin);
    SubGroup g{"state", 3 * page_rounded(len)};
    for (std::size_t a = 0; a < 3; ++a) g.extents.push_back({a * array + begin, len});
    pieces.push_back(std::move(g));
  }
  // The byte at `i` of array `a` (i < used) after pass `pass`.
  auto expected = [](std::size_t a, std::size_t i, int pass) {
    return static_cast<std::byte>((a * 53 + i * 3 + static_cast<std::size_t>(pass) * 17) & 0xff);
  };
  auto r = rt.block_on([&](Swapper& sw) -> Task<Result<void>> {
    COSHARD_CO_TRY(co_await sw.initialize(whole, [&](std::size_t, std::span<std::byte> b) -> Task<Result<void>> {
      for (std::size_t a = 0; a < 3; ++a)
        for (std::size_t i = 0; i < used; ++i) b[a * array + i] = expected(a, i, 0);
      co_return Result<void>{};
    }));
    COSHARD_CO_TRY(co_await sw.for_each(pieces, [&](std::size_t k, std::span<std::byte> b) -> Task<Result<void>> {
      const std::size_t begin = k * 2 * page, len = std::min(2 * page, used - begin);
      for (std::size_t a = 0; a < 3; ++a)
        for (std::size_t i = 0; i < len; ++i) {
          std::byte& at = b[a * page_rounded(len) + i];
          if (at != expected(a, begin + i, 0))
            co_return fail(ErrorCode::internal, "piece ", k, " array ", a, " byte ", i, " differs");
          at = expected(a, begin + i, 1);
        }
      co_return Result<void>{};
    }));
    COSHARD_CO_TRY(co_await sw.for_each(whole, [&](std::size_t, std::span<std::byte> b) -> Task<Result<void>> {
      for (std::size_t a = 0; a < 3; ++a)
        for (std::size_t i = 0; i < used; ++i)
          if (b[a * array + i] != expected(a, i, 1))
            co_return fail(ErrorCode::internal, "array ", a, " byte ", i, " differs after the pieces' pass");
      co_return Result<void>{};
    }, false));
    co_return Result<void>{};
  }(*swapper));
  ASSERT_TRUE(r) << r.error().message();

  std::vector<SubGroup> crooked{{"state", 2 * page, {{100, page}}}};
  auto refused = rt.block_on([](Swapper& sw, const std::vector<SubGroup>& g) -> Task<Result<void>> {
    co_return co_await sw.for_each(g, [](std::size_t, std::span<std::byte>) -> Task<Result<void>> {
      co_return Result<void>{};
    });
  }(*swapper, crooked));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("an extent at offset 100"), std::string::npos) << refused.error().message();
  fs::remove_all(dir);
}

// While group k is in use (a slow step), group k+1 is read: the read of the next group has
// finished before the use of the current one ends.
TEST(Swapper, ReadsRunAheadOfUse) {
  const fs::path dir = fresh_dir("ahead");
  async::Runtime rt;
  auto store = NvmeStore::open({.directory = dir}).value();
  auto pool = PinnedPool::create({.host_memory_budget = 8 << 20}).value();
  auto swapper = Swapper::create(*store, pool, {.buffer_count = 4}).value();
  const auto groups = groups_of(5);
  auto r = rt.block_on([](Swapper& sw, NvmeStore& store, const std::vector<SubGroup>& groups) -> Task<Result<int>> {
    COSHARD_CO_TRY(co_await sw.initialize(groups, [](std::size_t, std::span<std::byte>) -> Task<Result<void>> {
      co_return Result<void>{};
    }));
    int ahead = 0;
    const std::uint64_t before = store.bytes_read();
    COSHARD_CO_TRY(co_await sw.for_each(groups, [&](std::size_t k, std::span<std::byte>) -> Task<Result<void>> {
      co_await async::sleep_for(std::chrono::milliseconds(30));  // the reactor serves reads meanwhile
      // By the end of using group k, group k+1 has been read too.
      std::uint64_t through_next = 0;
      for (std::size_t j = 0; j <= k + 1 && j < groups.size(); ++j) through_next += page_rounded(groups[j].bytes);
      if (k + 1 < groups.size() && store.bytes_read() - before >= through_next) ++ahead;
      co_return Result<void>{};
    }, false));
    co_return ahead;
  }(*swapper, *store, groups));
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(*r, 4);  // every group that has a next one
  fs::remove_all(dir);
}

TEST(Swapper, AMissingGroupFileEndsThePassNamingIt) {
  const fs::path dir = fresh_dir("missing");
  async::Runtime rt;
  auto store = NvmeStore::open({.directory = dir}).value();
  auto pool = PinnedPool::create({.host_memory_budget = 8 << 20}).value();
  auto swapper = Swapper::create(*store, pool, {.buffer_count = 3}).value();
  const auto groups = groups_of(4);
  auto r = rt.block_on([](Swapper& sw, const std::vector<SubGroup>& groups) -> Task<Result<void>> {
    co_return co_await sw.for_each(groups, [](std::size_t, std::span<std::byte>) -> Task<Result<void>> {
      co_return Result<void>{};
    });
  }(*swapper, groups));
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("opt/group-0"), std::string::npos) << r.error().message();
  EXPECT_EQ(pool->stats().in_use_bytes, 0u);  // every buffer came back
  EXPECT_FALSE(Swapper::create(*store, pool, {.buffer_count = 1}));
  // A budget too small for the buffers is refused before anything moves.
  auto small = PinnedPool::create({.host_memory_budget = 200'000}).value();
  auto tight = Swapper::create(*store, small, {.buffer_count = 3}).value();
  auto refused = rt.block_on([](Swapper& sw, const std::vector<SubGroup>& groups) -> Task<Result<void>> {
    co_return co_await sw.initialize(groups, [](std::size_t, std::span<std::byte>) -> Task<Result<void>> {
      co_return Result<void>{};
    });
  }(*tight, groups));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("host_memory_budget=200000"), std::string::npos) << refused.error().message();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace coshard::offload
