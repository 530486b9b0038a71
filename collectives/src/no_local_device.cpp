// The Local backend's device half when the CUDA backend is not built: every call says so.
#include "local_device.hpp"

namespace coshard::collectives::detail {

Result<void> check_local_device(async::Device device, int world_size) {
  return fail(ErrorCode::unsupported, "make_local_communicators(world_size=", world_size, ") on ", device.to_string(),
              ": this build has no CUDA backend (COSHARD_CUDA)");
}

Result<void> check_device_buffer(async::Device device, const void*, std::size_t, std::string_view, int,
                                 const CollectiveOp&) {
  return fail(ErrorCode::unsupported, "Local backend on ", device.to_string(), ": this build has no CUDA backend");
}

Result<void> enqueue_on_device(async::Stream& stream, std::span<const CollectiveOp* const>) {
  return fail(ErrorCode::unsupported, "Local backend on ", stream.device().to_string(),
              ": this build has no CUDA backend");
}

}  // namespace coshard::collectives::detail
