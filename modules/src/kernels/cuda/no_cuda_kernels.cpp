// Builds without the CUDA backend have no CUDA kernels: Context::create refuses CUDA streams.
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {
const Kernels* cuda_kernels() noexcept { return nullptr; }
const Kernels* cuda_kernels_materialized_attention() noexcept { return nullptr; }
const Kernels* cuda_kernels_cudnn_attention() noexcept { return nullptr; }
Result<std::string> cudnn_attention_library() {
  return fail(ErrorCode::unsupported, "this build has no CUDA backend (configure with COSHARD_CUDA=ON)");
}
}  // namespace coshard::modules::detail
