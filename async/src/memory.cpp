#include "coshard/async/memory.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "coshard/async/sync.hpp"
#include "memory_backend.hpp"

namespace coshard::async {
namespace {

constexpr std::size_t kHostAlignment = 256;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

std::size_t page_size() {
  static const std::size_t size = [] {
    const long s = ::sysconf(_SC_PAGESIZE);
    return s > 0 ? static_cast<std::size_t>(s) : std::size_t{4096};
  }();
  return size;
}

// Pending blocks beyond this many are swept on every allocation.
constexpr std::size_t kSweepThreshold = 64;

bool all_ready(const std::vector<Event>& uses) {
  return std::all_of(uses.begin(), uses.end(), [](const Event& e) { return e.ready(); });
}

}  // namespace

// ---- Block ---------------------------------------------------------------------------------

namespace detail {
// What a block needs of its allocator, outliving it: the allocator while it lives (cleared by
// its destructor under the mutex), and the backend to free device memory with after.
struct AllocatorLink {
  std::mutex mutex;
  CachingAllocator* allocator = nullptr;
  std::shared_ptr<DeviceMemoryBackend> backend;
};
}  // namespace detail

Block& Block::operator=(Block&& o) noexcept {
  if (this != &o) {
    reset();
    link_ = std::move(o.link_);
    o.link_.reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    requested_ = std::exchange(o.requested_, 0);
    stream_ = std::exchange(o.stream_, nullptr);
    uses_ = std::move(o.uses_);
    o.uses_.clear();
  }
  return *this;
}

void Block::reset() noexcept { reset_after(Event{}); }

void Block::reset_after(Event last_use) noexcept {
  if (link_ && ptr_) {
    std::lock_guard lock(link_->mutex);  // the allocator cannot go while a block returns to it
    if (link_->allocator) {
      if (last_use.recorded())
        link_->allocator->release(*this, std::move(last_use));
      else
        link_->allocator->release(*this);
    } else {
      // The allocator is gone (its stream may be too): free the memory once the uses this block
      // knows of have passed. A teardown path, so the waits are counted like any other.
      for (const Event& e : uses_) (void)e.synchronize();
      if (last_use.recorded()) (void)last_use.synchronize();
      if (link_->backend)
        link_->backend->free(ptr_);
      else
        std::free(ptr_);
    }
  }
  link_.reset();
  ptr_ = nullptr;
  size_ = 0;
  requested_ = 0;
  stream_ = nullptr;
  uses_.clear();
}

// ---- CachingAllocator ------------------------------------------------------------------------

Result<std::unique_ptr<CachingAllocator>> CachingAllocator::create(Device device, AllocatorOptions options) {
  if (!(options.max_fit_ratio >= 1.0)) {
    return fail(ErrorCode::invalid_argument, "AllocatorOptions::max_fit_ratio=", options.max_fit_ratio,
                ": must be at least 1.0");
  }
  std::unique_ptr<detail::DeviceMemoryBackend> backend;
  if (device.is_cuda()) {
    auto b = detail::make_cuda_memory_backend(device);
    if (!b) return fail(std::move(b).error());
    backend = std::move(*b);
  }
  return std::make_unique<CachingAllocator>(Key{}, device, options, std::move(backend));
}

CachingAllocator::CachingAllocator(Key, Device device, AllocatorOptions options,
                                   std::shared_ptr<detail::DeviceMemoryBackend> backend)
    : device_(device), options_(options), backend_(std::move(backend)), link_(std::make_shared<detail::AllocatorLink>()) {
  link_->allocator = this;
  link_->backend = backend_;
}

CachingAllocator::~CachingAllocator() {
  {
    // Blocks still out are on their own from here (Block::reset_after frees them).
    std::lock_guard unlink(link_->mutex);
    link_->allocator = nullptr;
  }
  std::lock_guard lock(mutex_);
  for (Pending& p : pending_) {
    // Once an event has completed its stream is past that point, even when the event carries
    // the error of a failed stream (a failed CPU stream skips its later work but still passes
    // its events in order), so the block is free to go either way.
    bool passed = true;
    for (const Event& e : p.uses) {
      (void)e.synchronize();
      passed = passed && e.ready();  // not passed: strict mode refused to wait
    }
    if (passed) free_idle(p.ptr);  // else: a stream may still use it; leaking beats corrupting
  }
  for (auto& [size, ptr] : cached_) free_idle(ptr);
}

void CachingAllocator::free_idle(void* ptr) noexcept {
  if (backend_)
    backend_->free(ptr);
  else
    std::free(ptr);
}

Result<Block> CachingAllocator::allocate(std::size_t bytes, Stream& stream) {
  if (stream.device() != device_) {
    return fail(ErrorCode::invalid_argument, "CachingAllocator(", device_.to_string(),
                ")::allocate: stream '", stream.name(), "' is on ", stream.device().to_string());
  }
  Block block;
  block.link_ = link_;
  block.stream_ = &stream;

  const std::size_t size = round_up(std::max<std::size_t>(bytes, 1), kHostAlignment);
  bool reused = false;
  {
    std::lock_guard lock(mutex_);
    auto take_cached = [&] {
      auto it = cached_.lower_bound(size);
      if (it == cached_.end() || static_cast<double>(it->first) > static_cast<double>(size) * options_.max_fit_ratio)
        return false;
      block.ptr_ = it->second;
      block.size_ = it->first;
      stats_.cached_bytes -= it->first;
      cached_.erase(it);
      return true;
    };
    // Returns complete mostly in the order they were made (one compute stream), so the front of
    // the pending queue is swept first, stopping at the first block still in use. A full sweep
    // (every pending block's events) happens only when no fit was found and the queue has grown
    // to twice its size at the last full sweep: amortised O(1) per call even when the host runs
    // far ahead of the device and thousands of blocks wait.
    if (pending_.size() >= kSweepThreshold) sweep_front_locked();
    reused = take_cached();
    if (!reused && !pending_.empty()) {
      sweep_front_locked();
      reused = take_cached();
      if (!reused && pending_.size() >= next_full_sweep_) {
        sweep_locked();
        next_full_sweep_ = std::max(kSweepThreshold, 2 * pending_.size());
        reused = take_cached();
      }
    }
    if (reused) stats_.reuses++;
  }
  if (!reused) {
    if (backend_) {
      auto p = backend_->allocate(size, stream);
      if (!p) return fail(std::move(p).error());
      block.ptr_ = *p;
    } else {
      block.ptr_ = std::aligned_alloc(kHostAlignment, size);
      if (block.ptr_ == nullptr) {
        return fail(ErrorCode::out_of_memory, "CachingAllocator(cpu)::allocate(", bytes, " bytes): out of host memory");
      }
    }
    block.size_ = size;
  }
  if (options_.poison_on_reuse && (reused || backend_)) {
    if (!backend_) {
      std::memset(block.ptr_, options_.poison_byte, block.size_);
    } else if (auto f = backend_->fill(block.ptr_, options_.poison_byte, block.size_, stream); !f) {
      std::lock_guard lock(mutex_);
      stats_.cached_bytes += block.size_;
      cached_.emplace(block.size_, block.ptr_);
      block.link_.reset();
      block.ptr_ = nullptr;
      return fail(std::move(f).error());
    }
  }
  std::lock_guard lock(mutex_);
  if (!reused) stats_.fresh_allocations++;
  stats_.in_use_bytes += block.size_;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  block.requested_ = size;
  stats_.requested_in_use_bytes += size;
  stats_.peak_requested_bytes = std::max(stats_.peak_requested_bytes, stats_.requested_in_use_bytes);
  return block;
}

void CachingAllocator::release(Block& block, std::optional<Event> last_use) noexcept {
  auto last = last_use ? Result<Event>(std::move(*last_use)) : block.stream_->record();
  bool slot = false;  // a place in pending_ is taken for it
  {
    std::lock_guard lock(mutex_);
    stats_.in_use_bytes -= block.size_;
    stats_.requested_in_use_bytes -= block.requested_;
    try {
      if (!last) {
        // Without an event we cannot know when the stream is done with it: never hand it out again.
        leaked_.emplace_back(block.ptr_, block.size_);
        return;
      }
      // The memory first (a release runs in destructors: it must not throw), then the moves.
      block.uses_.reserve(block.uses_.size() + 1);
      pending_.emplace_back();
      slot = true;
    } catch (const std::bad_alloc&) {
      if (!last) return;  // leaked, unrecorded
      // No memory to remember the block by: handled below, outside the lock.
    }
    if (slot) {
      block.uses_.push_back(std::move(*last));
      pending_.back() = Pending{block.ptr_, block.size_, std::move(block.uses_)};
      stats_.pending_bytes += block.size_;
      return;
    }
  }
  // Its memory goes back to the system once every use has passed; a wait that fails leaves it
  // leaked rather than reused under a stream still writing it.
  bool passed = true;
  auto wait = [&passed](const Event& e) {
    (void)e.synchronize();
    passed = passed && e.ready();  // not passed: strict mode refused to wait
  };
  for (const Event& e : block.uses_) wait(e);
  wait(*last);
  if (passed) free_idle(block.ptr_);
}

void CachingAllocator::sweep_locked() {
  // Moves every returned block whose uses have all completed into the cache; the others keep
  // their order, compacted in place (std::stable_partition took a heap buffer every sweep).
  auto kept = pending_.begin();
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (all_ready(it->uses)) {
      cache_locked(*it);
    } else {
      if (kept != it) *kept = std::move(*it);
      ++kept;
    }
  }
  pending_.erase(kept, pending_.end());
}

