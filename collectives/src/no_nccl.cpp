// The answer of a build without NCCL.
#include "coshard/collectives/nccl.hpp"

namespace coshard::collectives {

bool nccl_compiled() noexcept { return false; }

Result<std::string> nccl_library() {
  return fail(ErrorCode::unsupported, "this build has no NCCL backend (configure with the CUDA toolkit and NCCL present)");
}

async::Task<Result<std::unique_ptr<Communicator>>> make_nccl_communicator(TcpStore&, int, int, async::Device device,
                                                                          NcclOptions) {
  co_return fail(ErrorCode::unsupported, "make_nccl_communicator(", device.to_string(),
                 "): this build has no NCCL backend (configure with the CUDA toolkit and NCCL present)");
}

async::Task<Result<std::unique_ptr<Communicator>>> make_nccl_communicator(std::vector<std::byte>, int, int,
                                                                          async::Device device, NcclOptions) {
  co_return fail(ErrorCode::unsupported, "make_nccl_communicator(", device.to_string(),
                 "): this build has no NCCL backend (configure with the CUDA toolkit and NCCL present)");
}

Result<std::vector<std::byte>> make_nccl_unique_id() {
  return fail(ErrorCode::unsupported, "make_nccl_unique_id: this build has no NCCL backend");
}

std::size_t nccl_unique_id_bytes() noexcept { return 0; }

}  // namespace coshard::collectives
