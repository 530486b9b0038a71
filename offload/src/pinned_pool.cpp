#include "coshard/offload/pinned_pool.hpp"

#include <unistd.h>

#include <algorithm>
#include <numeric>

namespace coshard::offload {

std::size_t page_rounded(std::size_t bytes) noexcept {
  static const std::size_t page = [] {
    const long s = ::sysconf(_SC_PAGESIZE);
    return s > 0 ? static_cast<std::size_t>(s) : std::size_t{4096};
  }();
  return (std::max<std::size_t>(bytes, 1) + page - 1) / page * page;
}

// ---- PinnedBlock ----

PinnedBlock::PinnedBlock(PinnedBlock&& o) noexcept
    : pool_(std::move(o.pool_)), buffer_(std::move(o.buffer_)), size_(std::exchange(o.size_, 0)) {}

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& o) noexcept {
  if (this != &o) {
    reset();
    pool_ = std::move(o.pool_);
    buffer_ = std::move(o.buffer_);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void PinnedBlock::reset() noexcept {
  if (!pool_) return;
  auto pool = std::move(pool_);
  pool->give_back(std::move(buffer_), std::nullopt);
  size_ = 0;
}

void PinnedBlock::release_after(async::Event last_use) noexcept {
  if (!pool_) return;
  auto pool = std::move(pool_);
  pool->give_back(std::move(buffer_), std::move(last_use));
  size_ = 0;
}

// ---- PinnedPool ----

Result<std::shared_ptr<PinnedPool>> PinnedPool::create(PinnedPoolOptions options) {
  if (options.host_memory_budget == 0)
    return fail(ErrorCode::invalid_argument, "PinnedPool: host_memory_budget=0: expected the bytes of pinned memory allowed");
  return std::make_shared<PinnedPool>(Key{}, options);
}

PinnedPool::~PinnedPool() {
  for (auto& p : pending_) (void)p.last_use.synchronize();
}

Result<void> PinnedPool::reserve(std::span<const std::size_t> sizes) const {
  std::size_t total = 0, largest = 0;
  for (std::size_t s : sizes) {
    total += page_rounded(s);
    largest = std::max(largest, s);
  }
  std::lock_guard lock(mutex_);
  const std::size_t held = stats_.in_use_bytes + stats_.pending_bytes;
  if (held + total > options_.host_memory_budget)
    return fail(ErrorCode::out_of_memory, "host_memory_budget=", options_.host_memory_budget, ": ", sizes.size(),
                " pinned buffers need ", total, " bytes (largest ", largest, ") on top of ", held,
                " in use; raise the budget or use fewer or smaller buffers");
  return {};
}

void PinnedPool::sweep_locked() {
  while (!pending_.empty() && pending_.front().last_use.ready()) {
    auto& p = pending_.front();
    const std::size_t size = page_rounded(p.buffer.size());
    stats_.pending_bytes -= size;
    stats_.cached_bytes += size;
    cached_.emplace(size, std::move(p.buffer));
    pending_.pop_front();
  }
}

Result<PinnedBlock> PinnedPool::acquire(std::size_t bytes) {
  const std::size_t size = page_rounded(bytes);
  PinnedBlock block;
  {
    std::lock_guard lock(mutex_);
    sweep_locked();
    if (auto it = cached_.find(size); it != cached_.end()) {
      block.buffer_ = std::move(it->second);
      cached_.erase(it);
      stats_.cached_bytes -= size;
      stats_.in_use_bytes += size;
      ++stats_.reuses;
      block.pool_ = shared_from_this();
      block.size_ = bytes;
      return block;
    }
    // Room for a new one: drop cached buffers of other sizes first.
    while (held_locked() + size > options_.host_memory_budget && !cached_.empty()) {
      auto it = std::prev(cached_.end());
      stats_.cached_bytes -= it->first;
      cached_.erase(it);
    }
    if (held_locked() + size > options_.host_memory_budget)
      return fail(ErrorCode::out_of_memory, "PinnedPool::acquire(", bytes, " bytes): host_memory_budget=",
                  options_.host_memory_budget, " has ", options_.host_memory_budget - held_locked(),
                  " bytes left (in use ", stats_.in_use_bytes, ", waiting for their last copy ", stats_.pending_bytes, ")");
    stats_.in_use_bytes += size;  // claimed before the allocation, outside the lock
    stats_.peak_bytes = std::max(stats_.peak_bytes, held_locked());
    ++stats_.allocations;
  }
  // Page-rounded, so the buffer can be handed out again for any request of this page size.
  auto buffer = async::PinnedBuffer::allocate(size);
  if (!buffer) {
    std::lock_guard lock(mutex_);
    stats_.in_use_bytes -= size;
    --stats_.allocations;
    return fail(std::move(buffer).error());
  }
  block.buffer_ = std::move(*buffer);
  block.pool_ = shared_from_this();
  block.size_ = bytes;
  return block;
}

void PinnedPool::give_back(async::PinnedBuffer buffer, std::optional<async::Event> last_use) noexcept {
  const std::size_t size = page_rounded(buffer.size());
  std::lock_guard lock(mutex_);
  stats_.in_use_bytes -= size;
  if (last_use && !last_use->ready()) {
    stats_.pending_bytes += size;
    pending_.push_back({std::move(buffer), std::move(*last_use)});
    return;
  }
  stats_.cached_bytes += size;
  cached_.emplace(size, std::move(buffer));
}

void PinnedPool::trim() {
  std::lock_guard lock(mutex_);
  sweep_locked();
  cached_.clear();
  stats_.cached_bytes = 0;
}

PinnedPoolStats PinnedPool::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace coshard::offload