void CachingAllocator::sweep_front_locked() {
  while (!pending_.empty() && all_ready(pending_.front().uses)) {
    cache_locked(pending_.front());
    pending_.pop_front();
  }
}

void CachingAllocator::cache_locked(const Pending& p) {
  stats_.pending_bytes -= p.size;
  stats_.cached_bytes += p.size;
  cached_.emplace(p.size, p.ptr);
}

void CachingAllocator::trim() {
  std::lock_guard lock(mutex_);
  sweep_locked();
  for (auto& [size, ptr] : cached_) free_idle(ptr);
  cached_.clear();
  stats_.cached_bytes = 0;
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::size_t host_memory_bytes() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)
                               : std::numeric_limits<std::size_t>::max();
}

namespace {

// The first number after `key` in a file of "key value" lines (/proc/meminfo, /proc/self/status),
// times `unit`; nullopt when absent.
std::optional<std::size_t> field_of(const char* path, std::string_view key, std::size_t unit) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    std::istringstream rest(line.substr(key.size()));
    unsigned long long v = 0;
    if (rest >> v) return static_cast<std::size_t>(v) * unit;
  }
  return std::nullopt;
}

// A cgroup v2 file holding one number, or "max" (nullopt).
std::optional<std::size_t> cgroup_value(const std::string& file) {
  std::ifstream in("/sys/fs/cgroup" + file);
  std::string text;
  if (!(in >> text) || text == "max") return std::nullopt;
  try {
    return static_cast<std::size_t>(std::stoull(text));
  } catch (...) {
    return std::nullopt;
  }
}

