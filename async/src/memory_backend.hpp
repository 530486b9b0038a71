// Device memory behind CachingAllocator (private): raw allocations for its cache (in memory.cpp),
// which decides reuse by events for every device.
#pragma once

#include <span>

#include "coshard/async/event.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/stream.hpp"

namespace coshard::async::detail {

class DeviceMemoryBackend {
 public:
  virtual ~DeviceMemoryBackend() = default;
  // Fresh memory, usable in `stream` order.
  virtual Result<void*> allocate(std::size_t bytes, Stream& stream) = 0;
  // Memory no stream uses any more (every use has passed).
  virtual void free(void* ptr) noexcept = 0;
  virtual Result<void> fill(void* ptr, std::uint8_t value, std::size_t bytes, Stream& stream) = 0;
};

Result<std::unique_ptr<DeviceMemoryBackend>> make_cuda_memory_backend(Device device);

// cudaHostRegister / cudaHostUnregister; false when there is no CUDA device or it fails.
bool register_host_memory(void* ptr, std::size_t bytes) noexcept;
void unregister_host_memory(void* ptr) noexcept;

}  // namespace coshard::async::detail
