// Stream-ordered memory.
//
// CachingAllocator hands out Blocks for use on a Stream. Returning a Block (destruction or
// reset()) records an event on its stream; the memory is handed out again only after that event
// and every event given to record_use() have completed — so a block is never reused while a
// stream may still touch it, and the host never waits for that.
// Both devices keep one cache of blocks (best fit within max_fit_ratio), swept on allocation:
// - CPU: aligned host memory.
// - CUDA: fresh memory from cudaMallocAsync on the asking stream (a pool with release threshold
//   = max); cached memory goes back to the pool (cudaFreeAsync on the allocator's own stream)
//   only at trim() or destruction, once idle. Reuse waits for the events, not for stream order:
//   a block allocated for one stream is also written by others (a gather on the communication
//   stream fills the compute stream's buffer), and memory freed in compute-stream order would
//   be handed to such a writer while the compute stream still reads it.
// poison_on_reuse fills every block handed out again with poison_byte in stream order, so a
// premature reuse shows up as poison in the data of whoever used it last.
//
// PinnedBuffer: page-aligned host memory, registered with CUDA (cudaHostRegister) when a device
// is present, else mlock'ed on a best-effort basis. Page-aligned + registered (rather than
// cudaHostAlloc) so the same buffer can also be registered with io_uring for NVMe transfers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "coshard/async/device.hpp"
#include "coshard/async/event.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/stream.hpp"

namespace coshard::async {

struct AllocatorOptions {
  bool poison_on_reuse = false;
  std::uint8_t poison_byte = 0xCD;
  // A cached block serves a request only if block size <= request * max_fit_ratio.
  double max_fit_ratio = 2.0;
};

struct AllocatorStats {
  std::size_t in_use_bytes = 0;       // blocks handed out (a cached block may be up to max_fit_ratio x the request)
  std::size_t peak_in_use_bytes = 0;
  // What was asked for (rounded to the alignment), whichever block served it: it follows the
  // program's order of allocations and returns alone, not the device's timing (which cached
  // blocks have passed their last use), so one program gives one peak.
  std::size_t requested_in_use_bytes = 0;
  std::size_t peak_requested_bytes = 0;
  std::size_t cached_bytes = 0;   // returned, last use completed, ready to hand out
  std::size_t pending_bytes = 0;  // returned, last use not yet known to be complete
  std::uint64_t fresh_allocations = 0;
  std::uint64_t reuses = 0;
};

class CachingAllocator;

namespace detail {
class DeviceMemoryBackend;
struct AllocatorLink;
}

// Memory for use on one stream. Move-only; returns itself to its allocator when destroyed. Its
// stream must outlive it while its allocator lives. A block may outlive its allocator (a tensor
// a user's module keeps after the trainer is gone): it is then freed when dropped, once the uses
// it knows of have passed.
class Block {
 public:
  Block() = default;
  Block(Block&& o) noexcept { *this = std::move(o); }
  Block& operator=(Block&& o) noexcept;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block() { reset(); }

  void* data() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return size_; }
  std::span<std::byte> bytes() const noexcept { return {static_cast<std::byte*>(ptr_), size_}; }
  template <class T>
  std::span<T> as() const noexcept {
    return {static_cast<T*>(ptr_), size_ / sizeof(T)};
  }
  Stream* stream() const noexcept { return stream_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

  // Another stream used this block: reuse also waits for `event` (CUDA's record_stream).
  void record_use(const Event& event) { uses_.push_back(event); }
  // Returns the block now (its last use on its stream is recorded as an event).
  void reset() noexcept;
  // Returns the block with `last_use`, an event the caller recorded on the block's own stream
  // after its last use there, instead of recording another (saves an enqueue on hot paths).
  void reset_after(Event last_use) noexcept;

 private:
  friend class CachingAllocator;
  std::shared_ptr<detail::AllocatorLink> link_;  // to the allocator while it lives
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
  std::size_t requested_ = 0;  // the request it served (AllocatorStats::requested_in_use_bytes)
  Stream* stream_ = nullptr;
  std::vector<Event> uses_;
};

class CachingAllocator {
 public:
  static Result<std::unique_ptr<CachingAllocator>> create(Device device, AllocatorOptions options = {});
  // Waits (counted, as teardown) for blocks still in use by a stream, then frees everything.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  Result<Block> allocate(std::size_t bytes, Stream& stream);
  // Frees cached blocks whose last use has completed.
  void trim();
  AllocatorStats stats() const;
  Device device() const noexcept { return device_; }

 private:
  struct Key {};  // only create() constructs

 public:
  CachingAllocator(Key, Device device, AllocatorOptions options, std::shared_ptr<detail::DeviceMemoryBackend> backend);

 private:
  friend class Block;
  void release(Block& block, std::optional<Event> last_use = std::nullopt) noexcept;
  void sweep_locked();
  // Moves the ready blocks at the front of pending_ (the oldest returns) into the cache, up to the
  // first that is not ready: O(blocks moved + 1).
  void sweep_front_locked();

  struct Pending {
    void* ptr;
    std::size_t size;
    std::vector<Event> uses;
  };
  void cache_locked(const Pending& p);  // a pending block whose uses have passed, into the cache
  void free_idle(void* ptr) noexcept;   // memory no stream uses, back to the host or the device pool

  Device device_;
  AllocatorOptions options_;
  std::shared_ptr<detail::DeviceMemoryBackend> backend_;  // device memory; null on the CPU
  std::shared_ptr<detail::AllocatorLink> link_;           // shared with the blocks handed out
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> cached_;  // by size
  std::deque<Pending> pending_;               // in the order returned
  std::size_t next_full_sweep_ = 64;          // a full sweep when this many wait (doubles: amortised O(1))
  std::vector<std::pair<void*, std::size_t>> leaked_;    // could not learn when last used: never reused
  AllocatorStats stats_;
};

// This machine's physical memory in bytes (SIZE_MAX where the system does not say).
std::size_t host_memory_bytes() noexcept;
// Host memory this process may still take now: MemAvailable (/proc/meminfo; else the physical
// memory), capped by what its cgroup (v2 memory.max less memory.current) and RLIMIT_AS /
// RLIMIT_DATA (less its current size) leave it.
std::size_t available_host_memory_bytes() noexcept;
// Free memory of a CUDA device now (cudaMemGetInfo); fails without the backend or the device.
Result<std::size_t> cuda_free_memory_bytes(Device device);

class PinnedBuffer {
 public:
  static Result<PinnedBuffer> allocate(std::size_t bytes);

  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }

  std::byte* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return size_; }
  std::span<std::byte> bytes() const noexcept { return {data_.get(), size_}; }
  bool cuda_registered() const noexcept { return cuda_registered_; }
  bool locked() const noexcept { return locked_; }
  void reset() noexcept;

 private:
  struct FreeDeleter {
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, FreeDeleter> data_;
  std::size_t size_ = 0;
  std::size_t mapped_ = 0;  // rounded up to whole pages
  bool cuda_registered_ = false;
  bool locked_ = false;
};

}  // namespace coshard::async
