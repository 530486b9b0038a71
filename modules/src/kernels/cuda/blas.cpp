#include "kernels/cuda/blas.hpp"

#include <cuda_runtime.h>

#include <compare>
#include <map>
#include <memory>
#include <mutex>

#include "kernels/cuda/blas_library.hpp"
#include "kernels/cuda/on_device.hpp"

namespace coshard::modules::detail {
namespace {

using async::Stream;
using cublas::Library;

cudaDataType_t blas_type(DataType dt) {
  switch (dt) {
    case DataType::bf16: return CUDA_R_16BF;
    case DataType::f16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// The largest power of two (up to 256) that divides the address: what cuBLASLt may assume.
std::uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// A product's shape as cuBLASLt plans it (pointers' alignments included: an algorithm chosen for
// 256-byte aligned operands may not run on less).
struct LtKey {
  DataType dt;
  bool trans_a, trans_b;
  std::int64_t m, n, k, lda, ldb, ldc;
  std::uint32_t align_a, align_b, align_c;
  auto operator<=>(const LtKey&) const = default;
};

// cuBLASLt's descriptors and chosen algorithm for one LtKey (usable false: no algorithm).
struct LtPlan {
  explicit LtPlan(const Library& l) : lib(&l) {}
  const Library* lib;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    if (a) lib->lt_matrix_layout_destroy(a);
    if (b) lib->lt_matrix_layout_destroy(b);
    if (c) lib->lt_matrix_layout_destroy(c);
    if (desc) lib->lt_matmul_desc_destroy(desc);
  }
};

constexpr std::size_t kLtWorkspaceBytes = std::size_t{32} << 20;  // cuBLAS's advice for Hopper

// One cuBLAS handle per stream, created on the stream's first GEMM with the stream set once. A
// handle's workspace serves whatever stream it was last set to, so two streams sharing a handle
// (ranks that share a GPU, each with its compute stream) would let their GEMMs overwrite each
// other's workspace while both run (cuBLAS documents a handle's workspace as shared by the
// streams it is set to). cuBLASLt's workspace is per stream for the same reason. Each entry's
// mutex keeps one stream's calls from two threads apart. Entries live as long as the process (a
// stream's address may come back for a new stream of the same device: the handle is set again).
// cuBLAS itself is opened with the first handle (blas_library.hpp): a run that makes none, on the
// CPU, never loads it.
class BlasHandles {
 public:
  struct Entry {
    cublasHandle_t handle = nullptr;
    cublasLtHandle_t lt = nullptr;
    void* lt_workspace = nullptr;  // kLtWorkspaceBytes on the entry's device, made with `lt`
    std::map<LtKey, std::unique_ptr<LtPlan>> plans;
    std::mutex mutex;
  };

  ~BlasHandles() {
    for (auto& [key, entry] : handles_) {
      entry->plans.clear();
      if (entry->lt) lib_->lt_destroy(entry->lt);
      if (entry->lt_workspace) cudaFree(entry->lt_workspace);
      lib_->destroy(entry->handle);
    }
  }

  // Runs fn(*lib, entry) under the entry's mutex, cuBLAS's handle set to `stream`.
  template <class Fn>
  auto with(int device, void* stream, Fn&& fn) -> decltype(fn(std::declval<const Library&>(), std::declval<Entry&>())) {
    Entry* entry = nullptr;
    {
      std::lock_guard lock(mutex_);
      auto& slot = handles_[{device, stream}];
      if (!slot) {
        if (lib_ == nullptr) {
          auto lib = cublas::library();
          if (!lib) {
            handles_.erase({device, stream});
            return fail(lib.error());
          }
          lib_ = *lib;
        }
        cublasHandle_t h = nullptr;
        const cublasStatus_t st = on_device(device, [&] { return lib_->create(&h); });
        if (st != CUBLAS_STATUS_SUCCESS) {
          handles_.erase({device, stream});
          return fail(ErrorCode::device, "cublasCreate on cuda:", device, ": ", lib_->status_name(st));
        }
        slot = std::make_unique<Entry>();
        slot->handle = h;
      }
      entry = slot.get();
    }
    std::lock_guard lock(entry->mutex);
    if (const cublasStatus_t st = lib_->set_stream(entry->handle, static_cast<cudaStream_t>(stream));
        st != CUBLAS_STATUS_SUCCESS) {
      return fail(ErrorCode::device, "cublasSetStream on cuda:", device, ": ", lib_->status_name(st));
    }
    return fn(*lib_, *entry);
  }

 private:
  const Library* lib_ = nullptr;  // set once, under mutex_, before the first entry exists
  std::mutex mutex_;
  std::map<std::pair<int, void*>, std::unique_ptr<Entry>> handles_;
};

BlasHandles& blas() {
  static BlasHandles handles;
  return handles;
}

// cuBLASLt's handle and workspace for the entry, made on first use. false: cuBLASLt is not
// available here (the caller falls back to cuBLAS).
bool ensure_lt(const Library& lib, BlasHandles::Entry& e, int device) {
  if (e.lt) return true;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  const bool ok = on_device(device, [&] {
    return lib.lt_create(&lt) == CUBLAS_STATUS_SUCCESS && cudaMalloc(&workspace, kLtWorkspaceBytes) == cudaSuccess;
  });
  if (!ok) {
    if (lt) lib.lt_destroy(lt);
    cudaGetLastError();  // a failed cudaMalloc leaves its error: not this stream's
    return false;
  }
  e.lt = lt;
  e.lt_workspace = workspace;
  return true;
}

// Plans C [m, n] (row-major) = op(A) op(B) + bias as cuBLASLt's column-major C^T = op(B)^T op(A)^T,
// with the bias (length n) added to each of C^T's columns in the epilogue.
std::unique_ptr<LtPlan> plan_bias_product(const Library& lib, cublasLtHandle_t lt, const LtKey& key) {
  auto plan = std::make_unique<LtPlan>(lib);
  const cudaDataType_t t = blas_type(key.dt);
  const cublasOperation_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
  const cublasOperation_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  bool ok = lib.lt_matmul_desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
            lib.lt_matmul_desc_set_attribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a) ==
                CUBLAS_STATUS_SUCCESS &&
            lib.lt_matmul_desc_set_attribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b) ==
                CUBLAS_STATUS_SUCCESS &&
            lib.lt_matmul_desc_set_attribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue) ==
                CUBLAS_STATUS_SUCCESS &&
            lib.lt_matmul_desc_set_attribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &t, sizeof t) ==
                CUBLAS_STATUS_SUCCESS;
  const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  ok = ok &&
       lib.lt_matrix_layout_create(&plan->a, t, op_a == CUBLAS_OP_N ? u(key.n) : u(key.k),
                                  op_a == CUBLAS_OP_N ? u(key.k) : u(key.n), key.ldb) == CUBLAS_STATUS_SUCCESS &&
       lib.lt_matrix_layout_create(&plan->b, t, op_b == CUBLAS_OP_N ? u(key.k) : u(key.m),
                                  op_b == CUBLAS_OP_N ? u(key.m) : u(key.k), key.lda) == CUBLAS_STATUS_SUCCESS &&
       lib.lt_matrix_layout_create(&plan->c, t, u(key.n), u(key.m), key.ldc) == CUBLAS_STATUS_SUCCESS;
  if (!ok) return plan;
  cublasLtMatmulPreference_t pref = nullptr;
  if (lib.lt_preference_create(&pref) != CUBLAS_STATUS_SUCCESS) return plan;
  const std::uint64_t workspace = kLtWorkspaceBytes;
  lib.lt_preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace);
  lib.lt_preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_b, sizeof key.align_b);
  lib.lt_preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_a, sizeof key.align_a);
  lib.lt_preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c, sizeof key.align_c);
  lib.lt_preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c, sizeof key.align_c);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      lib.lt_algo_get_heuristic(lt, plan->desc, plan->a, plan->b, plan->c, plan->c, pref, 1, &result, &found);
  lib.lt_preference_destroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    plan->algo = result.algo;
    plan->usable = true;
  }
  return plan;
}

}  // namespace

