// A CUDA launcher's status as coshard's error (the kernel and the stream named), and the dtypes
// the CUDA kernels serve. Private.
#pragma once

#include <cuda_runtime.h>

#include <string_view>

#include "coshard/async/result.hpp"
#include "coshard/async/dtype.hpp"
#include "coshard/async/stream.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

inline Result<void> check_launch(int code, std::string_view what, const async::Stream& s) {
  const auto e = static_cast<cudaError_t>(code);
  if (e == cudaSuccess) return {};
  return fail(ErrorCode::device, what, " on stream '", s.name(), "': ", cudaGetErrorName(e), " (",
              cudaGetErrorString(e), ")");
}

// The dtypes the CUDA kernels serve, and the error that names another.
inline bool cuda_serves(DataType dt) noexcept { return dt == DataType::f32 || dt == DataType::bf16 || dt == DataType::f16; }
inline Result<void> check_cuda_dtype(DataType dt) {
  if (cuda_serves(dt)) return {};
  return fail(ErrorCode::unsupported, "dtype ", async::to_string(dt),
              ": the CUDA kernels serve f32, bf16 and f16 (f64 runs on the CPU backend)");
}

}  // namespace coshard::modules::detail