// This process's cgroup (v2: the line "0::/path" of /proc/self/cgroup).
std::string own_cgroup() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("0::", 0) == 0) return line.substr(3) == "/" ? std::string() : line.substr(3);
  return {};
}

}  // namespace

std::size_t available_host_memory_bytes() noexcept {
  try {
    std::size_t bytes = field_of("/proc/meminfo", "MemAvailable:", 1024).value_or(host_memory_bytes());
    const std::string group = own_cgroup();
    if (auto max = cgroup_value(group + "/memory.max")) {
      const std::size_t used = cgroup_value(group + "/memory.current").value_or(0);
      bytes = std::min(bytes, *max > used ? *max - used : 0);
    }
    const std::size_t mapped = field_of("/proc/self/status", "VmSize:", 1024).value_or(0);
    const std::size_t data = field_of("/proc/self/status", "VmData:", 1024).value_or(0);
    for (const auto& [resource, used] : {std::pair{RLIMIT_AS, mapped}, std::pair{RLIMIT_DATA, data}}) {
      rlimit limit{};
      if (::getrlimit(resource, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
        const auto cap = static_cast<std::size_t>(limit.rlim_cur);
        bytes = std::min(bytes, cap > used ? cap - used : 0);
      }
    }
    return bytes;
  } catch (...) {  // reading the files ran out of memory itself
    return 0;
  }
}

// ---- PinnedBuffer ------------------------------------------------------------------------------

void PinnedBuffer::FreeDeleter::operator()(std::byte* p) const noexcept { std::free(p); }

Result<PinnedBuffer> PinnedBuffer::allocate(std::size_t bytes) {
  PinnedBuffer buffer;
  if (bytes == 0) return buffer;
  const std::size_t mapped = round_up(bytes, page_size());
  auto* p = static_cast<std::byte*>(std::aligned_alloc(page_size(), mapped));
  if (p == nullptr) {
    return fail(ErrorCode::out_of_memory, "PinnedBuffer::allocate(", bytes, " bytes): out of host memory");
  }
  buffer.data_.reset(p);
  buffer.size_ = bytes;
  buffer.mapped_ = mapped;
  if (cuda_device_count() > 0) {
    buffer.cuda_registered_ = detail::register_host_memory(p, mapped);
  }
  if (!buffer.cuda_registered_) {
    // Best effort: RLIMIT_MEMLOCK may refuse; the memory still works, only unpinned.
    buffer.locked_ = ::mlock(p, mapped) == 0;
  }
  return buffer;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::move(o.data_);
    size_ = std::exchange(o.size_, 0);
    mapped_ = std::exchange(o.mapped_, 0);
    cuda_registered_ = std::exchange(o.cuda_registered_, false);
    locked_ = std::exchange(o.locked_, false);
  }
  return *this;
}

void PinnedBuffer::reset() noexcept {
  if (data_) {
    if (cuda_registered_) detail::unregister_host_memory(data_.get());
    if (locked_) ::munlock(data_.get(), mapped_);
  }
  data_.reset();
  size_ = mapped_ = 0;
  cuda_registered_ = locked_ = false;
}

}  // namespace coshard::async
