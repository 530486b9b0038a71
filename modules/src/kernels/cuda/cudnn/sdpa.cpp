#include "kernels/cuda/cudnn/sdpa.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <limits>

namespace coshard::modules::detail::cudnn {
namespace {

// Tensors given at execution; virtual ones are numbered from kFirstVirtual.
enum Uid : std::int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegInf, kOne, kDO, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum,
  kFirstVirtual = 100,
};

cudnnDataType_t io_type(DataType dt) { return dt == DataType::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF; }

// The strides of coshard's layouts, as 4-d [batch, head, row, column] views.
struct Layout {
  std::int64_t B, T, H, KVH, hd, W;  // W: a qkv row's width, (H + 2 KVH) hd
  explicit Layout(const SdpaShape& s) : B(s.B), T(s.T), H(s.H), KVH(s.KVH), hd(s.hd), W((s.H + 2 * s.KVH) * s.hd) {}
  Dims qkv_strides() const { return {T * W, hd, W, 1}; }
  Dims qkv_transposed() const { return {T * W, hd, 1, W}; }  // [B, heads, hd, T]
  Dims out_strides() const { return {T * H * hd, hd, H * hd, 1}; }
  Dims scores() const { return {B, H, T, T}; }
  Dims score_strides() const { return {H * T * T, T * T, T, 1}; }
  Dims score_transposed() const { return {H * T * T, T * T, 1, T}; }
  Dims row_stat() const { return {B, H, T, 1}; }
  Dims row_stat_strides() const { return {H * T, T, 1, 1}; }
  Dims heads_packed(std::int64_t heads) const { return {heads * T * hd, T * hd, hd, 1}; }
};

// Scores with the causal mask: a row's columns past the row become -inf.
cudnnBackendDescriptor_t causal_mask(GraphBuilder& g, const Layout& l, cudnnBackendDescriptor_t scores,
                                     cudnnBackendDescriptor_t neg_inf) {
  auto row = g.virtual_tensor(CUDNN_DATA_INT32, l.scores(), l.score_strides());
  auto col = g.virtual_tensor(CUDNN_DATA_INT32, l.scores(), l.score_strides());
  auto keep = g.virtual_tensor(CUDNN_DATA_BOOLEAN, l.scores(), l.score_strides());
  auto masked = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, neg_inf, keep, masked);
  return masked;
}

// S = scale * Q K^T, masked.
cudnnBackendDescriptor_t masked_scores(GraphBuilder& g, const Layout& l, cudnnBackendDescriptor_t q,
                                       cudnnBackendDescriptor_t kt, cudnnBackendDescriptor_t scale,
                                       cudnnBackendDescriptor_t neg_inf) {
  auto s = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.matmul(q, kt, s);
  auto scaled = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
  return causal_mask(g, l, scaled, neg_inf);
}

// The tensors both passes name: Q, K^T, O, the statistics, and the scalars.
struct Operands {
  cudnnBackendDescriptor_t q, kt, o, stats, scale, neg_inf;
};

Operands operands(GraphBuilder& g, const Layout& l, cudnnDataType_t io) {
  return {.q = g.tensor(io, {l.B, l.H, l.T, l.hd}, l.qkv_strides(), kQ, false),
          .kt = g.tensor(io, {l.B, l.KVH, l.hd, l.T}, l.qkv_transposed(), kK, false),
          .o = g.tensor(io, {l.B, l.H, l.T, l.hd}, l.out_strides(), kO, false),
          .stats = g.tensor(CUDNN_DATA_FLOAT, l.row_stat(), l.row_stat_strides(), kStats, false),
          .scale = g.scalar(kScale),
          .neg_inf = g.scalar(kNegInf)};
}

