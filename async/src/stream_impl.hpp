// The backend interface behind Stream (private).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "coshard/async/event.hpp"
#include "coshard/async/stream.hpp"

namespace coshard::async::detail {

class StreamImpl {
 public:
  StreamImpl(Device device, StreamOptions options) : device_(device), options_(std::move(options)) {}
  virtual ~StreamImpl() = default;

  Device device() const noexcept { return device_; }
  const StreamOptions& options() const noexcept { return options_; }

  virtual Result<void> launch(detail::UniqueFunction<void()> fn) = 0;
  virtual Result<void> launch_fallible(detail::UniqueFunction<Result<void>()> fn) = 0;
  virtual Result<void> copy(void* dst, const void* src, std::size_t bytes) = 0;
  virtual Result<void> fill(void* dst, std::uint8_t value, std::size_t bytes) = 0;
  virtual Result<Event> record() = 0;
  virtual Result<Event> record_timed() = 0;
  virtual Result<void> wait(const Event& event) = 0;
  virtual void* native_handle() const noexcept = 0;
  virtual std::optional<double> busy_ms() const noexcept { return std::nullopt; }
  // Waits until everything enqueued before it has run, without allocating: synchronize's way
  // where an event cannot be made (out of memory at teardown). Not counted as a host sync here:
  // synchronize counts it.
  virtual Result<void> drain() noexcept = 0;

 private:
  Device device_;
  StreamOptions options_;
};

std::unique_ptr<StreamImpl> make_cpu_stream(StreamOptions options);
// Defined by the CUDA backend, or by no_cuda.cpp (ErrorCode::unsupported) when it is not built.
Result<std::unique_ptr<StreamImpl>> make_cuda_stream(Device device, StreamOptions options);

}  // namespace coshard::async::detail
