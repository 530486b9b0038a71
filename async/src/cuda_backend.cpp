// The CUDA backend: streams, events, the event poller, stream-ordered device memory and host
// registration. Host code only (compiled by the C++ compiler against the CUDA runtime); kernels
// live in .cu files behind plain C++20 headers.
//
// Waking coroutines on CUDA events: a poller on the reactor (TensorFlow EventMgr's shape) rather
// than cudaLaunchHostFunc callbacks, which stall later work on their stream and may not call
// CUDA (DESIGN.md). Events are timing-disabled (cheaper to record and query) and pooled per
// device; a pooled event is re-recorded only after the Fence that referred to it is gone, and
// cudaStreamWaitEvent captures the event's state at the call, so reuse cannot reorder anyone.
#include <cuda_runtime.h>

#include <algorithm>
#include <cassert>
#include <deque>
#include <mutex>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/async/detail/cpu_relax.hpp"
#include "memory_backend.hpp"
#include "stream_impl.hpp"

namespace coshard::async {

bool cuda_compiled() noexcept { return true; }

int cuda_device_count() noexcept {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky "no driver / no device" error
      return 0;
    }
    return n;
  }();
  return count;
}

Result<std::size_t> cuda_free_memory_bytes(Device device) {
  if (!device.is_cuda() || device.index() >= cuda_device_count())
    return fail(ErrorCode::invalid_argument, "free memory of ", device.to_string(), ": no such CUDA device (",
                cuda_device_count(), " visible)");
  if (auto e = cudaSetDevice(device.index()); e != cudaSuccess)
    return fail(ErrorCode::device, "cudaSetDevice(", device.index(), "): ", cudaGetErrorString(e));
  std::size_t free = 0, total = 0;
  if (auto e = cudaMemGetInfo(&free, &total); e != cudaSuccess)
    return fail(ErrorCode::device, "cudaMemGetInfo on ", device.to_string(), ": ", cudaGetErrorString(e));
  return free;
}