void forward_graph(GraphBuilder& g, const SdpaShape& shape) {
  const Layout l(shape);
  const cudnnDataType_t io = io_type(shape.dtype);
  const auto [q, kt, o, stats, scale, neg_inf] = operands(g, l, io);
  auto v = g.tensor(io, {l.B, l.KVH, l.T, l.hd}, l.qkv_strides(), kV, false);

  auto s = masked_scores(g, l, q, kt, scale, neg_inf);
  auto max = g.virtual_tensor(CUDNN_DATA_FLOAT, l.row_stat(), l.row_stat_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, max);
  auto shifted = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, s, max, nullptr, shifted);
  auto e = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, e);
  auto sum = g.virtual_tensor(CUDNN_DATA_FLOAT, l.row_stat(), l.row_stat_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  auto log_sum = g.virtual_tensor(CUDNN_DATA_FLOAT, l.row_stat(), l.row_stat_strides());
  g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, max, log_sum, nullptr, stats);
  auto p = g.virtual_tensor(io, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_DIV, e, sum, nullptr, p);
  g.matmul(p, v, o);
}

// grad [B, H, T, hd] into a head-grouped output [B, KVH, T, hd]: directly where H = KVH, else
// through a virtual full-head product summed over each group.
void grouped_product(GraphBuilder& g, const Layout& l, cudnnDataType_t io, cudnnBackendDescriptor_t a,
                     cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t out) {
  if (l.H == l.KVH) {
    g.matmul(a, b, out);
    return;
  }
  auto full = g.virtual_tensor(io, {l.B, l.H, l.T, l.hd}, l.heads_packed(l.H));
  g.matmul(a, b, full);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
}

void backward_graph(GraphBuilder& g, const SdpaShape& shape) {
  const Layout l(shape);
  const cudnnDataType_t io = io_type(shape.dtype);
  const auto [q, kt, o, stats, scale, neg_inf] = operands(g, l, io);
  auto vt = g.tensor(io, {l.B, l.KVH, l.hd, l.T}, l.qkv_transposed(), kV, false);
  auto d_o = g.tensor(io, {l.B, l.H, l.T, l.hd}, l.out_strides(), kDO, false);
  auto dq = g.tensor(io, {l.B, l.H, l.T, l.hd}, l.qkv_strides(), kDQ, false);
  auto dk = g.tensor(io, {l.B, l.KVH, l.T, l.hd}, l.qkv_strides(), kDK, false);
  auto dv = g.tensor(io, {l.B, l.KVH, l.T, l.hd}, l.qkv_strides(), kDV, false);
  auto softmax_sum = g.tensor(CUDNN_DATA_FLOAT, l.row_stat(), l.row_stat_strides(), kSoftmaxSum, false);
  auto one = g.scalar(kOne);

  // Each row's sum of dO * O: softmax's backward term.
  auto d_o_o = g.virtual_tensor(CUDNN_DATA_FLOAT, {l.B, l.H, l.T, l.hd}, {l.H * l.T * l.hd, l.T * l.hd, l.H * l.hd, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, o, nullptr, d_o_o);
  auto row_sum = g.virtual_tensor(CUDNN_DATA_FLOAT, l.row_stat(), l.row_stat_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, d_o_o, row_sum);
  g.pointwise(CUDNN_POINTWISE_MUL, row_sum, one, nullptr, softmax_sum);

  // P = exp(S - stats), recomputed.
  auto s = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.matmul(q, kt, s);
  auto scaled = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
  auto shifted = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, stats, nullptr, shifted);
  auto masked = causal_mask(g, l, shifted, neg_inf);
  auto p = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_EXP, masked, nullptr, nullptr, p);

  // dV = P^T dO.
  auto pt = g.virtual_tensor(io, l.scores(), l.score_transposed());
  g.reshape(p, pt);
  grouped_product(g, l, io, pt, d_o, dv);

  // dS = P * (dO V^T - rowsum) * scale.
  auto dp = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.matmul(d_o, vt, dp);
  auto centred = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, dp, softmax_sum, nullptr, centred);
  auto weighted = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, centred, p, nullptr, weighted);
  auto ds = g.virtual_tensor(CUDNN_DATA_FLOAT, l.scores(), l.score_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, weighted, scale, nullptr, ds);

  // dK = dS^T Q.
  auto dst = g.virtual_tensor(io, l.scores(), l.score_transposed());
  g.reshape(ds, dst);
  grouped_product(g, l, io, dst, q, dk);

  // dQ = dS K.
  auto k = g.virtual_tensor(io, {l.B, l.KVH, l.T, l.hd}, l.qkv_strides());
  g.reshape(kt, k);
  if (shape.deterministic) {
    g.matmul(ds, k, dq);
  } else {
    auto accum = g.tensor(CUDNN_DATA_FLOAT, {l.B, l.H, l.T, l.hd}, l.heads_packed(l.H), kDQAccum, false);
    g.matmul(ds, k, accum);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, accum, nullptr, nullptr, dq);
  }
}

