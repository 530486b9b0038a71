// Element-wise CPU kernels over many elements (the offloaded optimizer's step over a unit's
// shard, its gradient statistics) split across cores. Private: not installed.
#pragma once

#include <cstdint>
#include <functional>

namespace coshard::modules::detail {

// Runs fn(begin, end) over [0, n) in at most cpu_math_threads() contiguous chunks whose bounds are
// multiples of `grain` (at least one grain each), all but the first on a process-wide pool of
// workers, and returns when every chunk is done. Only for work whose result does not depend on
// the split (element-wise updates, sums of fixed blocks added in order afterwards): the bits are
// those of one loop. One loop on the calling thread when n is under two grains, when one thread
// is allowed, or when no worker can be started (the machine out of memory or threads).
void parallel_for(std::int64_t n, std::int64_t grain, const std::function<void(std::int64_t, std::int64_t)>& fn);

}  // namespace coshard::modules::detail

namespace coshard::modules::detail {

// Element operations a chunk of rows holds at least: a split costs the pool's wake and wait
// (some microseconds), small against this many exps or products.
inline constexpr std::int64_t kRowChunkWork = std::int64_t{1} << 15;

// Rows [0, rows) of a kernel whose rows are independent, in chunks of whole rows split as
// parallel_for splits (fn(begin, end)): each row computed as one loop computes it, so the bits
// are the one loop's. `work_per_row` sizes the chunks (kRowChunkWork each at least).
inline void parallel_rows(std::int64_t rows, std::int64_t work_per_row,
                          const std::function<void(std::int64_t, std::int64_t)>& fn) {
  const std::int64_t per_row = work_per_row > 0 ? work_per_row : 1;
  parallel_for(rows, per_row >= kRowChunkWork ? 1 : kRowChunkWork / per_row, fn);
}

}  // namespace coshard::modules::detail
