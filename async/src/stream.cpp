#include <new>
#include <system_error>

#include "coshard/async/stream.hpp"

#include <cassert>

#include "coshard/async/runtime.hpp"
#include "coshard/async/sync.hpp"
#include "stream_impl.hpp"

namespace coshard::async {

Result<Stream> Stream::create(Device device, StreamOptions options) {
  if (options.name.empty()) options.name = device.to_string();
  if (device.is_cpu()) {
    const std::string name = options.name;
    try {
      return Stream(detail::make_cpu_stream(std::move(options)));
    } catch (const std::system_error& e) {  // its worker thread could not start (out of memory or threads)
      return fail(ErrorCode::out_of_memory, "CPU stream '", name, "': cannot start its worker thread (", e.what(), ")");
    } catch (const std::bad_alloc&) {
      return fail(ErrorCode::out_of_memory, "CPU stream '", name, "': out of host memory");
    }
  }
  auto impl = detail::make_cuda_stream(device, std::move(options));
  if (!impl) return fail(std::move(impl).error());
  return Stream(std::move(*impl));
}

Stream::Stream(std::unique_ptr<detail::StreamImpl> impl) : impl_(std::move(impl)) {}
Stream::Stream(Stream&&) noexcept = default;
Stream& Stream::operator=(Stream&&) noexcept = default;
Stream::~Stream() = default;

Device Stream::device() const noexcept { return impl_->device(); }
const std::string& Stream::name() const noexcept { return impl_->options().name; }
namespace {

// A CPU stream's queue, fences and closures are heap memory: an operation that cannot get it is
// an out_of_memory error, never an exception out of the API (a destructor releasing a block
// records an event).
template <class F>
auto or_out_of_memory(const Stream& stream, const char* what, F&& f) noexcept -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return fail(ErrorCode::out_of_memory, "stream '", stream.name(), "': out of host memory to ", what);
  }
}

}  // namespace

Result<void> Stream::launch(detail::UniqueFunction<void()> fn) {
  return or_out_of_memory(*this, "queue a kernel", [&] { return impl_->launch(std::move(fn)); });
}
Result<void> Stream::launch_fallible(detail::UniqueFunction<Result<void>()> fn) {
  return or_out_of_memory(*this, "queue a kernel", [&] { return impl_->launch_fallible(std::move(fn)); });
}
Result<void> Stream::copy(void* dst, const void* src, std::size_t bytes) {
  return or_out_of_memory(*this, "queue a copy", [&] { return impl_->copy(dst, src, bytes); });
}
Result<void> Stream::fill(void* dst, std::uint8_t value, std::size_t bytes) {
  return or_out_of_memory(*this, "queue a fill", [&] { return impl_->fill(dst, value, bytes); });
}
Result<Event> Stream::record() {
  return or_out_of_memory(*this, "record an event", [&] { return impl_->record(); });
}
Result<Event> Stream::record_timed() {
  return or_out_of_memory(*this, "record an event", [&] { return impl_->record_timed(); });
}
void* Stream::native_handle() const noexcept { return impl_->native_handle(); }
std::optional<double> Stream::busy_ms() const noexcept { return impl_->busy_ms(); }

Result<void> Stream::record(Event& event) {
  auto e = record();
  if (!e) return fail(std::move(e).error());
  event = std::move(*e);
  return {};
}

Result<void> Stream::wait(const Event& event) {
  return or_out_of_memory(*this, "queue a wait", [&] { return impl_->wait(event); });
}

Result<void> Stream::synchronize() {
  return detail::blocking_wait("Stream::synchronize", [&]() -> Result<void> {
    try {
      auto e = impl_->record();
      if (!e) return fail(std::move(e).error());
      return e->fence()->wait_blocking();
    } catch (const std::bad_alloc&) {
      return impl_->drain();  // no memory for an event (teardown at a limit): wait without one
    }
  });
}

Result<void> Event::synchronize() const {
  if (!fence_) return {};
  return detail::blocking_wait("Event::synchronize", [&] { return fence_->wait_blocking(); });
}

Result<double> Event::elapsed_ms_since(const Event& start) const {
  if (!timed() || !start.timed())
    return fail(ErrorCode::invalid_argument, "Event::elapsed_ms_since: ", !timed() ? "this event" : "the start event",
                " is not timed (record it with Stream::record_timed)");
  if (!(device() == start.device()))
    return fail(ErrorCode::invalid_argument, "Event::elapsed_ms_since: events on ", start.device().to_string(), " and ",
                device().to_string(), " have no common clock");
  if (!start.fence_->query() || !fence_->query())
    return fail(ErrorCode::invalid_argument, "Event::elapsed_ms_since: ", !start.fence_->query() ? "the start" : "this",
                " event has not passed yet (timings are read after the fact, never waited for)");
  return fence_->elapsed_ms_since(*start.fence_);
}

bool Event::Awaiter::await_suspend(std::coroutine_handle<> awaiting) {
  waiter_.handle = awaiting;
  waiter_.runtime = Runtime::current();
  // Without a runtime the waker (a stream worker) would have to resume the coroutine inline,
  // inside the fence's lock. Events are awaited from tasks run by a Runtime.
  assert(waiter_.runtime != nullptr && "co_await on an Event outside a coshard Runtime");
  suspended_ = fence_->add_waiter(waiter_);
  return suspended_;
}

}  // namespace coshard::async
