// Matrix products of the CPU kernels (private) through OpenBLAS: cblas_sgemm for f32 (and the
// f32 copies of bf16/f16), cblas_dgemm for f64.
#pragma once

#include <cblas.h>

#include <cstdint>
#include <shared_mutex>
#include <type_traits>

#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

// OpenBLAS maps a buffer for each thread that runs a product (128 MiB and a page in Debian's
// x86-64 build), the first time it does, and retries forever when the mapping fails: under an
// address-space limit (ulimit -v) a run would hang in the product, deaf to SIGTERM's graceful
// stop. Each thread's first product first checks the room for itself and OpenBLAS's workers,
// and has the buffers mapped while it is there (failing, naming the need and the limit, where
// there is none). Products hold blas_products() shared; the reservation holds it alone.
inline constexpr std::size_t kBlasBufferBytes = (std::size_t{128} << 20) + (std::size_t{64} << 10);
Result<void> reserve_blas_buffers() noexcept;
std::shared_mutex& blas_products() noexcept;

// Elements a row-major matrix of `rows` x `cols` at leading dimension `ld` spans, over `batch`
// matrices `stride` apart.
inline std::int64_t extent(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t batch,
                    std::int64_t stride) {
  if (rows <= 0 || cols <= 0 || batch <= 0) return 0;
  return (batch - 1) * stride + (rows - 1) * ld + cols;
}

// The i-th product of a batch through cblas_sgemm or cblas_dgemm.
template <class T>
void gemm_at(const GemmArgs& g, std::int64_t i) {
  const auto ta = g.trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = g.trans_b ? CblasTrans : CblasNoTrans;
  const T* a = static_cast<const T*>(g.a) + i * g.stride_a;
  const T* b = static_cast<const T*>(g.b) + i * g.stride_b;
  T* c = static_cast<T*>(g.c) + i * g.stride_c;
  const auto m = static_cast<blasint>(g.m), n = static_cast<blasint>(g.n), k = static_cast<blasint>(g.k);
  const auto lda = static_cast<blasint>(g.lda), ldb = static_cast<blasint>(g.ldb), ldc = static_cast<blasint>(g.ldc);
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, g.alpha, a, lda, b, ldb, g.beta, c, ldc);
  else
    cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, g.alpha, a, lda, b, ldb, g.beta, c, ldc);
}

template <class T>
void gemm_one(const GemmArgs& g, const T* a, const T* b, T* c) {
  GemmArgs one = g;
  one.a = a;
  one.b = b;
  one.c = c;
  one.batch = 1;
  gemm_at<T>(one, 0);
}

}  // namespace coshard::modules::detail
