// CUDA kernels: matrix products through cuBLAS and cuBLASLt (blas.cpp here), the rest through
// the launchers of this folder. Attention is, by the backend's form: cuDNN's fused attention
// where it serves the shape (cudnn/, AttentionKernels::cudnn), else the fused kernels of
// attention.cu where they serve the dtype and head size, else cuBLAS products per batch row
// (heads batched) around the causal softmax kernels (the materialized form).
#include <cuda_runtime.h>

#include <cmath>
#include <map>
#include <mutex>

#include "coshard/async/log.hpp"
#include "coshard/modules/module.hpp"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/blas.hpp"
#include "kernels/cuda/cudnn/attention.hpp"
#include "kernels/cuda/kernels.cuh"
#include "kernels/cuda/launch_check.hpp"
#include "kernels/cuda/routing_launch.hpp"
#include "kernels/routing_entries.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {
namespace {

using async::Stream;


// p + elements, for pointers to elements of a runtime size.
struct ElementOffset {
  std::size_t element_size;
  const void* operator()(const void* p, std::int64_t elements) const {
    return static_cast<const std::byte*>(p) + elements * static_cast<std::int64_t>(element_size);
  }
  void* operator()(void* p, std::int64_t elements) const {
    return static_cast<std::byte*>(p) + elements * static_cast<std::int64_t>(element_size);
  }
};

// (routing and quantized blocks: RoutingEntries, launched by routing_launch.cpp)
class CudaKernels final : public RoutingEntries<cuda_launch::Launch> {
 public:
  bool supports(DataType dt) const noexcept override { return cuda_serves(dt); }

  Result<void> gemm(Stream& s, DataType dt, const GemmArgs& g) const override {
    COSHARD_TRY(check(dt));
    return cuda_gemm(s, dt, g);
  }
  // The bias rides cuBLASLt's epilogue where it takes the product; else the product, then bias_add.
  Result<void> gemm_bias(Stream& s, DataType dt, const GemmArgs& g, const void* bias) const override {
    COSHARD_TRY(check(dt));
    COSHARD_TRY_ASSIGN(const bool fused, cuda_gemm_bias(s, dt, g, bias));
    return fused ? Result<void>{} : Kernels::gemm_bias(s, dt, g, bias);
  }