namespace detail {
namespace {

Unexpected cuda_error(cudaError_t e, std::string_view what) {
  return fail(ErrorCode::device, what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

class EventPool {
 public:
  explicit EventPool(bool timed = false) : timed_(timed) {}
  Result<cudaEvent_t> get(int device) {
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    if (auto e = cudaSetDevice(device); e != cudaSuccess) return cuda_error(e, "cudaSetDevice");
    cudaEvent_t event = nullptr;
    if (auto e = cudaEventCreateWithFlags(&event, timed_ ? cudaEventDefault : cudaEventDisableTiming); e != cudaSuccess) {
      return cuda_error(e, "cudaEventCreateWithFlags");
    }
    return event;
  }
  void put(cudaEvent_t event) {
    std::lock_guard lock(mutex_);
    free_.push_back(event);
  }

 private:
  bool timed_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// Two pools per device (timing disabled, the common case; and timing enabled, for
// record_timed), made once; events are returned to them for the life of the process.
EventPool& event_pool(int device, bool timed = false) {
  static std::deque<EventPool> pools = [] {
    std::deque<EventPool> p;
    for (int i = 0; i < std::max(cuda_device_count(), 1); ++i) {
      p.emplace_back(false);
      p.emplace_back(true);
    }
    return p;
  }();
  return pools.at(static_cast<std::size_t>(2 * device + (timed ? 1 : 0)));
}

class CudaFence;

// Polls the CUDA events that coroutines of one runtime await. Reactor thread only (and the
// thread destroying the runtime, once the reactor has stopped).
class CudaEventPoller final : public Poller {
 public:
  void add(Waiter& waiter, CudaFence* fence) {
    waiter.linked = true;
    waiting_.push_back({&waiter, fence});
  }
  void remove(Waiter& waiter) {
    if (!waiter.linked) return;
    std::erase_if(waiting_, [&](const Entry& e) { return e.waiter == &waiter; });
    waiter.linked = false;
  }
  bool poll() override;
  bool pending() const override { return !waiting_.empty(); }

 private:
  struct Entry {
    Waiter* waiter;
    CudaFence* fence;
  };
  std::vector<Entry> waiting_;
};

class CudaFence final : public Fence {
 public:
  CudaFence(Device device, cudaEvent_t event, bool timed = false) : Fence(device), event_(event), timed_(timed) {}
  ~CudaFence() override { event_pool(device().index(), timed_).put(event_); }

  bool timed() const noexcept override { return timed_; }
  double elapsed_ms_since(Fence& start) override {
    float ms = 0;
    // Both timed and passed (checked by Event): cudaEventElapsedTime does not wait.
    if (cudaEventElapsedTime(&ms, static_cast<CudaFence&>(start).event_, event_) != cudaSuccess) return 0;
    return ms;
  }

  cudaEvent_t event() const noexcept { return event_; }

  bool query() override {
    if (passed_.load(std::memory_order_acquire)) return true;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    mark_passed(e);
    return true;
  }

  Result<void> status() override {
    const auto e = static_cast<cudaError_t>(error_.load(std::memory_order_relaxed));
    if (e != cudaSuccess) return cuda_error(e, "a CUDA stream failed before this event");
    return {};
  }

  Result<void> wait_blocking() override {
    for (int i = 0; i < 2000; ++i) {  // a short spin: most waits are for work that is nearly done
      if (query()) return status();
      cpu_relax();
    }
    mark_passed(cudaEventSynchronize(event_));
    return status();
  }

  bool add_waiter(Waiter& waiter) override {
    if (query()) return false;
    assert(waiter.runtime != nullptr && "CUDA events are awaited on a runtime");
    waiter.runtime->owned_poller<CudaEventPoller>().add(waiter, this);
    return true;
  }

  void remove_waiter(Waiter& waiter) override {
    if (waiter.linked) waiter.runtime->owned_poller<CudaEventPoller>().remove(waiter);
  }

 private:
  // Any thread may query: error_ is stored before passed_ (release) and read after it (acquire).
  void mark_passed(cudaError_t e) {
    if (e != cudaSuccess) error_.store(static_cast<int>(e), std::memory_order_relaxed);
    passed_.store(true, std::memory_order_release);
  }

  cudaEvent_t event_;
  bool timed_;
  std::atomic<bool> passed_{false};
  std::atomic<int> error_{cudaSuccess};
};

bool CudaEventPoller::poll() {
  bool did = false;
  for (std::size_t i = 0; i < waiting_.size();) {
    if (waiting_[i].fence->query()) {
      Waiter* w = waiting_[i].waiter;
      waiting_[i] = waiting_.back();
      waiting_.pop_back();
      w->linked = false;
      wake(*w);
      did = true;
    } else {
      ++i;
    }
  }
  return did;
}

void CUDART_CB run_host_function(void* data) {
  std::unique_ptr<detail::UniqueFunction<void()>> fn(static_cast<detail::UniqueFunction<void()>*>(data));
  try {
    (*fn)();
  } catch (...) {
    // A host function cannot fail its CUDA stream; the closure's own error handling applies.
  }
}

class CudaStream final : public StreamImpl {
 public:
  CudaStream(Device device, StreamOptions options, cudaStream_t stream)
      : StreamImpl(device, std::move(options)), stream_(stream) {}
  ~CudaStream() override { cudaStreamDestroy(stream_); }  // returns at once; work completes

  Result<void> drain() noexcept override {
    if (const cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess)
      return fail(Error(ErrorCode::device, "cudaStreamSynchronize"));  // (short: no allocation)
    return {};
  }

  Result<void> launch(detail::UniqueFunction<void()> fn) override {
    auto heap = std::make_unique<detail::UniqueFunction<void()>>(std::move(fn));
    if (auto e = cudaLaunchHostFunc(stream_, run_host_function, heap.get()); e != cudaSuccess) {
      return cuda_error(e, "cudaLaunchHostFunc on stream '" + options().name + "'");
    }
    (void)heap.release();  // owned by run_host_function now
    return {};
  }

  Result<void> launch_fallible(detail::UniqueFunction<Result<void>()>) override {
    return fail(ErrorCode::unsupported, "stream '", options().name,
                "' (CUDA): launch_fallible is CPU-only (a host function cannot fail a CUDA stream)");
  }

  Result<void> copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return {};
    if (auto e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_); e != cudaSuccess) {
      return cuda_error(e, "cudaMemcpyAsync on stream '" + options().name + "'");
    }
    return {};
  }

  Result<void> fill(void* dst, std::uint8_t value, std::size_t bytes) override {
    if (bytes == 0) return {};
    if (auto e = cudaMemsetAsync(dst, value, bytes, stream_); e != cudaSuccess) {
      return cuda_error(e, "cudaMemsetAsync on stream '" + options().name + "'");
    }
    return {};
  }

  Result<Event> record() override { return record_event(false); }
  Result<Event> record_timed() override { return record_event(true); }
  Result<Event> record_event(bool timed) {
    auto& pool = event_pool(device().index(), timed);
    auto event = pool.get(device().index());
    if (!event) return fail(std::move(event).error());
    if (auto e = cudaEventRecord(*event, stream_); e != cudaSuccess) {
      pool.put(*event);
      return cuda_error(e, "cudaEventRecord on stream '" + options().name + "'");
    }
    return Event(std::make_shared<CudaFence>(device(), *event, timed));
  }

  Result<void> wait(const Event& event) override {
    if (!event.recorded()) return {};
    if (event.device().is_cuda()) {
      auto* fence = static_cast<CudaFence*>(event.fence().get());
      if (auto e = cudaStreamWaitEvent(stream_, fence->event(), 0); e != cudaSuccess) {
        return cuda_error(e, "cudaStreamWaitEvent on stream '" + options().name + "'");
      }
      return {};
    }
    if (event.ready()) return event.fence()->status();  // already passed: nothing to order
    return fail(ErrorCode::unsupported, "stream '", options().name,
                "' (CUDA) cannot wait on a pending CPU event: await it in a coroutine, then enqueue");
  }

  void* native_handle() const noexcept override { return stream_; }

 private:
  cudaStream_t stream_;
};

class CudaMemoryBackend final : public DeviceMemoryBackend {
 public:
  CudaMemoryBackend(Device device, cudaStream_t free_stream) : device_(device), free_stream_(free_stream) {}
  ~CudaMemoryBackend() override { (void)cudaStreamDestroy(free_stream_); }

  Result<void*> allocate(std::size_t bytes, Stream& stream) override {
    void* p = nullptr;
    if (bytes == 0) return p;
    auto* s = static_cast<cudaStream_t>(stream.native_handle());
    if (auto e = cudaMallocAsync(&p, bytes, s); e != cudaSuccess) {
      return fail(e == cudaErrorMemoryAllocation ? ErrorCode::out_of_memory : ErrorCode::device,
                  "cudaMallocAsync(", bytes, " bytes) on ", device_.to_string(), ": ", cudaGetErrorString(e));
    }
    return p;
  }

  // Idle memory back to the pool, on a stream of its own: no stream's work waits behind it.
  void free(void* ptr) noexcept override {
    if (ptr != nullptr) (void)cudaFreeAsync(ptr, free_stream_);
  }

  Result<void> fill(void* ptr, std::uint8_t value, std::size_t bytes, Stream& stream) override {
    return stream.fill(ptr, value, bytes);
  }

 private:
  Device device_;
  cudaStream_t free_stream_;
};

}  // namespace

Result<std::unique_ptr<StreamImpl>> make_cuda_stream(Device device, StreamOptions options) {
  const int count = cuda_device_count();
  if (device.index() < 0 || device.index() >= count) {
    return fail(ErrorCode::device, "Stream::create(", device.to_string(), "): no such CUDA device (",
                count, " visible)");
  }
  if (auto e = cudaSetDevice(device.index()); e != cudaSuccess) return cuda_error(e, "cudaSetDevice");
  cudaStream_t stream = nullptr;
  if (auto e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return cuda_error(e, "cudaStreamCreateWithFlags");
  }
  return std::unique_ptr<StreamImpl>(std::make_unique<CudaStream>(device, std::move(options), stream));
}

Result<std::unique_ptr<DeviceMemoryBackend>> make_cuda_memory_backend(Device device) {
  const int count = cuda_device_count();
  if (device.index() < 0 || device.index() >= count) {
    return fail(ErrorCode::device, "CachingAllocator(", device.to_string(), "): no such CUDA device (",
                count, " visible)");
  }
  // Keep freed memory in the device's default pool instead of returning it at each sync.
  cudaMemPool_t pool = nullptr;
  if (auto e = cudaDeviceGetDefaultMemPool(&pool, device.index()); e != cudaSuccess) {
    return cuda_error(e, "cudaDeviceGetDefaultMemPool");
  }
  std::uint64_t threshold = UINT64_MAX;
  if (auto e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold); e != cudaSuccess) {
    return cuda_error(e, "cudaMemPoolSetAttribute(ReleaseThreshold)");
  }
  int previous = 0;
  (void)cudaGetDevice(&previous);
  if (auto e = cudaSetDevice(device.index()); e != cudaSuccess) return cuda_error(e, "cudaSetDevice");
  cudaStream_t free_stream = nullptr;
  const cudaError_t created = cudaStreamCreateWithFlags(&free_stream, cudaStreamNonBlocking);
  (void)cudaSetDevice(previous);
  if (created != cudaSuccess) return cuda_error(created, "cudaStreamCreateWithFlags (allocator's free stream)");
  return std::unique_ptr<DeviceMemoryBackend>(std::make_unique<CudaMemoryBackend>(device, free_stream));
}

bool register_host_memory(void* ptr, std::size_t bytes) noexcept {
  if (cudaHostRegister(ptr, bytes, cudaHostRegisterDefault) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

void unregister_host_memory(void* ptr) noexcept { (void)cudaHostUnregister(ptr); }

}  // namespace detail
}  // namespace coshard::async
