// Element-wise CPU kernels over many elements (the offloaded optimizer's step over a unit's
// shard, its gradient statistics) split across cores. Private: not installed.
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <new>
#include <vector>

namespace coshard::modules::detail {

// fn(begin, end), borrowed for one call: neither copied nor allocated (a kernel that runs under an
// address-space limit must not fail for want of memory to call itself).
class RangeFn {
 public:
  template <class F>
    requires(std::invocable<F&, std::int64_t, std::int64_t> && !std::same_as<std::remove_cvref_t<F>, RangeFn>)
  RangeFn(F&& f) noexcept  // NOLINT(google-explicit-constructor): a lambda at each call site
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* object, std::int64_t begin, std::int64_t end) {
          (*static_cast<std::remove_reference_t<F>*>(object))(begin, end);
        }) {}
  void operator()(std::int64_t begin, std::int64_t end) const { call_(object_, begin, end); }

 private:
  void* object_;
  void (*call_)(void*, std::int64_t, std::int64_t);
};

// Runs fn(begin, end) over [0, n) in at most cpu_math_threads() contiguous chunks whose bounds are
// multiples of `grain` (at least one grain each), all but the first on a process-wide pool of
// workers, and returns when every chunk is done. Only for work whose result does not depend on
// the split (element-wise updates, sums of fixed blocks added in order afterwards): the bits are
// those of one loop. One loop on the calling thread when n is under two grains, when one thread
// is allowed, or when no worker can be started (the machine out of memory or threads).
// Nothing is allocated unless it splits, and a chunk that cannot be queued (no memory) runs here.
void parallel_for(std::int64_t n, std::int64_t grain, RangeFn fn);

}  // namespace coshard::modules::detail

namespace coshard::modules::detail {

// Element operations a chunk of rows holds at least: a split costs the pool's wake and wait
// (some microseconds), small against this many exps or products.
inline constexpr std::int64_t kRowChunkWork = std::int64_t{1} << 15;

// Rows [0, rows) of a kernel whose rows are independent, in chunks of whole rows split as
// parallel_for splits (fn(begin, end)): each row computed as one loop computes it, so the bits
// are the one loop's. `work_per_row` sizes the chunks (kRowChunkWork each at least).
inline void parallel_rows(std::int64_t rows, std::int64_t work_per_row, RangeFn fn) {
  const std::int64_t per_row = work_per_row > 0 ? work_per_row : 1;
  parallel_for(rows, per_row >= kRowChunkWork ? 1 : kRowChunkWork / per_row, fn);
}

// parallel_rows with fn(row, buffer) given a buffer of `width` floats of its chunk's (not zeroed).
// Throws std::bad_alloc on the calling thread where a chunk's buffer cannot be had.
template <class Fn>
void rows_with_buffer(std::int64_t rows, std::int64_t width, std::int64_t work_per_row, Fn&& fn) {
  std::atomic<bool> no_memory{false};
  parallel_rows(rows, work_per_row, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> buffer;
    try {
      buffer.resize(static_cast<std::size_t>(std::max<std::int64_t>(width, 1)));
    } catch (const std::bad_alloc&) {
      no_memory.store(true, std::memory_order_relaxed);
      return;
    }
    for (std::int64_t r = begin; r < end; ++r) fn(r, buffer.data());
  });
  if (no_memory.load(std::memory_order_relaxed)) throw std::bad_alloc();
}

}  // namespace coshard::modules::detail
