#include "coshard/offload/swapper.hpp"

#include <deque>
#include <optional>

#include "coshard/async/join_handle.hpp"
#include "coshard/async/runtime.hpp"

namespace coshard::offload {

namespace {

// The extents a write of the group moves (the read-only ones are left out).
std::span<const SwapExtent> written_extents(const SubGroup& group) {
  const std::span<const SwapExtent> all(group.extents);
  return all.first(all.size() - std::min(all.size(), group.read_only_extents));
}

// The bytes a read or write of the group moves (with extents, theirs: the buffer may hold more).
std::size_t moved_bytes(const SubGroup& group, bool writing) {
  if (group.extents.empty()) return group.bytes;
  std::size_t moved = 0;
  for (const auto& e : writing ? written_extents(group) : std::span<const SwapExtent>(group.extents))
    moved += page_rounded(e.bytes);
  return moved;
}

// Each transfer owns its buffer while the store works on it. Whole pages go to the disk (O_DIRECT
// wants them); the file of a sub-group is therefore page-rounded, and reads take whole pages.
// With extents, one transfer each (they run at once), placed one after another in the buffer;
// `transfer` is the store's read or write of one extent. The first error, once all have ended.
template <class Transfer>
async::Task<Result<void>> each_extent(std::span<const SwapExtent> extents, PinnedBlock& block, Transfer transfer) {
  async::Runtime* rt = async::Runtime::current();
  std::vector<async::JoinHandle<Result<void>>> parts;
  std::size_t at = 0;
  for (const auto& e : extents) {
    parts.push_back(rt->spawn(transfer(e.offset, block.pages().subspan(at, page_rounded(e.bytes)))));
    at += page_rounded(e.bytes);
  }
  Result<void> first{};
  for (auto& part : parts) {
    auto r = co_await part;
    if (!r && first) first = std::move(r);
  }
  co_return first;
}

async::Task<Result<PinnedBlock>> read_into(NvmeStore& store, const SubGroup& group, PinnedBlock block) {
  if (group.extents.empty()) {
    COSHARD_CO_TRY(co_await store.read(group.name, 0, block.pages().first(page_rounded(group.bytes))));
    co_return std::move(block);
  }
  auto read = [&](std::uint64_t offset, std::span<std::byte> pages) { return store.read(group.name, offset, pages); };
  const std::span<const SwapExtent> extents(group.extents);
  COSHARD_CO_TRY(co_await each_extent(extents, block, read));  // (named: GCC 12 and temporaries in co_await)
  co_return std::move(block);
}

async::Task<Result<void>> write_from(NvmeStore& store, const SubGroup& group, PinnedBlock block) {
  if (group.extents.empty()) co_return co_await store.write(group.name, 0, block.pages().first(page_rounded(group.bytes)));
  auto write = [&](std::uint64_t offset, std::span<std::byte> pages) { return store.write(group.name, offset, pages); };
  const std::span<const SwapExtent> extents = written_extents(group);  // (its leading extents: their places in the buffer hold)
  co_return co_await each_extent(extents, block, write);
}

}  // namespace

Result<std::unique_ptr<Swapper>> Swapper::create(NvmeStore& store, std::shared_ptr<PinnedPool> pool,
                                                 SwapperOptions options) {
  if (!pool) return fail(ErrorCode::invalid_argument, "Swapper: no pinned pool");
  if (options.buffer_count < 2)
    return fail(ErrorCode::invalid_argument, "Swapper: buffer_count=", options.buffer_count,
                ": expected at least 2 (one in use, one reading ahead)");
  return std::unique_ptr<Swapper>(new Swapper(store, std::move(pool), options));
}

async::Task<Result<void>> Swapper::initialize(std::span<const SubGroup> groups, Use fill) {
  return run(groups, std::move(fill), false, true);
}

async::Task<Result<void>> Swapper::for_each(std::span<const SubGroup> groups, Use use, bool write_back) {
  return run(groups, std::move(use), true, write_back);
}

async::Task<Result<void>> Swapper::run(std::span<const SubGroup> groups, Use use, bool read, bool write_back) {
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::invalid_argument, "Swapper: must be awaited on a coshard Runtime");
  // The plan fits the budget before anything moves.
  std::size_t largest = 0;
  for (const auto& g : groups) {
    largest = std::max(largest, g.bytes);
    std::size_t placed = 0;
    for (const auto& e : g.extents) {
      if (e.offset % page_rounded(1) != 0)
        co_return fail(ErrorCode::invalid_argument, "Swapper: sub-group ", g.name, ": an extent at offset ", e.offset,
                       ": expected a multiple of ", page_rounded(1), " (a page)");
      placed += page_rounded(e.bytes);
    }
    if (placed > page_rounded(g.bytes))
      co_return fail(ErrorCode::invalid_argument, "Swapper: sub-group ", g.name, ": extents of ", placed,
                     " bytes in a ", g.bytes, "-byte sub-group");
  }
  const std::vector<std::size_t> buffers(static_cast<std::size_t>(options_.buffer_count), largest);
  if (!groups.empty()) COSHARD_CO_TRY(pool_->reserve(buffers));

