// PinnedPool: page-locked host buffers under a hard budget, reused, and never handed out again
// while a copy that uses them may be in flight.
//
//   auto pool = PinnedPool::create({.host_memory_budget = 8ull << 30}).value();
//   COSHARD_TRY(pool->reserve({shard_bytes, shard_bytes, state_bytes}));   // the plan fits, or a clear error now
//   auto buf = pool->acquire(shard_bytes).value();                          // exactly sized (pages)
//   stream.copy(buf.data(), device_ptr, shard_bytes);
//   buf.release_after(*stream.record());                                    // back once the copy has passed
//
// Sizes are exact, rounded to whole pages only: PyTorch's caching host allocator rounds to
// powers of two and has been measured wasting 1.78x. Memory is PinnedBuffer's: page-aligned,
// cudaHostRegister'ed when a GPU is present (so io_uring can use it too), mlock'ed otherwise.
// Budget = bytes in use + bytes waiting for their last copy + bytes cached for reuse; a request
// that cannot fit (after dropping cached buffers of other sizes) fails naming the numbers.
// Thread-safe.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "coshard/async/event.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/result.hpp"

namespace coshard::offload {

struct PinnedPoolOptions {
  std::size_t host_memory_budget = 0;  // bytes; required (> 0)
};

struct PinnedPoolStats {
  std::size_t budget = 0;
  std::size_t in_use_bytes = 0;
  std::size_t pending_bytes = 0;  // returned, waiting for the event of their last use
  std::size_t cached_bytes = 0;
  std::size_t peak_bytes = 0;     // most of in use + pending + cached at once
  std::uint64_t allocations = 0;  // fresh PinnedBuffers
  std::uint64_t reuses = 0;
};

class PinnedPool;

// A buffer from the pool; goes back on destruction (or release_after).
class PinnedBlock {
 public:
  PinnedBlock() = default;
  PinnedBlock(PinnedBlock&& o) noexcept;
  PinnedBlock& operator=(PinnedBlock&& o) noexcept;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  ~PinnedBlock() { reset(); }

  std::byte* data() const noexcept { return buffer_.data(); }
  std::size_t size() const noexcept { return size_; }  // as asked
  std::span<std::byte> bytes() const noexcept { return {buffer_.data(), size_}; }
  // The whole page-rounded buffer (for O_DIRECT transfers, which want whole pages).
  std::span<std::byte> pages() const noexcept { return buffer_.bytes(); }
  explicit operator bool() const noexcept { return pool_ != nullptr; }

  // Back to the pool now (no copy uses it any more).
  void reset() noexcept;
  // Back to the pool once `last_use` has passed (a device copy still reads or writes it).
  void release_after(async::Event last_use) noexcept;

 private:
  friend class PinnedPool;
  std::shared_ptr<PinnedPool> pool_;
  async::PinnedBuffer buffer_;
  std::size_t size_ = 0;
};

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  static Result<std::shared_ptr<PinnedPool>> create(PinnedPoolOptions options);

  // Checks at build time that buffers of these sizes fit the budget together (with what is
  // already held): the error names the budget, the total needed and the largest request.
  Result<void> reserve(std::span<const std::size_t> sizes) const;
  // A buffer of at least `bytes` (exactly that many pages); reuses a returned one of that page
  // size whose last use has passed.
  Result<PinnedBlock> acquire(std::size_t bytes);
  // Frees cached buffers (those waiting for their last use stay).
  void trim();
  PinnedPoolStats stats() const;

  struct Key {};
  PinnedPool(Key, PinnedPoolOptions options) : options_(options) { stats_.budget = options.host_memory_budget; }
  // Buffers still waiting for a copy are waited for (counted, as teardown) before being freed.
  ~PinnedPool();

 private:
  friend class PinnedBlock;
  void give_back(async::PinnedBuffer buffer, std::optional<async::Event> last_use) noexcept;
  void sweep_locked();
  std::size_t held_locked() const noexcept { return stats_.in_use_bytes + stats_.pending_bytes + stats_.cached_bytes; }

  struct Pending {
    async::PinnedBuffer buffer;
    async::Event last_use;
  };
  PinnedPoolOptions options_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, async::PinnedBuffer> cached_;  // by page-rounded size
  std::deque<Pending> pending_;
  PinnedPoolStats stats_;
};

std::size_t page_rounded(std::size_t bytes) noexcept;

}  // namespace coshard::offload