  Result<void> embedding_forward(Stream& s, DataType dt, const std::int32_t* tokens, const void* wte, const void* wpe,
                                 void* out, std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t vocab,
                                 std::int64_t first, std::int64_t rows) const override {
    COSHARD_TRY(check(dt));
    return check_launch(
        cuda::embedding_forward(s.native_handle(), code(dt), tokens, wte, wpe, out, B, T, C, vocab, first, rows),
        "embedding_forward", s);
  }
  Result<void> embedding_backward(Stream& s, DataType dt, const std::int32_t* tokens, const void* dout, void* dwte,
                                  void* dwpe, std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t first,
                                  std::int64_t rows) const override {
    COSHARD_TRY(check(dt));
    return check_launch(
        cuda::embedding_backward(s.native_handle(), code(dt), tokens, dout, dwte, dwpe, B, T, C, first, rows),
        "embedding_backward", s);
  }
  Result<void> layernorm_forward(Stream& s, DataType dt, const void* x, const void* w, const void* b, void* out,
                                 void* mean, void* rstd, std::int64_t N, std::int64_t C, float eps) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::layernorm_forward(s.native_handle(), code(dt), x, w, b, out, static_cast<float*>(mean),
                                                static_cast<float*>(rstd), N, C, eps),
                        "layernorm_forward", s);
  }
  Result<void> layernorm_backward(Stream& s, DataType dt, const void* dout, const void* x, const void* w,
                                  const void* mean, const void* rstd, void* dx, void* dw, void* db, void* scratch,
                                  std::int64_t N, std::int64_t C) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::layernorm_backward(s.native_handle(), code(dt), dout, x, w,
                                                 static_cast<const float*>(mean), static_cast<const float*>(rstd), dx,
                                                 dw, db, static_cast<float*>(scratch), N, C),
                        "layernorm_backward", s);
  }
  Result<void> rmsnorm_forward(Stream& s, DataType dt, const void* x, const void* w, void* out, void* rstd,
                               std::int64_t N, std::int64_t C, float eps) const override {
    COSHARD_TRY(check(dt));
    return check_launch(
        cuda::rmsnorm_forward(s.native_handle(), code(dt), x, w, out, static_cast<float*>(rstd), N, C, eps),
        "rmsnorm_forward", s);
  }
  Result<void> rmsnorm_backward(Stream& s, DataType dt, const void* dout, const void* x, const void* w,
                                const void* rstd, void* dx, void* dw, void* scratch, std::int64_t N,
                                std::int64_t C) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::rmsnorm_backward(s.native_handle(), code(dt), dout, x, w, static_cast<const float*>(rstd),
                                               dx, dw, static_cast<float*>(scratch), N, C),
                        "rmsnorm_backward", s);
  }
  std::int64_t norm_backward_scratch(DataType dt, std::int64_t N, std::int64_t C, bool with_bias) const override {
    return supports(dt) ? cuda::norm_backward_partials(N, C, with_bias) : 0;
  }
  Result<void> swiglu_forward(Stream& s, DataType dt, const void* gate_up, void* out, std::int64_t N,
                              std::int64_t I) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::swiglu_forward(s.native_handle(), code(dt), gate_up, out, N, I), "swiglu_forward", s);
  }
  Result<void> swiglu_backward(Stream& s, DataType dt, const void* gate_up, const void* dout, void* dgate_up,
                               std::int64_t N, std::int64_t I) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::swiglu_backward(s.native_handle(), code(dt), gate_up, dout, dgate_up, N, I),
                        "swiglu_backward", s);
  }
  Result<void> rope(Stream& s, DataType dt, const void* x, void* out, const float* inv_freq, std::int64_t B,
                    std::int64_t T, std::int64_t heads, std::int64_t rotated, std::int64_t hd, bool inverse,
                    std::int64_t first) const override {
    COSHARD_TRY(check(dt));
    return check_launch(
        cuda::rope(s.native_handle(), code(dt), x, out, inv_freq, B, T, heads, rotated, hd, inverse, first), "rope", s);
  }
  Result<void> attention_decode(Stream& s, DataType dt, const void* cache, void* out, float* scratch, std::int64_t B,
                                std::int64_t Tmax, std::int64_t first, std::int64_t Tn, std::int64_t H, std::int64_t KVH,
                                std::int64_t hd) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::attention_decode(s.native_handle(), code(dt), cache, out, scratch, B, Tmax, first, Tn, H,
                                               KVH, hd),
                        "attention_decode", s);
  }
  Result<void> gelu_forward(Stream& s, DataType dt, const void* x, void* out, std::int64_t n) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::gelu_forward(s.native_handle(), code(dt), x, out, n), "gelu_forward", s);
  }
  Result<void> gelu_backward(Stream& s, DataType dt, const void* x, const void* dout, void* dx,
                             std::int64_t n) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::gelu_backward(s.native_handle(), code(dt), x, dout, dx, n), "gelu_backward", s);
  }
  Result<void> add(Stream& s, DataType dt, const void* a, const void* b, void* out, std::int64_t n) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::add(s.native_handle(), code(dt), a, b, out, n), "add", s);
  }
  Result<void> mul(Stream& s, DataType dt, const void* a, const void* b, void* out, std::int64_t n) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::mul(s.native_handle(), code(dt), a, b, out, n), "mul", s);
  }
  Result<void> scale(Stream& s, DataType dt, void* x, float factor, std::int64_t n) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::scale(s.native_handle(), code(dt), x, factor, n), "scale", s);
  }
  Result<void> bias_add(Stream& s, DataType dt, void* out, const void* bias, std::int64_t N,
                        std::int64_t C) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::bias_add(s.native_handle(), code(dt), out, bias, N, C), "bias_add", s);
  }
  Result<void> bias_grad(Stream& s, DataType dt, const void* dout, void* dbias, std::int64_t N,
                         std::int64_t C) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::bias_grad(s.native_handle(), code(dt), dout, dbias, N, C), "bias_grad", s);
  }

  AttentionBuffers attention_buffers(DataType dt, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH,
                                     std::int64_t hd) const override {
    const cudnn::SdpaPlans* plans = cudnn_plans(dt, B, T, H, KVH, hd);
    if (!plans && !fused(dt, hd)) return Kernels::attention_buffers(dt, B, T, H, KVH, hd);
    // Both flash forms keep one f32 a query row; cuDNN's backward scratch is its plan's.
    return {.saved = Shape{B, H, T},
            .saved_dtype = DataType::f32,
            .scratch = plans ? Shape{(plans->backward->scratch_bytes() + 3) / 4} : Shape{B, H, T},
            .scratch_dtype = DataType::f32,
            .backward_reads_output = true};
  }

  Result<void> attention_forward(Stream& s, DataType dt, const void* qkv, void* out, void* saved, std::int64_t B,
                                 std::int64_t T, std::int64_t H, std::int64_t KVH, std::int64_t hd) const override {
    COSHARD_TRY(check(dt));
    COSHARD_TRY(check_attention_size(B, T, H, KVH));
    if (B == 0 || T == 0) return {};  // nothing to attend (a grid of 0 blocks would fail the launch)
    if (const cudnn::SdpaPlans* plans = cudnn_plans(dt, B, T, H, KVH, hd, s.device().index()))
      return cudnn::attention_forward(s, *plans->forward, qkv, out, static_cast<float*>(saved));
    if (!fused(dt, hd)) return materialized_attention_forward(s, dt, qkv, out, saved, B, T, H, KVH, hd);
    return check_launch(cuda::flash_attention_forward(s.native_handle(), code(dt), qkv, out,
                                                      static_cast<float*>(saved), B, T, H, KVH, hd),
                        "flash_attention_forward", s);
  }

  Result<void> attention_backward(Stream& s, DataType dt, const void* dout, const void* qkv, const void* out,
                                  const void* saved, void* dqkv, void* scratch, std::int64_t B, std::int64_t T,
                                  std::int64_t H, std::int64_t KVH, std::int64_t hd) const override {
    COSHARD_TRY(check(dt));
    COSHARD_TRY(check_attention_size(B, T, H, KVH));
    if (B == 0 || T == 0) return {};
    if (const cudnn::SdpaPlans* plans = cudnn_plans(dt, B, T, H, KVH, hd, s.device().index()))
      return cudnn::attention_backward(s, *plans->backward, dout, qkv, out, static_cast<const float*>(saved), dqkv,
                                       scratch);
    if (!fused(dt, hd)) return materialized_attention_backward(s, dt, dout, qkv, saved, dqkv, scratch, B, T, H, KVH, hd);
    return check_launch(cuda::flash_attention_backward(s.native_handle(), code(dt), dout, qkv, out,
                                                       static_cast<const float*>(saved), dqkv,
                                                       static_cast<float*>(scratch), B, T, H, KVH, hd),
                        "flash_attention_backward", s);
  }

  // Grouped-query attention as batched products: for each position r within a group of
  // H / KVH query heads, one product per batch over the KVH groups (query head g * group + r
  // with key/value head g). At KVH = H: one product over the heads, as before.
  Result<void> materialized_attention_forward(Stream& s, DataType dt, const void* qkv, void* out, void* probs,
                                              std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH,
                                              std::int64_t hd) const {
    const std::int64_t C = H * hd, W = (H + 2 * KVH) * hd, group = H / KVH;
    const ElementOffset at{size_of(dt)};
    const ElementOffset& at_mut = at;
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t r = 0; r < group; ++r) {
        // Raw scores S = Q K^T per head; the softmax applies the 1/sqrt(hd) scale.
        GemmArgs scores{.trans_b = true, .m = T, .n = T, .k = hd, .a = at(qkv, b * T * W + r * hd), .lda = W,
                        .b = at(qkv, b * T * W + C), .ldb = W, .c = at_mut(probs, (b * H + r) * T * T), .ldc = T,
                        .batch = KVH, .stride_a = group * hd, .stride_b = hd, .stride_c = group * T * T};
        COSHARD_TRY(gemm(s, dt, scores));
      }
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    COSHARD_TRY(check_launch(cuda::causal_softmax(s.native_handle(), code(dt), probs, B * H, T, scale),
                             "causal_softmax", s));
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t r = 0; r < group; ++r) {
        GemmArgs o{.m = T, .n = hd, .k = T, .a = at(probs, (b * H + r) * T * T), .lda = T,
                   .b = at(qkv, b * T * W + C + KVH * hd), .ldb = W, .c = at_mut(out, b * T * C + r * hd), .ldc = C,
                   .batch = KVH, .stride_a = group * T * T, .stride_b = hd, .stride_c = group * hd};
        COSHARD_TRY(gemm(s, dt, o));
      }
    }
    return {};
  }

  // dK and dV of a key/value head sum over its group's query heads in order: r = 0 writes, the
  // others add (beta 1).
  Result<void> materialized_attention_backward(Stream& s, DataType dt, const void* dout, const void* qkv,
                                               const void* probs, void* dqkv, void* scratch, std::int64_t B,
                                               std::int64_t T, std::int64_t H, std::int64_t KVH,
                                               std::int64_t hd) const {
    const std::int64_t C = H * hd, W = (H + 2 * KVH) * hd, group = H / KVH;
    const ElementOffset at{size_of(dt)};
    const ElementOffset& at_mut = at;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t row0 = b * T * W;
      for (std::int64_t r = 0; r < group; ++r) {
        const void* dO = at(dout, b * T * C + r * hd);
        const void* p = at(probs, (b * H + r) * T * T);
        void* dp = at_mut(scratch, (b * H + r) * T * T);
        GemmArgs g1{.trans_b = true, .m = T, .n = T, .k = hd, .a = dO, .lda = C, .b = at(qkv, row0 + C + KVH * hd),
                    .ldb = W, .c = dp, .ldc = T, .batch = KVH, .stride_a = group * hd, .stride_b = hd,
                    .stride_c = group * T * T};
        COSHARD_TRY(gemm(s, dt, g1));
        GemmArgs g2{.trans_a = true, .m = T, .n = hd, .k = T, .a = p, .lda = T, .b = dO, .ldb = C,
                    .c = at_mut(dqkv, row0 + C + KVH * hd), .ldc = W, .beta = r == 0 ? 0.0f : 1.0f, .batch = KVH,
                    .stride_a = group * T * T, .stride_b = group * hd, .stride_c = hd};
        COSHARD_TRY(gemm(s, dt, g2));
      }
    }
    COSHARD_TRY(check_launch(cuda::causal_softmax_backward(s.native_handle(), code(dt), probs, scratch, B * H, T),
                             "causal_softmax_backward", s));
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t row0 = b * T * W;
      for (std::int64_t r = 0; r < group; ++r) {
        const void* dp = at(scratch, (b * H + r) * T * T);
        GemmArgs g3{.m = T, .n = hd, .k = T, .a = dp, .lda = T, .b = at(qkv, row0 + C), .ldb = W,
                    .c = at_mut(dqkv, row0 + r * hd), .ldc = W, .alpha = scale, .batch = KVH,
                    .stride_a = group * T * T, .stride_b = hd, .stride_c = group * hd};
        COSHARD_TRY(gemm(s, dt, g3));
        GemmArgs g4{.trans_a = true, .m = T, .n = hd, .k = T, .a = dp, .lda = T, .b = at(qkv, row0 + r * hd),
                    .ldb = W, .c = at_mut(dqkv, row0 + C), .ldc = W, .alpha = scale, .beta = r == 0 ? 0.0f : 1.0f,
                    .batch = KVH, .stride_a = group * T * T, .stride_b = group * hd, .stride_c = hd};
        COSHARD_TRY(gemm(s, dt, g4));
      }
    }
    return {};
  }

  Result<void> cross_entropy_forward(Stream& s, DataType dt, const void* logits, const std::int32_t* targets,
                                     void* loss, void* scratch, std::int64_t N, std::int64_t V) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::cross_entropy_forward(s.native_handle(), code(dt), logits, targets,
                                                    static_cast<float*>(loss), static_cast<float*>(scratch), N, V),
                        "cross_entropy_forward", s);
  }
  Result<void> cross_entropy_backward(Stream& s, DataType dt, const void* logits, const std::int32_t* targets,
                                      const void* seed, void* dlogits, std::int64_t N,
                                      std::int64_t V) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::cross_entropy_backward(s.native_handle(), code(dt), logits, targets,
                                                     static_cast<const float*>(seed), dlogits, N, V),
                        "cross_entropy_backward", s);
  }
  Result<void> row_max(Stream& s, DataType dt, const void* logits, void* max, std::int64_t N,
                       std::int64_t V) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::row_max(s.native_handle(), code(dt), logits, static_cast<float*>(max), N, V), "row_max", s);
  }
  Result<void> vocab_ce_sums(Stream& s, DataType dt, const void* logits, const std::int32_t* targets, const void* max,
                             void* sums, std::int64_t N, std::int64_t V, std::int64_t first,
                             std::int64_t vocab) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::vocab_ce_sums(s.native_handle(), code(dt), logits, targets, static_cast<const float*>(max),
                                            static_cast<float*>(sums), N, V, first, vocab),
                        "vocab_ce_sums", s);
  }
  Result<void> chunk_ce_sums(Stream& s, DataType dt, const void* logits, const std::int32_t* targets, void* max,
                             void* sums, std::int64_t N, std::int64_t V, std::int64_t first,
                             std::int64_t vocab) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::chunk_ce_sums(s.native_handle(), code(dt), logits, targets, static_cast<float*>(max),
                                            static_cast<float*>(sums), N, V, first, vocab),
                        "chunk_ce_sums", s);
  }
  Result<void> vocab_ce_loss(Stream& s, DataType dt, const void* max, const void* sums, void* loss,
                             std::int64_t N) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::vocab_ce_loss(s.native_handle(), static_cast<const float*>(max),
                                            static_cast<const float*>(sums), static_cast<float*>(loss), N),
                        "vocab_ce_loss", s);
  }
  Result<void> vocab_ce_backward(Stream& s, DataType dt, const void* logits, const std::int32_t* targets,
                                 const void* max, const void* sums, const void* seed, void* dlogits, std::int64_t N,
                                 std::int64_t V, std::int64_t first) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::vocab_ce_backward(s.native_handle(), code(dt), logits, targets,
                                                static_cast<const float*>(max), static_cast<const float*>(sums),
                                                static_cast<const float*>(seed), dlogits, N, V, first),
                        "vocab_ce_backward", s);
  }
  Result<void> mse_forward(Stream& s, DataType dt, const void* pred, const void* target, void* loss, void* scratch,
                           std::int64_t n) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::mse_forward(s.native_handle(), code(dt), pred, target, static_cast<float*>(loss),
                                          static_cast<float*>(scratch), n),
                        "mse_forward", s);
  }
  Result<void> mse_backward(Stream& s, DataType dt, const void* pred, const void* target, const void* seed,
                            void* dpred, std::int64_t n) const override {
    COSHARD_TRY(check(dt));
    return check_launch(cuda::mse_backward(s.native_handle(), code(dt), pred, target, static_cast<const float*>(seed),
                                           dpred, n),
                        "mse_backward", s);
  }
  Result<void> cast(Stream& s, DataType from, const void* src, DataType to, void* dst,
                    std::int64_t n) const override {
    COSHARD_TRY(check(from));
    COSHARD_TRY(check(to));
    return check_launch(cuda::cast(s.native_handle(), code(from), src, code(to), dst, n), "cast", s);
  }

  Result<void> step_begin(Stream& s, StepState* state) const override {
    return check_launch(cuda::step_begin(s.native_handle(), state), "step_begin", s);
  }
  Result<void> grad_stats(Stream& s, DataType gdt, const void* grad, std::int64_t n,
                          StepState* state) const override {
    COSHARD_TRY(check(gdt));
    return check_launch(cuda::grad_stats(s.native_handle(), code(gdt), grad, n, state), "grad_stats", s);
  }
  Result<void> adamw(Stream& s, float* master, DataType gdt, const void* grad, float* m, float* v, DataType pdt,
                     void* param_out, std::int64_t n, const AdamArgs& args, const StepState* state) const override {
    COSHARD_TRY(check(gdt));
    COSHARD_TRY(check(pdt));
    return check_launch(
        cuda::adamw(s.native_handle(), master, code(gdt), grad, m, v, code(pdt), param_out, n, args, state), "adamw",
        s);
  }
  Result<void> grad_stats_multi(Stream& s, std::span<const OptimizerTensor> tensors,
                                StepState* state) const override {
    for (const auto& t : tensors) COSHARD_TRY(check(static_cast<DataType>(t.gdt)));
    return check_launch(cuda::grad_stats_multi(s.native_handle(), tensors.data(), static_cast<int>(tensors.size()), state),
                        "grad_stats_multi", s);
  }
  Result<void> adamw_multi(Stream& s, std::span<const OptimizerTensor> tensors, const AdamArgs& args,
                           const StepState* state) const override {
    for (const auto& t : tensors) {
      COSHARD_TRY(check(static_cast<DataType>(t.gdt)));
      if (t.param_out) COSHARD_TRY(check(static_cast<DataType>(t.pdt)));
    }
    return check_launch(
        cuda::adamw_multi(s.native_handle(), tensors.data(), static_cast<int>(tensors.size()), args, state),
        "adamw_multi", s);
  }
  Result<void> sgd(Stream& s, float* master, DataType gdt, const void* grad, float* buf, DataType pdt,
                   void* param_out, std::int64_t n, const SgdArgs& args, const StepState* state) const override {
    COSHARD_TRY(check(gdt));
    COSHARD_TRY(check(pdt));
    return check_launch(
        cuda::sgd(s.native_handle(), master, code(gdt), grad, buf, code(pdt), param_out, n, args, state), "sgd", s);
  }
  Result<void> step_end(Stream& s, StepState* state, const LossScaleArgs& args) const override {
    return check_launch(cuda::step_end(s.native_handle(), state, args), "step_end", s);
  }

  explicit CudaKernels(AttentionKernels form) : form_(form) {}

 private:
  static int code(DataType dt) noexcept { return static_cast<int>(dt); }
  bool fused(DataType dt, std::int64_t hd) const noexcept {
    return form_ != AttentionKernels::materialized && cuda::flash_attention_supported(code(dt), hd);
  }
  // cuDNN's plans for the shape on `device` (-1: the current device), or null: not the cudnn
  // form, or cuDNN does not serve the shape there (decided once per shape and said once, as a
  // warning; the fused kernels then run). The forward and backward agree, each answer being kept.
  const cudnn::SdpaPlans* cudnn_plans(DataType dt, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH,
                                      std::int64_t hd, int device = -1) const {
    if (form_ != AttentionKernels::cudnn) return nullptr;
    if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return nullptr;
    const cudnn::SdpaShape shape{.dtype = dt, .B = B, .T = T, .H = H, .KVH = KVH, .hd = hd};
    std::lock_guard lock(cudnn_mutex_);
    auto [it, fresh] = cudnn_answers_.try_emplace({device, shape});
    if (fresh) {
      if (auto plans = cudnn::attention_plans(device, shape))
        it->second = *plans;
      else
        COSHARD_LOG_WARN(modules, "--attention cudnn on cuda:{}: {}; the fused kernels run for this shape", device,
                         plans.error().message());
    }
    return it->second.forward ? &it->second : nullptr;
  }
  // The fused kernels index rows and grid dimensions in 32 bits.
  static Result<void> check_attention_size(std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH) {
    constexpr std::int64_t kGrid = 65535;
    if (T > (std::int64_t{1} << 30) || H > kGrid || KVH > kGrid || B > kGrid)
      return fail(ErrorCode::invalid_argument, "attention: B=", B, " T=", T, " H=", H, " KVH=", KVH,
                  ": the CUDA kernels take T up to 2^30 and B, H, KVH up to ", kGrid);
    return {};
  }
  AttentionKernels form_;
  mutable std::mutex cudnn_mutex_;
  mutable std::map<std::pair<int, cudnn::SdpaShape>, cudnn::SdpaPlans> cudnn_answers_;
  Result<void> check(DataType dt) const { return check_cuda_dtype(dt); }
};

static_assert(static_cast<int>(DataType::f32) == 0 && static_cast<int>(DataType::f64) == 1 &&
              static_cast<int>(DataType::f16) == 2 && static_cast<int>(DataType::bf16) == 3);

}  // namespace

const Kernels* cuda_kernels() noexcept {
  static const CudaKernels kernels(AttentionKernels::fused);
  return &kernels;
}

const Kernels* cuda_kernels_materialized_attention() noexcept {
  static const CudaKernels kernels(AttentionKernels::materialized);
  return &kernels;
}

Result<std::string> cudnn_attention_library() {
  COSHARD_TRY_ASSIGN(const cudnn::Library* lib, cudnn::library());
  return "cuDNN " + cudnn::version_string(lib->version) + " (" + lib->path + ")";
}

const Kernels* cuda_kernels_cudnn_attention() noexcept {
  static const CudaKernels kernels(AttentionKernels::cudnn);
  return &kernels;
}

}  // namespace coshard::modules::detail
