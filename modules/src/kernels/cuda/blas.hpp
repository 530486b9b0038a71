// Matrix products on CUDA: cuBLAS for every product (f32 compute for every storage type), and
// cuBLASLt for a product with its bias added in the epilogue (Linear's forward), one pass over
// the output instead of two. Handles, cuBLASLt's workspace and its chosen algorithms are per
// (device, stream), made on first use (private to the CUDA backend).
#pragma once

#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

Result<void> cuda_gemm(async::Stream& s, DataType dt, const GemmArgs& g);

// C = op(A) op(B) + bias (bias [n], broadcast over the m rows; alpha 1, beta 0, batch 1). false:
// cuBLASLt has no algorithm for this product, its alignment or its bias, and nothing ran (the
// caller adds the bias itself).
Result<bool> cuda_gemm_bias(async::Stream& s, DataType dt, const GemmArgs& g, const void* bias);

}  // namespace coshard::modules::detail
