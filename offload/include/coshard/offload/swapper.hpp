// Swapper: state too large for memory, split into sub-groups stored in an NvmeStore, streamed
// through a bounded set of pinned buffers: while sub-group k is in use, k+1.. are being read and
// k-1.. written back, each an awaitable on the store's io_uring.
//
//   Swapper swapper(*store, pool, {.buffer_count = 4});
//   co_await swapper.for_each(groups, [&](std::size_t k, std::span<std::byte> bytes) -> Task<Result<void>> {
//     ... step sub-group k in place ...
//   });
//
// At most buffer_count buffers are held at once (reads ahead take what writes behind leave), all
// of the largest sub-group's size, so the pool reuses every one of them.
// Errors (a missing or truncated file, a full disk) end the pass with the store's error, which
// names the file, offset and size; sub-groups written before stay intact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/offload/nvme_store.hpp"
#include "coshard/offload/pinned_pool.hpp"

namespace coshard::offload {

struct SwapperOptions {
  int buffer_count = 4;  // >= 2: one in use, one reading ahead (3+ adds writing behind)
};

// Where a sub-group's bytes lie in its file when not at its head: each extent is page-aligned in
// the file, and its bytes follow the last extent's in the buffer from the next page on (a piece of
// each of several arrays kept apart in one file: DeepSpeed's sub_group_size over a unit's master and
// state). Writing an extent whose length is not whole pages writes the rest of its last page too.
struct SwapExtent {
  std::uint64_t offset = 0;  // in the file, a multiple of 4 KiB
  std::size_t bytes = 0;
};

struct SubGroup {
  std::string name;   // a file of the store
  std::size_t bytes;  // its buffer's size (with extents: at least their page-rounded lengths, summed)
  std::vector<SwapExtent> extents = {};  // empty: the file's first `bytes`
  // The last this many extents are read and never written back (a piece of an array the pass only
  // reads: the ZeRO engine's gradients swapped to NVMe, read beside the master and state they step).
  std::size_t read_only_extents = 0;
};

struct SwapStats {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::size_t peak_buffers = 0;  // most buffers held at once
};

class Swapper {
 public:
  using Use = std::function<async::Task<Result<void>>(std::size_t index, std::span<std::byte> bytes)>;

  static Result<std::unique_ptr<Swapper>> create(NvmeStore& store, std::shared_ptr<PinnedPool> pool,
                                                 SwapperOptions options);

  // Writes each sub-group's initial contents, produced by `fill` into its buffer (behind, bounded
  // the same way).
  async::Task<Result<void>> initialize(std::span<const SubGroup> groups, Use fill);
  // Reads every sub-group in order (ahead of use), awaits `use` on it, and writes it back behind
  // when `write_back` (otherwise the buffer is simply returned).
  async::Task<Result<void>> for_each(std::span<const SubGroup> groups, Use use, bool write_back = true);

  const SwapStats& stats() const noexcept { return stats_; }

 private:
  Swapper(NvmeStore& store, std::shared_ptr<PinnedPool> pool, SwapperOptions options)
      : store_(store), pool_(std::move(pool)), options_(options) {}
  async::Task<Result<void>> run(std::span<const SubGroup> groups, Use use, bool read, bool write_back);

  NvmeStore& store_;
  std::shared_ptr<PinnedPool> pool_;
  SwapperOptions options_;
  SwapStats stats_;
};

}  // namespace coshard::offload
