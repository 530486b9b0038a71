// Device memory backends behind CachingAllocator (private). The CPU cache lives in memory.cpp;
// a backend here is one whose allocator is itself stream-ordered (cudaMallocAsync).
#pragma once

#include <span>

#include "coshard/async/event.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/stream.hpp"

namespace coshard::async::detail {

class DeviceMemoryBackend {
 public:
  virtual ~DeviceMemoryBackend() = default;
  virtual Result<void*> allocate(std::size_t bytes, Stream& stream) = 0;
  // Frees in `stream` order after every event in `uses`.
  virtual void free(void* ptr, Stream& stream, std::span<const Event> uses) noexcept = 0;
  virtual Result<void> fill(void* ptr, std::uint8_t value, std::size_t bytes, Stream& stream) = 0;
};

Result<std::unique_ptr<DeviceMemoryBackend>> make_cuda_memory_backend(Device device);

// cudaHostRegister / cudaHostUnregister; false when there is no CUDA device or it fails.
bool register_host_memory(void* ptr, std::size_t bytes) noexcept;
void unregister_host_memory(void* ptr) noexcept;

}  // namespace coshard::async::detail
