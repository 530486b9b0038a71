// Builds without the CUDA backend have no CUDA kernels: Context::create refuses CUDA streams.
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {
const Kernels* cuda_kernels() noexcept { return nullptr; }
const Kernels* cuda_kernels_materialized_attention() noexcept { return nullptr; }
}  // namespace coshard::modules::detail
