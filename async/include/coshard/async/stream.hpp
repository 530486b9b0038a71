// Stream: executes enqueued work in order on a device; Events mark points in it.
//
// Two backends, one meaning:
// - CPU: a worker thread per stream runs closures, copies and fills in FIFO order. It is not a
//   mock: the whole system runs and is tested on it, and races show up under ThreadSanitizer.
//   The idle worker spins `spin_before_park` before it parks on a futex (a futex wake costs
//   ~25 µs on these VMs, a spinning hand-off ~0.1 µs).
// - CUDA: a non-blocking cudaStream_t; events are timing-disabled cudaEvent_t from a pool; a
//   poller on the reactor turns completed events into coroutine wake-ups.
//
// Errors are sticky, as in CUDA: once a CPU closure throws, the stream skips later closures and
// every later event reports the error (co_await gives it back); a stream that waits on an event
// of a failed stream fails the same way.
//
// Threading: enqueue from any thread. A Stream must outlive the work and Blocks that refer to it;
// destroying a CPU stream runs its queued work to the end first.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "coshard/async/device.hpp"
#include "coshard/async/event.hpp"
#include "coshard/async/detail/unique_function.hpp"
#include "coshard/async/result.hpp"

namespace coshard::async {

struct StreamOptions {
  std::string name;
  // CPU only: how long an idle worker spins before parking.
  std::chrono::nanoseconds spin_before_park{std::chrono::microseconds(20)};
};

namespace detail {
class StreamImpl;
}

class Stream {
 public:
  static Result<Stream> create(Device device, StreamOptions options = {});

  Stream(Stream&&) noexcept;
  Stream& operator=(Stream&&) noexcept;
  ~Stream();

  Device device() const noexcept;
  const std::string& name() const noexcept;

  // Runs `fn` on the host in stream order (CPU: on the worker; CUDA: cudaLaunchHostFunc, which
  // stalls the stream while it runs — for host work, not for kernels).
  Result<void> launch(detail::UniqueFunction<void()> fn);
  // Like launch, but `fn` may fail: its Error (code kept, stream name prefixed) becomes the
  // stream's sticky error. CPU streams only for now (CUDA: ErrorCode::unsupported).
  Result<void> launch_fallible(detail::UniqueFunction<Result<void>()> fn);
  // memcpy / memset in stream order (CUDA: cudaMemcpyAsync with cudaMemcpyDefault).
  Result<void> copy(void* dst, const void* src, std::size_t bytes);
  Result<void> fill(void* dst, std::uint8_t value, std::size_t bytes);

  // Marks the current end of the stream.
  Result<Event> record();
  // The same, and the event keeps the time the device passes it (Event::elapsed_ms_since). A
  // little dearer than record() on CUDA (a timing-enabled cudaEvent_t); use it for measurements.
  Result<Event> record_timed();
  Result<void> record(Event& event);
  // Later work on this stream waits for `event` (device-side; the host does not block). A CUDA
  // stream cannot wait on a CPU event (ErrorCode::unsupported): order those through a coroutine.
  Result<void> wait(const Event& event);
  // Blocks the host until everything enqueued so far is done. Counted (sync.hpp).
  Result<void> synchronize();

  // cudaStream_t for CUDA streams, null for CPU streams.
  void* native_handle() const noexcept;
  // Milliseconds the stream has spent running its work (launched closures, copies, fills; not
  // its waits) since it was made: CPU streams measure it on the worker; CUDA streams do not
  // (nullopt: time them with record_timed).
  std::optional<double> busy_ms() const noexcept;

 private:
  explicit Stream(std::unique_ptr<detail::StreamImpl> impl);
  std::unique_ptr<detail::StreamImpl> impl_;
};

}  // namespace coshard::async