std::int64_t align256(std::int64_t n) { return (n + 255) / 256 * 256; }

}  // namespace

std::string sdpa_unsupported(const SdpaShape& s) {
  if (s.dtype != DataType::bf16 && s.dtype != DataType::f16)
    return "dtype " + std::string(async::to_string(s.dtype)) + ": cuDNN's fused attention takes bf16 and f16";
  if (s.hd <= 0 || s.hd > 128 || s.hd % 8 != 0)
    return "head size " + std::to_string(s.hd) + ": cuDNN's fused attention takes multiples of 8 up to 128";
  if (s.B <= 0 || s.T <= 0 || s.H <= 0 || s.KVH <= 0 || s.H % s.KVH != 0)
    return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) +
           " KVH=" + std::to_string(s.KVH) + ": expected positive sizes with H a multiple of KVH";
  return {};
}

std::int64_t SdpaPlan::scratch_bytes() const {
  return align256(softmax_sum_bytes) + align256(dq_accum_bytes) + align256(workspace_bytes);
}

Result<std::unique_ptr<SdpaPlan>> build_sdpa_plan(const Library& lib, const SdpaShape& shape, SdpaPass pass,
                                                  const PlanTarget& target) {
  const char* pass_name = pass == SdpaPass::forward ? "forward" : "backward";
  auto describe = [&] {
    return std::string("cuDNN attention ") + pass_name + " (" + std::string(async::to_string(shape.dtype)) +
           " B=" + std::to_string(shape.B) + " T=" + std::to_string(shape.T) + " H=" + std::to_string(shape.H) +
           " KVH=" + std::to_string(shape.KVH) + " hd=" + std::to_string(shape.hd) + ", cuDNN " +
           version_string(lib.version) + ")";
  };
  if (std::string why = sdpa_unsupported(shape); !why.empty()) return fail(ErrorCode::unsupported, describe(), ": ", why);
  GraphBuilder g(lib, kFirstVirtual);
  if (pass == SdpaPass::forward)
    forward_graph(g, shape);
  else
    backward_graph(g, shape);
  ChosenPlan chosen;
  if (!g.error()) chosen = g.plan(target);
  if (g.error()) return fail(ErrorCode::unsupported, describe(), ": ", *g.error());

  auto plan = std::make_unique<SdpaPlan>();
  plan->plan_ = std::move(chosen.plan);
  plan->engine = chosen.engine;
  plan->workspace_bytes = chosen.workspace_bytes;
  plan->shape = shape;
  plan->pass = pass;
  plan->lib_ = &lib;
  plan->graph_ = g.take();
  auto& v = *plan->scalars_;
  v = {1.0f / std::sqrt(static_cast<float>(shape.hd)), -std::numeric_limits<float>::infinity(), 1.0f};
  plan->scalar_uids_ = {kScale, kNegInf};
  plan->scalar_pointers_ = {&v[0], &v[1]};
  if (pass == SdpaPass::backward) {
    plan->scalar_uids_.push_back(kOne);
    plan->scalar_pointers_.push_back(&v[2]);
    plan->softmax_sum_bytes = shape.B * shape.H * shape.T * 4;
    if (!shape.deterministic) plan->dq_accum_bytes = shape.B * shape.H * shape.T * shape.hd * 4;
  }
  return plan;
}