Result<void> cuda_gemm(Stream& s, DataType dt, const GemmArgs& g) {
  return blas().with(s.device().index(), s.native_handle(), [&](const Library& lib, BlasHandles::Entry& e) -> Result<void> {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    const cudaDataType_t t = blas_type(dt), tc = g.c_in_stat_dtype ? CUDA_R_32F : t;
    const cublasStatus_t st = lib.gemm_strided_batched_ex(
        e.handle, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(g.n),
        static_cast<int>(g.m), static_cast<int>(g.k), &g.alpha, g.b, t, static_cast<int>(g.ldb), g.stride_b, g.a, t,
        static_cast<int>(g.lda), g.stride_a, &g.beta, g.c, tc, static_cast<int>(g.ldc), g.stride_c,
        static_cast<int>(g.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
      return fail(ErrorCode::device, "cublasGemmStridedBatchedEx(m=", g.m, ", n=", g.n, ", k=", g.k,
                  ", batch=", g.batch, ") on stream '", s.name(), "': ", lib.status_name(st));
    return {};
  });
}

Result<bool> cuda_gemm_bias(Stream& s, DataType dt, const GemmArgs& g, const void* bias) {
  // The epilogue reads the bias in 16-byte pieces on some algorithms: take only aligned ones.
  if (g.batch != 1 || g.c_in_stat_dtype || g.alpha != 1.0f || g.beta != 0.0f || bias == nullptr || alignment_of(bias) < 16) return false;
  const int device = s.device().index();
  return blas().with(device, s.native_handle(), [&](const Library& lib, BlasHandles::Entry& e) -> Result<bool> {
    if (!ensure_lt(lib, e, device)) return false;
    const LtKey key{dt,   g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, alignment_of(g.a), alignment_of(g.b),
                    alignment_of(g.c)};
    auto& plan = e.plans[key];
    if (!plan) plan = plan_bias_product(lib, e.lt, key);
    if (!plan->usable) return false;
    if (lib.lt_matmul_desc_set_attribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) !=
        CUBLAS_STATUS_SUCCESS)
      return false;
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t st =
        lib.lt_matmul(e.lt, plan->desc, &alpha, g.b, plan->a, g.a, plan->b, &beta, g.c, plan->c, g.c, plan->c,
                       &plan->algo, e.lt_workspace, kLtWorkspaceBytes, static_cast<cudaStream_t>(s.native_handle()));
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
      plan->usable = false;  // nothing ran: cuBLAS and bias_add serve this shape from now on
      return false;
    }
    if (st != CUBLAS_STATUS_SUCCESS)
      return fail(ErrorCode::device, "cublasLtMatmul(m=", g.m, ", n=", g.n, ", k=", g.k, ", bias epilogue) on stream '",
                  s.name(), "': ", lib.status_name(st));
    return true;
  });
}

}  // namespace coshard::modules::detail
