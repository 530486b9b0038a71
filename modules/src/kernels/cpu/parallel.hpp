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