  const auto cap = static_cast<std::size_t>(options_.buffer_count);
  std::deque<async::JoinHandle<Result<PinnedBlock>>> reads;  // in order: next_read - reads.size() ..
  std::deque<async::JoinHandle<Result<void>>> writes;        // oldest first
  std::size_t held = 0, next_read = 0;
  std::optional<Error> failure;
  auto note = [&](Result<void> r) {
    if (!r && !failure) failure = std::move(r).error();
  };
  auto finish_oldest_write = [&]() -> async::Task<void> {
    note(co_await writes.front());
    writes.pop_front();
    --held;
  };
  auto start_read = [&](std::size_t k) -> Result<void> {
    COSHARD_TRY_ASSIGN(auto block, pool_->acquire(largest));  // one size: every buffer is reused
    reads.push_back(rt->spawn(read_into(store_, groups[k], std::move(block))));
    ++held;
    stats_.peak_buffers = std::max(stats_.peak_buffers, held);
    return {};
  };

  for (std::size_t k = 0; k < groups.size() && !failure; ++k) {
    PinnedBlock block;
    if (read) {
      while (next_read <= k && !failure) {  // k itself must be on its way
        if (held == cap) co_await finish_oldest_write();
        if (failure) break;
        note(start_read(next_read++));
      }
      while (!failure && next_read < groups.size() && held < cap) note(start_read(next_read++));  // ahead
      if (failure) break;
      auto got = co_await reads.front();
      reads.pop_front();
      if (!got) {
        --held;
        note(fail(std::move(got).error()));
        break;
      }
      block = std::move(*got);
      stats_.bytes_read += moved_bytes(groups[k], false);
    } else {
      if (held == cap) co_await finish_oldest_write();
      if (failure) break;
      auto got = pool_->acquire(largest);
      if (!got) {
        note(fail(std::move(got).error()));
        break;
      }
      block = std::move(*got);
      std::fill(block.pages().begin(), block.pages().end(), std::byte{0});
      ++held;
      stats_.peak_buffers = std::max(stats_.peak_buffers, held);
    }
    // An exception out of `use` must not unwind this frame past the transfers in flight below.
    try {
      note(co_await use(k, block.bytes().first(groups[k].bytes)));
    } catch (const std::bad_alloc&) {
      note(fail(Error(ErrorCode::out_of_memory, "out of memory")));  // (short texts need no allocation)
    } catch (...) {
      note(fail(Error(ErrorCode::task_failed, "a use threw")));
    }
    if (failure) {
      block.reset();
      --held;
      break;
    }
    if (write_back) {
      writes.push_back(rt->spawn(write_from(store_, groups[k], std::move(block))));
      stats_.bytes_written += moved_bytes(groups[k], true);
    } else {
      block.reset();
      --held;
    }
  }
  // Everything in flight finishes before the pass returns (the transfers use the store and the
  // buffers), on success and on failure alike.
  while (!reads.empty()) {
    auto got = co_await reads.front();
    reads.pop_front();
    if (!got) note(fail(std::move(got).error()));
  }
  while (!writes.empty()) co_await finish_oldest_write();
  if (failure) co_return fail(std::move(*failure));
  co_return Result<void>{};
}

}  // namespace coshard::offload
