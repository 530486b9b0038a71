// Builds without the CUDA backend have no CUDA kernels: Context::create refuses CUDA streams.
#include "kernels.hpp"

namespace coshard::modules::detail {
const Kernels* cuda_kernels() noexcept { return nullptr; }
}  // namespace coshard::modules::detail
