// A build without oneDNN (COSHARD_ONEDNN=OFF, or not found): bf16 and f16 products run on f32
// copies through OpenBLAS, and the run's header says so.
#include "coshard/modules/cpu_half_products.hpp"
#include "kernels/cpu/half_products.hpp"

namespace coshard::modules {

std::string CpuHalfProducts::describe(DataType dt) const {
  if (dt != DataType::bf16 && dt != DataType::f16) return {};
  return std::string(to_string(dt)) + " on f32 copies through OpenBLAS (this build has no oneDNN)";
}

Result<CpuHalfProducts> cpu_half_products() noexcept { return CpuHalfProducts{}; }

void restart_with_passive_openmp(char**) noexcept {}  // (no oneDNN: no OpenMP threads to wait)

namespace detail {

bool native_half_products(DataType) noexcept { return false; }

Result<void> half_gemm(DataType dt, const GemmArgs&) noexcept {
  return fail(ErrorCode::unsupported, "a native ", to_string(dt), " matrix product: this build has no oneDNN");
}

}  // namespace detail
}  // namespace coshard::modules
