// The CPU's math threads: OpenBLAS's for the matrix products, and a pool of workers for the
// element-wise kernels that split (parallel.hpp), both bounded by the same setting.
#include "coshard/modules/cpu_threads.hpp"

#include <cblas.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <latch>
#include <mutex>
#include <shared_mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "kernels/cpu/blas.hpp"
#include "kernels/cpu/parallel.hpp"
#include "kernels/cpu/thread_sanitizer.hpp"

// OpenBLAS's own pool of buffers (exported; declared weak so that another BLAS still links):
// blas_memory_alloc maps a free slot's buffer the first time the slot is taken, and keeps it.
extern "C" __attribute__((weak)) void* blas_memory_alloc(int procpos);
extern "C" __attribute__((weak)) void blas_memory_free(void* buffer);

namespace coshard::modules {

namespace {

using detail::kThreadSanitizer;

// The setting (the element-wise pool splits by it); 0 until set: OpenBLAS's own count then.
std::atomic<int> math_threads{0};

// (a program that never sets it: OpenBLAS on one thread from the start, under TSan)
[[maybe_unused]] const bool blas_single_under_tsan = [] {
  if constexpr (kThreadSanitizer) openblas_set_num_threads(1);
  return kThreadSanitizer;
}();

}  // namespace

// Under ThreadSanitizer OpenBLAS runs every product on the calling thread, whatever the setting or
// OPENBLAS_NUM_THREADS: its workers take work and hand results back by spinning on plain memory
// that TSan cannot see (the library is not instrumented), so a threaded product's writes look
// unordered with whatever reuses its buffers next (reported as races with the caching allocator on
// a Xeon host and not on a Zen 3 host, as the timing of the reuse fell). coshard's own pool still
// splits by the setting, so its synchronisation stays in TSan's view.
void set_cpu_math_threads(int threads) noexcept {
  threads = std::max(1, threads);
  math_threads.store(threads, std::memory_order_relaxed);
  openblas_set_num_threads(kThreadSanitizer ? 1 : threads);
}

int cpu_math_threads() noexcept {
  const int set = math_threads.load(std::memory_order_relaxed);
  return set > 0 ? set : openblas_get_num_threads();
}

int default_cpu_math_threads(int ranks_in_process) noexcept {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_in_process));
}

namespace detail {

namespace {

// A malloc arena (64 MiB of address space) that another thread may map between the check below
// and OpenBLAS's mapping: room is checked for this much beyond the buffers.
constexpr std::size_t kRoomBeyondBlasBuffers = std::size_t{64} << 20;

}  // namespace

std::shared_mutex& blas_products() noexcept {
  static std::shared_mutex products;
  return products;
}

Result<void> reserve_blas_buffers() noexcept {
  thread_local bool reserved = false;
  if (reserved) return {};
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    reserved = true;  // no address-space limit: nothing OpenBLAS maps can fail for it
    return {};
  }
  // One thread at a time, and no product running meanwhile (each holds a slot of OpenBLAS's pool,
  // which would make the slots taken below more than the ones needed): two ranks' threads each
  // finding room for one buffer, then both mapping one, was the hang this guards against.
  static int threads_reserved = 0;  // threads that run products, each may hold a slot at once
  std::unique_lock lock(blas_products());
  // Room for this thread's buffer and its workers', reserved (it counts against the limit as
  // OpenBLAS's mapping will) and given back at once, then the buffers mapped at once, while the
  // room is still there.
  const int threads = std::max(1, openblas_get_num_threads());
  const std::size_t bytes = static_cast<std::size_t>(threads) * kBlasBufferBytes;
  void* room = ::mmap(nullptr, bytes + kRoomBeyondBlasBuffers, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (room == MAP_FAILED)
    return fail(ErrorCode::out_of_memory, "out of host memory: OpenBLAS needs about ", bytes >> 20, " MiB for the buffers of ",
                threads, " thread", threads == 1 ? "" : "s", " (", kBlasBufferBytes >> 20,
                " MiB each) and the address-space limit (ulimit -v: ", limit.rlim_cur >> 20,
                " MiB) leaves no room for them; OpenBLAS would retry forever: fewer BLAS threads, a smaller model or a "
                "higher limit");
  ::munmap(room, bytes + kRoomBeyondBlasBuffers);
  ++threads_reserved;
  if (blas_memory_alloc != nullptr && blas_memory_free != nullptr) {
    // Every thread that has reserved may run a product at the same moment, each holding a slot:
    // taking that many at once maps the slots not mapped yet (the pool hands out the lowest).
    std::vector<void*> slots;
    try {
      slots.reserve(static_cast<std::size_t>(threads_reserved));
    } catch (const std::bad_alloc&) {
      return fail(ErrorCode::out_of_memory, "out of host memory reserving OpenBLAS's buffers");
    }
    for (int i = 0; i < threads_reserved; ++i) slots.push_back(blas_memory_alloc(0));
    for (void* slot : slots) blas_memory_free(slot);
  }
  reserved = true;
  return {};
}

namespace {

// Workers started on first need (never more than asked for), shared by every rank of the
// process; jobs run in the order given. Idle workers sleep on the condition variable.
class CpuPool {
 public:
  static CpuPool& instance() {
    static CpuPool pool;
    return pool;
  }
  ~CpuPool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (auto& w : workers_) w.join();
  }
  // Workers up to `count`, as many as could be started; how many there are.
  int ensure_workers(int count) {
    std::lock_guard lock(mutex_);
    while (static_cast<int>(workers_.size()) < count) {
      try {
        workers_.emplace_back([this] { work(); });
      } catch (const std::system_error&) {
        break;  // no memory for another stack: the callers split less
      } catch (const std::bad_alloc&) {
        break;  // no memory to list it
      }
    }
    return static_cast<int>(workers_.size());
  }
  void submit(std::function<void()> job) {
    {
      std::lock_guard lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, and nothing left
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

void parallel_for(std::int64_t n, std::int64_t grain, RangeFn fn) {
  grain = std::max<std::int64_t>(1, grain);
  const std::int64_t grains = (n + grain - 1) / grain;
  std::int64_t chunks = std::min<std::int64_t>({std::max(1, cpu_math_threads()), grains, 64});
  if (chunks > 1) chunks = std::min<std::int64_t>(chunks, CpuPool::instance().ensure_workers(static_cast<int>(chunks - 1)) + 1);
  if (chunks <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  const std::int64_t step = (grains + chunks - 1) / chunks * grain;  // a chunk's elements, whole grains
  chunks = (n + step - 1) / step;
  std::latch done(chunks - 1);
  for (std::int64_t c = 1; c < chunks; ++c) {
    const std::int64_t begin = c * step, end = std::min(n, begin + step);
    bool queued = false;
    try {
      CpuPool::instance().submit([&fn, &done, begin, end] {
        fn(begin, end);
        done.count_down();
      });
      queued = true;
    } catch (const std::bad_alloc&) {
      // no memory to queue it: this thread runs the chunk (the latch still counts it)
    }
    if (!queued) {
      fn(begin, end);
      done.count_down();
    }
  }
  fn(0, std::min(n, step));
  done.wait();
}

}  // namespace detail
}  // namespace coshard::modules
