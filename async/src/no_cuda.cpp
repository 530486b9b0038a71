// The answers of a build without the CUDA backend (COSHARD_CUDA=OFF or no toolkit found).
#include "memory_backend.hpp"
#include "stream_impl.hpp"

namespace coshard::async {

bool cuda_compiled() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }

Result<std::size_t> cuda_free_memory_bytes(Device device) {
  return fail(ErrorCode::unsupported, "free memory of ", device.to_string(), ": this build has no CUDA backend");
}

namespace detail {

Result<std::unique_ptr<StreamImpl>> make_cuda_stream(Device device, StreamOptions) {
  return fail(ErrorCode::unsupported, "Stream::create(", device.to_string(),
              "): this build has no CUDA backend (configure with COSHARD_CUDA=ON and the CUDA toolkit)");
}

Result<std::unique_ptr<DeviceMemoryBackend>> make_cuda_memory_backend(Device device) {
  return fail(ErrorCode::unsupported, "CachingAllocator(", device.to_string(),
              "): this build has no CUDA backend");
}

bool register_host_memory(void*, std::size_t) noexcept { return false; }
void unregister_host_memory(void*) noexcept {}

}  // namespace detail
}  // namespace coshard::async
