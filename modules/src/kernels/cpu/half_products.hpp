// The CPU kernels' native bf16/f16 matrix products (private): oneDNN's matmul on the
// half-precision operands, f32 accumulation, C rounded once (or kept in f32: c_in_stat_dtype).
// Built only with oneDNN (COSHARD_HAS_ONEDNN); without it native_half_products says no.
#pragma once

#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

// Whether gemm of `dt` runs natively here (cpu_half_products(): the build, the CPU, COSHARD_CPU_ISA).
bool native_half_products(DataType dt) noexcept;

// C = alpha * op(A) * op(B) + beta * C for each of g.batch products, on the calling thread's
// oneDNN stream with cpu_math_threads() threads (one under ThreadSanitizer: OpenMP's workers are
// not instrumented). Only where native_half_products(dt).
Result<void> half_gemm(DataType dt, const GemmArgs& g) noexcept;

}  // namespace coshard::modules::detail