Result<void> SdpaPlan::execute(cudnnHandle_t handle, std::vector<std::int64_t> uids, std::vector<void*> pointers,
                               void* workspace) const {
  uids.insert(uids.end(), scalar_uids_.begin(), scalar_uids_.end());
  pointers.insert(pointers.end(), scalar_pointers_.begin(), scalar_pointers_.end());
  auto pack = Descriptor::make(*lib_, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  if (!pack) return fail(pack.error());
  const auto n = static_cast<std::int64_t>(uids.size());
  cudnnStatus_t st =
      lib_->set_attribute(pack->get(), CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data());
  if (st == CUDNN_STATUS_SUCCESS)
    st = lib_->set_attribute(pack->get(), CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n,
                             pointers.data());
  if (st == CUDNN_STATUS_SUCCESS)
    st = lib_->set_attribute(pack->get(), CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  if (st == CUDNN_STATUS_SUCCESS) st = lib_->finalize(pack->get());
  if (st == CUDNN_STATUS_SUCCESS) {
    std::lock_guard lock(execute_mutex_);
    st = lib_->execute(handle, plan_.get(), pack->get());
  }
  if (st != CUDNN_STATUS_SUCCESS)
    return fail(ErrorCode::device, "cuDNN attention ", pass == SdpaPass::forward ? "forward" : "backward",
                " (engine ", engine, "): ", lib_->describe(st));
  return {};
}

std::array<void*, 3> SdpaPlan::heads(const void* rows) const {
  constexpr std::int64_t e = 2;  // bf16 and f16
  auto* base = const_cast<std::byte*>(static_cast<const std::byte*>(rows));
  return {base, base + shape.H * shape.hd * e, base + (shape.H + shape.KVH) * shape.hd * e};
}

Result<void> SdpaPlan::forward(cudnnHandle_t handle, void* stream, const void* qkv, void* out, float* stats) const {
  const auto [q, k, v] = heads(qkv);
  void* workspace = nullptr;
  auto* s = static_cast<cudaStream_t>(stream);
  if (workspace_bytes > 0) {
    if (const cudaError_t err = cudaMallocAsync(&workspace, static_cast<std::size_t>(workspace_bytes), s);
        err != cudaSuccess)
      return fail(ErrorCode::out_of_memory, "cuDNN attention forward: cudaMallocAsync(", workspace_bytes,
                  " bytes): ", cudaGetErrorString(err));
  }
  auto done = execute(handle, {kQ, kK, kV, kO, kStats}, {q, k, v, out, stats}, workspace);
  if (workspace) cudaFreeAsync(workspace, s);
  return done;
}

Result<void> SdpaPlan::backward(cudnnHandle_t handle, void* stream, const void* dout, const void* qkv, const void* out,
                                const float* stats, void* dqkv, void* scratch) const {
  const auto [q, k, v] = heads(qkv);
  const auto [dq, dk, dv] = heads(dqkv);
  auto* sc = static_cast<std::byte*>(scratch);
  void* softmax_sum = sc;
  void* accum = sc + align256(softmax_sum_bytes);
  void* workspace = sc + align256(softmax_sum_bytes) + align256(dq_accum_bytes);
  std::vector<std::int64_t> uids = {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum};
  std::vector<void*> ptrs = {q,  k,  v,  const_cast<void*>(out), const_cast<void*>(dout), const_cast<float*>(stats),
                             dq, dk, dv, softmax_sum};
  if (dq_accum_bytes > 0) {
    // cuDNN before 9.6 adds into the accumulator; later versions clear it themselves.
    if (lib_->version < 90600) {
      if (const cudaError_t err =
              cudaMemsetAsync(accum, 0, static_cast<std::size_t>(dq_accum_bytes), static_cast<cudaStream_t>(stream));
          err != cudaSuccess)
        return fail(ErrorCode::device, "cuDNN attention backward: clearing dQ's accumulator: ",
                    cudaGetErrorString(err));
    }
    uids.push_back(kDQAccum);
    ptrs.push_back(accum);
  }
  return execute(handle, std::move(uids), std::move(ptrs), workspace);
}

Result<const SdpaPlan*> SdpaPlanCache::get(const Library& lib, const SdpaShape& shape, SdpaPass pass) {
  std::lock_guard lock(mutex_);
  auto it = plans_.find({shape, pass});
  if (it == plans_.end()) {
    ++builds_;
    it = plans_.emplace(std::pair{shape, pass}, build_sdpa_plan(lib, shape, pass, target_)).first;
  }
  if (!it->second) return fail(it->second.error());
  return it->second->get();
}

std::size_t SdpaPlanCache::size() const {
  std::lock_guard lock(mutex_);
  return plans_.size();
}

std::size_t SdpaPlanCache::builds() const {
  std::lock_guard lock(mutex_);
  return builds_;
}

}  // namespace coshard::modules::detail::cudnn
