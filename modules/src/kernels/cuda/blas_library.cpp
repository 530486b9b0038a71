#include "kernels/cuda/blas_library.hpp"

#include <filesystem>
#include <string_view>

#include "coshard/async/detail/shared_library.hpp"

namespace coshard::modules::detail::cublas {
namespace {

using async::detail::SharedLibrary;

constexpr const char* kFile = "libcublas.so.13";
constexpr const char* kLtFile = "libcublasLt.so.13";
static_assert(CUBLAS_VER_MAJOR == 13, "the sonames above name the major version of the headers built against");
// The type written out in GemmStridedBatchedEx is one the header declares (an unevaluated use:
// nothing is linked).
static_assert(sizeof(static_cast<GemmStridedBatchedEx>(&cublasGemmStridedBatchedEx)) > 0);

// cuBLASLt where cuBLAS is: beside a file, or the loader's for a name.
std::string lt_beside(const std::string& candidate) {
  if (candidate.find('/') == std::string::npos) return kLtFile;
  return (std::filesystem::path(candidate).parent_path() / kLtFile).string();
}

// The candidate and its cuBLASLt opened, their functions bound and their versions checked; else
// why not.
Result<Library> take(const std::string& candidate) {
  const std::string lt_candidate = lt_beside(candidate);
  auto lt_file = SharedLibrary::open(lt_candidate);
  if (!lt_file) return fail(ErrorCode::unsupported, "its cuBLASLt, ", lt_candidate, ": ", lt_file.error().message());
  COSHARD_TRY_ASSIGN(SharedLibrary file, SharedLibrary::open(candidate));
  Library lib;
  // cublas_v2.h maps cublasCreate, cublasDestroy and cublasSetStream to their _v2 exports.
  file.bind(lib.get_property, "cublasGetProperty");
  file.bind(lib.status_name, "cublasGetStatusName");
  file.bind(lib.create, "cublasCreate_v2");
  file.bind(lib.destroy, "cublasDestroy_v2");
  file.bind(lib.set_stream, "cublasSetStream_v2");
  file.bind(lib.gemm_strided_batched_ex, "cublasGemmStridedBatchedEx");
  if (!file.missing().empty()) return fail(ErrorCode::unsupported, file.missing(), " is missing: not cuBLAS");
  lt_file->bind(lib.lt_get_version, "cublasLtGetVersion");
  lt_file->bind(lib.lt_create, "cublasLtCreate");
  lt_file->bind(lib.lt_destroy, "cublasLtDestroy");
  lt_file->bind(lib.lt_matmul, "cublasLtMatmul");
  lt_file->bind(lib.lt_matmul_desc_create, "cublasLtMatmulDescCreate");
  lt_file->bind(lib.lt_matmul_desc_destroy, "cublasLtMatmulDescDestroy");
  lt_file->bind(lib.lt_matmul_desc_set_attribute, "cublasLtMatmulDescSetAttribute");
  lt_file->bind(lib.lt_matrix_layout_create, "cublasLtMatrixLayoutCreate");
  lt_file->bind(lib.lt_matrix_layout_destroy, "cublasLtMatrixLayoutDestroy");
  lt_file->bind(lib.lt_preference_create, "cublasLtMatmulPreferenceCreate");
  lt_file->bind(lib.lt_preference_destroy, "cublasLtMatmulPreferenceDestroy");
  lt_file->bind(lib.lt_preference_set_attribute, "cublasLtMatmulPreferenceSetAttribute");
  lt_file->bind(lib.lt_algo_get_heuristic, "cublasLtMatmulAlgoGetHeuristic");
  if (!lt_file->missing().empty())
    return fail(ErrorCode::unsupported, "its cuBLASLt, ", lt_candidate, ": ", lt_file->missing(),
                " is missing: not cuBLASLt");

  int major = 0, minor = 0, patch = 0;
  if (lib.get_property(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
      lib.get_property(MINOR_VERSION, &minor) != CUBLAS_STATUS_SUCCESS ||
      lib.get_property(PATCH_LEVEL, &patch) != CUBLAS_STATUS_SUCCESS)
    return fail(ErrorCode::unsupported, "cublasGetProperty did not give its version");
  lib.version = major * 10000 + minor * 100 + patch;
  lib.lt_version = lib.lt_get_version();
  if (major != CUBLAS_VER_MAJOR)
    return fail(ErrorCode::unsupported, "cuBLAS ", async::detail::dotted_version(static_cast<std::size_t>(lib.version)),
                "; this build needs cuBLAS ", CUBLAS_VER_MAJOR);
  if (lib.lt_version / 10000 != CUBLAS_VER_MAJOR)
    return fail(ErrorCode::unsupported, "its cuBLASLt, ", lt_candidate, ", is ", async::detail::dotted_version(lib.lt_version),
                "; this build needs cuBLASLt ", CUBLAS_VER_MAJOR);
  lib.path = file.file();
  if (lib.path.empty()) lib.path = candidate;
  lib.lt_path = lt_file->file();
  if (lib.lt_path.empty()) lib.lt_path = lt_candidate;
  std::move(file).keep();  // both open for the life of the process
  std::move(*lt_file).keep();
  return lib;
}

}  // namespace

std::string Library::describe() const {
  return "cuBLAS " + async::detail::dotted_version(static_cast<std::size_t>(version)) + " (" + path + ")";
}

Result<Library> open_library(std::span<const std::string> candidates) {
  return async::detail::first_library(candidates, std::string("cuBLAS (") + kFile + " and " + kLtFile + ")",
                                      "COSHARD_CUBLAS_LIBRARY", take);
}

Result<const Library*> library() {
#ifdef COSHARD_CUDA_TOOLKIT_LIBRARY_DIR
  constexpr std::string_view toolkit = COSHARD_CUDA_TOOLKIT_LIBRARY_DIR;
#else
  constexpr std::string_view toolkit;
#endif
  static const Result<Library> loaded =
      open_library(async::detail::library_candidates("COSHARD_CUBLAS_LIBRARY", kFile, toolkit));
  if (!loaded) return fail(loaded.error());
  return &*loaded;
}

}  // namespace coshard::modules::detail::cublas
