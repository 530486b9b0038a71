// cuBLAS and cuBLASLt, linked at run time: libcublas.so.13 and libcublasLt.so.13 (600 MB between
// them) are opened with dlopen when the first matrix product on a CUDA device makes its handle,
// so a run on the CPU never loads them (nor pays their start-up time, memory and constructors).
// Only their headers are used at build time. Where it looks, in order: COSHARD_CUBLAS_LIBRARY
// (libcublas.so.13, or the folder holding it), the loader's search path, then the toolkit's lib
// folder this build saw. cuBLASLt is taken from where cuBLAS is (the same folder, or the loader's
// path for a name), and opened first: cuBLAS's own need of it is then met by that copy, never by
// another one that LD_LIBRARY_PATH names first (the two ship as a pair, one version).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <span>
#include <string>

#include "coshard/async/result.hpp"

namespace coshard::modules::detail::cublas {

// cublasGemmStridedBatchedEx as exported (cublas_api.h adds a C++ overload of the same name
// that takes the compute type as a cudaDataType_t and converts it).
using GemmStridedBatchedEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                                const void*, const void*, cudaDataType, int, long long, const void*,
                                                cudaDataType, int, long long, const void*, void*, cudaDataType, int,
                                                long long, int, cublasComputeType_t, cublasGemmAlgo_t);

// Every cuBLAS and cuBLASLt function coshard calls, as the opened libraries export them.
struct Library {
  decltype(&cublasGetProperty) get_property = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasCreate) create = nullptr;
  decltype(&cublasDestroy) destroy = nullptr;
  decltype(&cublasSetStream) set_stream = nullptr;
  GemmStridedBatchedEx gemm_strided_batched_ex = nullptr;

  decltype(&cublasLtGetVersion) lt_get_version = nullptr;
  decltype(&cublasLtCreate) lt_create = nullptr;
  decltype(&cublasLtDestroy) lt_destroy = nullptr;
  decltype(&cublasLtMatmul) lt_matmul = nullptr;
  decltype(&cublasLtMatmulDescCreate) lt_matmul_desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) lt_matmul_desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) lt_matmul_desc_set_attribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) lt_matrix_layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) lt_matrix_layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) lt_preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) lt_preference_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) lt_preference_set_attribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) lt_algo_get_heuristic = nullptr;

  std::string path, lt_path;  // the files opened
  int version = 0;            // cuBLAS's: 130100 is 13.1.0
  std::size_t lt_version = 0; // cuBLASLt's, in the same form

  // "cuBLAS 13.1.0 (/usr/local/cuda/lib64/libcublas.so.13)".
  std::string describe() const;
};

// The first of `candidates` (files, or names for the loader) that is cuBLAS 13 with its cuBLASLt;
// else an error naming each and why it was not (not found, a function missing, another major
// version). Libraries taken stay open for the life of the process.
Result<Library> open_library(std::span<const std::string> candidates);

// The libraries, opened once per process on first call (thread-safe); the error says where it
// looked and why each failed.
Result<const Library*> library();

}  // namespace coshard::modules::detail::cublas
